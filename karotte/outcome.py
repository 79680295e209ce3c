"""The record of an episode: the Outcome, its Timings and its log of ExecRecords.

REC-BOUND-01: every text an Outcome keeps has a size that the agent cannot grow, as
bytes of its JSON form (results.capped). The log has one record per tool call, and the
budget bounds the calls; the violations are bounded by the scans (docs/scan.md), the
workspace's and the image diff's together (karotte/custody.py); the egress records hold
at most EPISODE_REACHES reaches each, their text capped (results.EgressRecord.since).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .results import REASONS, EgressRecord, IpRecord
from .scan import Violation
from .spec import KiB

ARGUMENT_LOG_LIMIT = 4 * KiB  # of each logged command or path
DETAILS_LIMIT = 64 * KiB  # of the grader's details, whole top-level entries
GRADER_LOG_RECORD_LIMIT = 64 * KiB
INFRA_ERROR_LIMIT = 4 * KiB
EPISODE_REACHES = 200  # of the agent's egress an Outcome holds (the proxy keeps 1000): with
# grader_egress's RUN_REACHES, the record stays under 1 MiB (REC-BOUND-01); egress_ip too


@dataclass(frozen=True)
class ExecRecord:
    tool: str  # "bash", "read_file", "write_file", "give_up"
    argument: str  # the command, or the path: cut to ARGUMENT_LOG_LIMIT bytes of JSON
    exit_code: int | None  # None: not run (refused, or the budget was used up)
    timed_out: bool
    truncated: bool
    wall_seconds: float
    reaches: int = 0  # egress: destinations the call asked for (ExecResult.egress.total)
    refused: int = 0  # of those the call's ExecResult holds, the refused ones


@dataclass(frozen=True)
class Timings:
    """Seconds per phase of the episode."""

    reset: float = 0.0
    agent: float = 0.0  # the tool calls together
    kill: float = 0.0
    scan: float = 0.0  # the workspace's scan and copy, and the image diff's
    grade: float = 0.0
    total: float = 0.0


@dataclass(frozen=True)
class Outcome:
    """How an episode ended. Every field has a bound that does not depend on the agent
    (REC-BOUND-01); to_dict() is the same as plain JSON data."""

    env: str  # module:Class of the environment
    seed: int  # the trainer's seed (never the one derived for the environment)
    reward: float
    reason: str  # one of REASONS: "graded", "gave_up", "budget_exhausted", ..., "infra_error"
    violations: tuple[Violation, ...]  # those custody holds: the workspace's (relative
    # paths), then the image diff's (absolute paths); docs/scan.md, docs/images.md
    violations_dropped: int  # found by the scans, over what custody holds: counted only
    infra_error: str | None  # set only when the infrastructure failed: mask, do not score
    timings: Timings
    log: tuple[ExecRecord, ...]  # one per tool call: max_turns, and the one it refused
    details: Mapping[str, Any]  # from the grader: JSON data, top-level entries that fit
    details_dropped: int  # top-level entries of the grader's details left out
    grader_log: str
    changed_paths: int = 0  # on an image: files and directories of the diff custody kept
    deleted_paths: int = 0  # on an image: paths of the image the agent deleted
    # with Environment.network: what the agent's sandbox reached, all of the episode
    egress: EgressRecord | None = None
    # with Environment.grader_network: what the grader's ctx.run reached
    grader_egress: EgressRecord | None = None
    # in the ip mode: what the rules of the agent's sandbox counted, all of the episode
    egress_ip: IpRecord | None = None

    def __post_init__(self):
        if self.reason not in REASONS:
            raise ValueError(f"{self.reason!r} is not an outcome reason; Outcome.reason is one "
                             f"of karotte.results.REASONS: {', '.join(sorted(REASONS))}")

    def to_dict(self) -> dict[str, Any]:
        """The outcome as plain data that json.dumps takes (a NaN in details is "NaN")."""
        return {
            "env": self.env, "seed": self.seed, "reward": self.reward, "reason": self.reason,
            "violations": [asdict(v) for v in self.violations],
            "violations_dropped": self.violations_dropped, "infra_error": self.infra_error,
            "timings": asdict(self.timings), "log": [asdict(r) for r in self.log],
            "details": dict(self.details), "details_dropped": self.details_dropped,
            "grader_log": self.grader_log, "changed_paths": self.changed_paths,
            "deleted_paths": self.deleted_paths,
            "egress": None if self.egress is None else self.egress.to_dict(),
            "grader_egress": None if self.grader_egress is None else self.grader_egress.to_dict(),
            "egress_ip": None if self.egress_ip is None else self.egress_ip.to_dict(),
        }


def bounded_details(details: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The grader's details as plain JSON data, its top-level entries in order as long as
    they fit in DETAILS_LIMIT bytes of JSON, and how many did not fit."""
    kept: dict[str, Any] = {}
    size, dropped = 2, 0
    for key, value in details.items():
        text = json.dumps({str(key): value})
        cost = len(text) - 2 + (2 if kept else 0)  # the entry, and ", " before it
        if size + cost > DETAILS_LIMIT:
            dropped += 1
            continue
        kept.update(json.loads(text, parse_constant=str))  # NaN, Infinity: as text
        size += cost
    return kept, dropped
