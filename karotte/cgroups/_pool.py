"""The pool of released, empty cgroups that acquire() reuses: making and removing a memory
cgroup costs the kernel far more than rewriting the limits of one."""
from __future__ import annotations

import atexit
import os
import threading
from typing import Protocol

from karotte.errors import CgroupError


class Cgroup(Protocol):
    """What the pool uses of a Cgroup (_base.Cgroup, which imports this module): it holds
    cgroups, never makes one."""

    paths: tuple[str, ...]
    _pool_key: tuple | None

    def _reusable(self) -> bool: ...
    def _handoff(self) -> "Cgroup": ...
    def _park(self) -> None: ...
    def destroy(self) -> None: ...

ENV_POOL = "KAROTTE_CGROUP_POOL"
DEFAULT_POOL_SIZE = 16


class _Pool:
    """Empty cgroups this process released, kept for acquire(): at most `size` of them
    ($KAROTTE_CGROUP_POOL, default 16; 0 turns pooling off), each as good as new
    (Cgroup._reusable). This process's only: a forked child starts with an empty one.
    docs/cgroups.md, "The pool", has the argument."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: dict[tuple, list[Cgroup]] = {}

    @property
    def size(self) -> int:
        raw = os.environ.get(ENV_POOL, "")
        try:
            size = int(raw) if raw else DEFAULT_POOL_SIZE
        except ValueError:
            size = -1
        if size < 0:
            raise ValueError(f"{ENV_POOL} must be a count of cgroups (0 turns pooling off), "
                             f"got {raw!r}")
        return size

    def take(self, key: tuple) -> Cgroup | None:
        with self._lock:
            free = self._free.get(key)
            return free.pop() if free else None

    def give(self, cg: Cgroup) -> bool:
        size = self.size
        with self._lock:
            if sum(map(len, self._free.values())) >= size:
                return False
        try:
            if not cg._reusable():
                return False
        except (CgroupError, OSError):
            return False
        with self._lock:
            if sum(map(len, self._free.values())) >= size:
                return False
            fresh = cg._handoff()
            fresh._park()
            self._free.setdefault(cg._pool_key, []).append(fresh)
        return True

    def paths(self) -> set[str]:
        with self._lock:
            return {p for free in self._free.values() for cg in free for p in cg.paths}

    def drain(self) -> None:
        """Remove every pooled cgroup (errors are left to gc)."""
        with self._lock:
            free, self._free = self._free, {}
        for cg in (cg for group in free.values() for cg in group):
            try:
                cg.destroy()
            except CgroupError:
                pass

    def _forget(self) -> None:
        """In a forked child: the pooled cgroups are the parent's, not ours to use."""
        self._lock = threading.Lock()
        self._free = {}


_pool = _Pool()
atexit.register(_pool.drain)
os.register_at_fork(after_in_child=_pool._forget)


def pooled_paths() -> set[str]:
    """Directories of the empty cgroups this process keeps for acquire()."""
    return _pool.paths()


def drain_pool() -> None:
    """Remove the cgroups kept for acquire() now, rather than at exit."""
    _pool.drain()

