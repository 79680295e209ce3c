"""Names that say who made a host object: karotte-<pid>.<starttime>-<seq>[-tag].

Sandbox cgroups and Karotte's host directories are named after their creator, so that
`karotte-sandbox gc` (karotte/gc.py) can tell which ones a crashed process left behind:
a pid alone could be reused, a pid with its start time names one process for the whole
uptime. Names are read in the creator's PID namespace.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
import threading

PREFIX = "karotte-"
# Any name gc can find: what create() accepts (leaf_name() makes the ones it can judge).
NAME = re.compile(r"^karotte-[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
_LEAF = re.compile(r"^karotte-(\d+)\.(\d+)-(\d+)(?:-([A-Za-z0-9_-]{1,64}))?$")
_TAG = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_seq = itertools.count()
_seq_lock = threading.Lock()


def _starttime(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat: clock ticks from boot to the process's start."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2:].split()[19])  # fields from 3 on, after comm


@functools.lru_cache(maxsize=4)
def _own_starttime(pid: int) -> int:
    """This process's start time (keyed by pid: a forked child gets its own)."""
    return _starttime(pid)


def leaf_name(tag: str = "") -> str:
    """A fresh leaf name that names its creator: karotte-<pid>.<starttime>-<seq>[-tag]."""
    if tag and not _TAG.fullmatch(tag):
        raise ValueError(f"tag must be 1-64 of [A-Za-z0-9_-], got {tag!r}")
    with _seq_lock:
        seq = next(_seq)
    pid = os.getpid()
    name = f"{PREFIX}{pid}.{_own_starttime(pid)}-{seq}"
    return f"{name}-{tag}" if tag else name


def creator(name: str) -> tuple[int, int]:
    """(pid, start time) of the process that made this leaf_name()."""
    m = _LEAF.fullmatch(name)
    if not m:
        raise ValueError(f"{name!r} was not made by leaf_name() "
                         f"(karotte-<pid>.<starttime>-<seq>[-tag])")
    return int(m.group(1)), int(m.group(2))


def creator_alive(name: str) -> bool:
    """Whether the process that made this leaf_name() still runs (pid and start time)."""
    pid, start = creator(name)
    try:
        return _starttime(pid) == start
    except OSError:  # no such pid
        return False
