"""Custody of the agent's work, in this order, every time:

1. kill every process of the agent's sandbox and confirm the cgroup is empty; if that
   cannot be confirmed, nothing reads the workspace and the episode scores the bottom;
2. scan the workspace inode by inode from the host (karotte/scan.py): fd-relative, no
   link followed, no FIFO or device opened, bounded in time and memory;
3. copy the accepted bytes, from the very fds that were checked, into a fresh private
   directory: the submission the grader sees. The grader never opens an agent inode;
4. on an image, scan the overlay's upper (the agent's whole diff of the image) the same
   way into a second private directory (karotte/changes.py): the vetted changes, which
   ctx.run's sandboxes lay over the image and the grader reads at /changes. The
   agent's upper itself is never mounted anywhere again.

The violations custody holds are bounded over both scans together (REC-BOUND-01): every
one at a deliverable or on the way to one, the first VIOLATIONS_KEPT inside deliverable
directories and the first VIOLATIONS_KEPT elsewhere, the workspace's first; the rest are
counted. The scans share ScanLimits.max_seconds.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Sequence

from .changes import scan_changes
from . import hostdirs
from .errors import HostUnsupported, KarotteError
from .grading import Changes, private_dir
from .scan import VIOLATIONS_KEPT, ScanLimits, ScanResult, Violation, relation, scan_and_copy

# The violations that end a walk (one per scan at most): always held, since they say the
# copy is incomplete.
STOPS = frozenset({"scan-timeout", "total-too-large", "paths-too-long"})
MIN_DIFF_SECONDS = 0.001  # the diff's scan when the workspace's used up the time: it stops
# The diff's copy is this directory of a private one: the private one keeps other host
# users out, and the copy's own root is root's, 0755, as an image's root is, since the
# next sandboxes lay it over the image (idmapped: root of theirs) and make their mount
# points through it.
TREE = "tree"
# What the diff's copy needs of its filesystem: an idmapped mount (the next sandboxes see
# it as the image's tree) and user xattrs (opaque directories). tmpfs has both from 6.6.
TMPFS_SINCE = (6, 6)


@dataclass(frozen=True)
class Custody:
    kill_confirmed: bool
    submission: str | None  # the private copy; None when the kill was not confirmed
    scan: ScanResult | None
    kill_seconds: float
    scan_seconds: float  # both scans, the workspace's and the diff's
    kill_error: str | None = None
    changes: str | None = None  # on an image: a private directory, the vetted diff its TREE
    diff: ScanResult | None = None  # its scan (absolute paths)
    deliverables: tuple[str, ...] = ()

    @cached_property
    def _held(self) -> tuple[tuple[Violation, ...], int]:
        if self.scan is None:
            return (), 0
        if self.diff is None:
            return self.scan.violations, self.scan.violations_dropped
        kept = {"inside": 0, None: 0}
        held: list[Violation] = []
        dropped = self.scan.violations_dropped + self.diff.violations_dropped
        for v in self.scan.violations + self.diff.violations:
            where = _where(v.path, self.deliverables)
            if where != "at" and v.kind not in STOPS:
                if kept[where] == VIOLATIONS_KEPT:
                    dropped += 1
                    continue
                kept[where] += 1
            held.append(v)
        return tuple(held), dropped

    @property
    def violations(self) -> tuple[Violation, ...]:
        return self._held[0]

    @property
    def violations_dropped(self) -> int:
        return self._held[1]

    @property
    def changed_paths(self) -> int:
        return len(self.diff.files) + len(self.diff.dirs) if self.diff else 0

    @property
    def deleted_paths(self) -> int:
        return len(self.diff.deleted) if self.diff else 0

    def for_grader(self) -> Changes | None:
        """The vetted diff as grading takes it; None on the host's userland."""
        if self.changes is None or self.diff is None:
            return None
        return Changes(os.path.join(self.changes, TREE), tuple(self.diff.deleted),
                       tuple(self.diff.replaced))

    def discard(self) -> None:
        for path in (self.submission, self.changes):
            if path:
                shutil.rmtree(path, ignore_errors=True)


def take_custody(kill_all: Callable[[], None], workspace_fd: int, limits: ScanLimits,
                 deliverables: Sequence[str] = (), upper_fd: int | None = None) -> Custody:
    """Kill (kill_all must confirm the sandbox empty or raise), then scan and copy the
    workspace from its directory fd and, on an image (upper_fd: the overlay's upper), the
    agent's diff of the image. Each scan holds every violation that
    deliverable_violations needs to see (docs/scan.md), however many others there are:
    the relative deliverables are the workspace's, the absolute ones the diff's."""
    t0 = time.monotonic()
    try:
        kill_all()
    except (KarotteError, OSError) as exc:
        return Custody(False, None, None, time.monotonic() - t0, 0.0, str(exc))
    t1 = time.monotonic()
    wanted = tuple(deliverables)
    dest = private_dir("submission")
    changes = diff = None
    try:
        result = scan_and_copy(workspace_fd, dest, limits,
                               deliverables=[d for d in wanted if not d.startswith("/")])
        if upper_fd is not None:
            changes = private_dir("changes")
            tree = os.path.join(changes, TREE)
            os.mkdir(tree, 0o755)
            os.chmod(tree, 0o755)  # not narrowed by the umask
            left = limits.max_seconds - (time.monotonic() - t1)
            diff = scan_changes(upper_fd, tree,
                                replace(limits, max_seconds=max(left, MIN_DIFF_SECONDS)),
                                deliverables=[d for d in wanted if d.startswith("/")])
    except BaseException:
        for path in (dest, changes):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        raise
    return Custody(True, dest, result, t1 - t0, time.monotonic() - t1, None, changes, diff,
                   wanted)


def check_changes_home() -> None:
    """Raises unless the diff's copy can live in hostdirs.runtime_dir(): on a tmpfs (the
    default, /dev/shm) before Linux 6.6 it could not be idmapped (before 6.3) or hold an
    opaque directory. Called at an image episode's reset, before any agent runs."""
    top = hostdirs.runtime_dir()
    release = tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2])
    if release < TMPFS_SINCE and _fs_type(top) == "tmpfs":
        raise HostUnsupported(
            "image-overlay", f"custody copies the agent's diff of its image into {top}, a tmpfs, "
            f"which Linux {os.uname().release} cannot idmap or mark opaque (tmpfs can from "
            f"{TMPFS_SINCE[0]}.{TMPFS_SINCE[1]}); set KAROTTE_RUNTIME_DIR to a directory on "
            "ext4, xfs or btrfs that root owns (mode 0755), or run on Linux 6.6 or newer")


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding path (/proc/self/mountinfo)."""
    path, best, found = os.path.realpath(path), "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 for a space
            if (path == point or path.startswith(point.rstrip("/") + "/")) and \
                    len(point) >= len(best):
                best, found = point, fields[fields.index("-") + 1]
    return found


def _where(path: str, deliverables: Sequence[str]) -> str | None:
    """relation() of a held violation's path to the first deliverable it meets: relative
    paths (the workspace's) to relative deliverables, absolute ones (the diff's) to
    absolute ones."""
    for d in deliverables:
        if d.startswith("/") == path.startswith("/"):
            where = relation(path.strip("/"), d.strip("/"))
            if where:
                return where
    return None


def deliverable_violations(violations: Sequence[Violation],
                           deliverables: Sequence[str]) -> tuple[Violation, ...]:
    """Violations at a declared deliverable, inside it, or on the way to it."""
    return tuple(v for v in violations if _where(v.path, deliverables))
