"""Outcome reasons are a closed set: karotte.results.REASONS, the reasons the code
produces, and the table users read (docs/examples.md) are one and the same list, and an
Outcome with any other reason is refused where it is made."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from envs.basic import Addition

from karotte import grading
from karotte.custody import Custody
from karotte.episode import _Flow
from karotte.outcome import Outcome, Timings
from karotte.errors import KarotteError
from karotte.results import REASONS, ExecResult
from karotte.scan import ScanResult, Violation

DOCS = Path(__file__).parent.parent / "docs" / "examples.md"
KEY = b"a test key of 32 bytes, not used"
CLEAN = Custody(True, None, None, 0.0, 0.0)


def flow(**budget) -> _Flow:
    return _Flow(Addition(), 1, None, KEY, budget.get("max_turns", 10), None)


def grader(**changes) -> ExecResult:
    fields = dict(exit_code=1, signal=None, stdout=b"", stderr=b"", stdout_truncated=False,
                  stderr_truncated=False, timed_out=False, oom_killed=False, wall_seconds=0.1,
                  cpu_seconds=0.1, peak_memory=None)
    return ExecResult(**{**fields, **changes})


def kill_fails() -> None:
    raise KarotteError("the cgroup is not empty")


def produced() -> list[str]:
    """The reason of every way an episode ends, each driven through the code that decides
    it (the sandboxes aside: what they would report is given)."""
    reasons = []
    f = flow(max_turns=1)
    f.call("bash", "true")
    f.call("bash", "true")  # one past max_turns
    reasons.append(f.finished.reason)
    reasons.append(flow().give_up().reason)
    reasons.append(flow().finish(kill_fails, -1, lambda: None).reason)
    reasons.append(flow().finish(lambda: None, -1, lambda: None).reason)  # the scan cannot run
    rejected = ScanResult((), (), (Violation("answer.txt", "fifo", "D3"),), True, 0.0)
    reasons.append(flow().judge(Custody(True, None, rejected, 0.0, 0.0)).reason)
    for final, changes in [(None, {"timed_out": True}), (None, {"oom_killed": True}),
                           (None, {}), ({"op": "crashed", "traceback": "..."}, {}),
                           ({"op": "invalid", "why": "grade() returned str"}, {}),
                           ({"op": "done", "reward": "1"}, {}),
                           ({"op": "done", "reward": math.nan}, {}),
                           ({"op": "done", "reward": 7.0}, {}),  # Addition's range is [0, 1]
                           ({"op": "done", "reward": 1.0}, {})]:
        report = grading._report(final, grader(**changes), 0)
        reasons.append(flow().graded(CLEAN, report, 0.1).reason)
    return reasons


def documented() -> list[str]:
    section = DOCS.read_text().split("## What an outcome's reason says", 1)[1]
    return re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE)


def test_every_reason_the_code_produces_is_in_REASONS_and_every_one_is_produced():
    assert set(produced()) == REASONS


def test_the_reasons_users_read_are_REASONS_each_once():
    reasons = documented()
    assert len(reasons) == len(set(reasons)) and set(reasons) == REASONS
    assert set(grading.GRADER_FAILURES) <= REASONS


def test_an_outcome_with_an_unknown_reason_is_refused():
    with pytest.raises(ValueError, match="'grader_crash' is not an outcome reason"):
        Outcome("envs.basic:Addition", 1, 0.0, "grader_crash", (), 0, None, Timings(), (), {},
                0, "")
