"""An episode's end as its Outcome: the reason, the reward, and every record bounded.

Every way an episode ends makes its Outcome here, once: the reason is one of
results.REASONS (Outcome refuses any other); the reward is the grader's only when it
graded and its reward lies in the environment's reward_range, the bottom of that range
otherwise; the texts the Outcome keeps are cut to bounds the agent cannot grow
(REC-BOUND-01, karotte/outcome.py). Custody alone decides two reasons before any grading:
a kill that was not confirmed, and a deliverable that the scan rejected.

_Flow (karotte/episode.py) is a Scoring: the phases that lead to the end (reset, the tool
calls under the budget, custody and grading) are its own.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from .custody import Custody, deliverable_violations
from .environment import Environment
from .grading import GradeReport
from .outcome import (EPISODE_REACHES, GRADER_LOG_RECORD_LIMIT, INFRA_ERROR_LIMIT, ExecRecord,
                      Outcome, Timings, bounded_details)
from .results import EgressRecord, capped


class Scoring:
    """The end of an episode, from what its phases recorded: the attributes below, which
    _Flow sets."""

    env: Environment
    name: str
    seed: int  # the trainer's
    log: list[ExecRecord]
    t_start: float
    t_reset: float
    t_agent: float
    egress_of: Callable[[], EgressRecord | None]
    running: bool
    finished: Outcome | None

    def outcome(self, reward: float | None, reason: str, custody: Custody | None = None,
                report: GradeReport | None = None, infra_error: str | None = None,
                grade_seconds: float = 0.0) -> Outcome:
        """The Outcome the episode ends with (reward None: the bottom of reward_range); the
        episode no longer runs."""
        bottom = self.env.reward_range[0]
        timings = Timings(self.t_reset, self.t_agent,
                          custody.kill_seconds if custody else 0.0,
                          custody.scan_seconds if custody else 0.0, grade_seconds,
                          time.monotonic() - self.t_start)
        details, dropped = bounded_details(report.details) if report else ({}, 0)
        egress = self.egress_of()
        self.running = False
        self.finished = Outcome(
            self.name, self.seed, bottom if reward is None else reward, reason,
            custody.violations if custody else (),
            custody.violations_dropped if custody else 0,
            None if infra_error is None else capped(infra_error, INFRA_ERROR_LIMIT),
            timings, tuple(self.log), details, dropped,
            capped(report.log, GRADER_LOG_RECORD_LIMIT) if report else "",
            custody.changed_paths if custody else 0, custody.deleted_paths if custody else 0,
            egress.bounded(EPISODE_REACHES) if egress is not None else None,
            report.egress if report else None)
        return self.finished

    def judge(self, custody: Custody) -> Outcome | None:
        """The outcome decided before grading, if any."""
        if not custody.kill_confirmed:
            return self.outcome(None, "kill_unconfirmed", custody,
                                infra_error=None)
        if deliverable_violations(custody.violations, self.env.deliverables):
            return self.outcome(None, "scanner_rejected_required_output", custody)
        return None

    def graded(self, custody: Custody, report: GradeReport, seconds: float) -> Outcome:
        """The outcome of a grading: the grader's reason, or its reward within reward_range."""
        if report.reason != "graded":
            return self.outcome(None, report.reason, custody, report, grade_seconds=seconds)
        bottom, top = self.env.reward_range
        if not bottom <= report.reward <= top:
            # A grader that scores the agent's raw input (1 - |x - e| / e) must not hand the
            # trainer -1e296: outside reward_range is the bottom, with the value kept.
            report = replace(report, details={**report.details, "rejected_reward": report.reward})
            return self.outcome(None, "reward_out_of_range", custody, report,
                                grade_seconds=seconds)
        return self.outcome(report.reward, "graded", custody, report, grade_seconds=seconds)
