"""Custody of the agent's work, in this order, every time:

1. kill every process of the agent's sandbox and confirm the cgroup is empty; if that
   cannot be confirmed, nothing reads the workspace and the episode scores the bottom;
2. scan the workspace inode by inode from the host (karotte/scan.py): fd-relative, no
   link followed, no FIFO or device opened, bounded in time and memory;
3. copy the accepted bytes, from the very fds that were checked, into a fresh private
   directory: the submission the grader sees. The grader never opens an agent inode.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import KarotteError
from .grading import private_dir
from .scan import ScanLimits, ScanResult, Violation, relation, scan_and_copy


@dataclass(frozen=True)
class Custody:
    kill_confirmed: bool
    submission: str | None  # the private copy; None when the kill was not confirmed
    scan: ScanResult | None
    kill_seconds: float
    scan_seconds: float
    kill_error: str | None = None

    @property
    def violations(self) -> tuple[Violation, ...]:
        return self.scan.violations if self.scan else ()

    @property
    def violations_dropped(self) -> int:
        return self.scan.violations_dropped if self.scan else 0

    def discard(self) -> None:
        if self.submission:
            shutil.rmtree(self.submission, ignore_errors=True)


def take_custody(kill_all: Callable[[], None], workspace_fd: int, limits: ScanLimits,
                 deliverables: Sequence[str] = ()) -> Custody:
    """Kill (kill_all must confirm the sandbox empty or raise), then scan and copy the
    workspace from its directory fd. The scan holds every violation that
    deliverable_violations needs to see (docs/scan.md), however many others there are."""
    t0 = time.monotonic()
    try:
        kill_all()
    except (KarotteError, OSError) as exc:
        return Custody(False, None, None, time.monotonic() - t0, 0.0, str(exc))
    t1 = time.monotonic()
    dest = private_dir("submission")
    try:
        result = scan_and_copy(workspace_fd, dest, limits, deliverables=deliverables)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return Custody(True, dest, result, t1 - t0, time.monotonic() - t1)


def deliverable_violations(violations: Sequence[Violation],
                           deliverables: Sequence[str]) -> tuple[Violation, ...]:
    """Violations at a declared deliverable, inside it, or on the way to it."""
    wanted = [d.strip("/") for d in deliverables]
    return tuple(v for v in violations if any(relation(v.path, d) for d in wanted))
