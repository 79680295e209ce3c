"""Control groups: one small API over the cgroup v2 and v1 backends.

A sandbox gets one cgroup (one directory per hierarchy on v1) that caps memory (tmpfs and
shmem pages included, swap forbidden), the number of tasks and CPU bandwidth, and that
can be frozen and emptied no matter what its processes do. ``detect()`` picks the backend:
v2 when the unified hierarchy offers memory, pids and cpu to the parent cgroup, else v1.

The caller puts the child in before it runs untrusted code (``clone_fd()`` on v2, the
spawning thread in ``tasks_files()`` on v1), calls ``kill_all()`` before it reads the
workspace and ``destroy()`` (or ``release()`` after ``acquire()``) last. docs/cgroups.md
has the ordering rules and why; files: _files (access and errno fixes), _mountinfo,
_base (Cgroup, Backend), v2, v1, _pool, stale (gc); leaf names are karotte/names.py.
"""
from __future__ import annotations

import functools

from karotte.errors import CgroupError, HostUnsupported, out_of_fds
from karotte.protections import CGROUP_LINES
from karotte.names import PREFIX, creator_alive, leaf_name

from ._base import MIN_QUOTA_US, PERIOD_US, POOL_MAX_LEFTOVER, Backend, Cgroup, CgroupLimits
from ._files import _DELEGATE_FIX
from ._mountinfo import ENV_PARENT
from ._pool import DEFAULT_POOL_SIZE, ENV_POOL, _pool, drain_pool, pooled_paths
from .stale import STALE_SEARCH_DEPTH, find_created_by, find_stale, processes_of, remove_stale
from .v1 import SOCKET_BUDGET_FLOOR, V1_CONTROLLERS, V1Backend, socket_budget
from .v2 import V2_CONTROLLERS, V2Backend

__all__ = [
    "CgroupError", "HostUnsupported", "PREFIX", "creator_alive", "leaf_name",
    "MIN_QUOTA_US", "PERIOD_US", "POOL_MAX_LEFTOVER", "Backend", "Cgroup", "CgroupLimits",
    "ENV_PARENT", "DEFAULT_POOL_SIZE", "ENV_POOL", "drain_pool", "pooled_paths",
    "STALE_SEARCH_DEPTH", "find_created_by", "find_stale", "processes_of", "remove_stale",
    "SOCKET_BUDGET_FLOOR", "V1_CONTROLLERS", "V1Backend", "socket_budget",
    "V2_CONTROLLERS", "V2Backend", "backend", "detect", "create", "acquire",
]


def backend(version: int) -> Backend:
    """The backend of that cgroup version, or HostUnsupported saying why not."""
    if version == 2:
        return V2Backend.probe()
    if version == 1:
        return V1Backend.probe()
    raise ValueError(f"cgroup version must be 1 or 2, got {version!r}")


@functools.lru_cache(maxsize=1)
def detect() -> Backend:
    """v2 where it offers memory, pids and cpu to our parent cgroup, else v1."""
    why = []
    for probe in (V2Backend.probe, V1Backend.probe):
        try:
            return probe()
        except (HostUnsupported, CgroupError) as exc:
            if out_of_fds(exc):
                raise  # this process is out of fds: says nothing about the host
            why.append(str(exc))
    why2, why1 = why
    raise HostUnsupported(CGROUP_LINES, f"neither cgroup backend can limit memory, pids and cpu "
                          f"here. v2: {why2}. v1: {why1}. Fix: boot with the unified "
                          f"hierarchy and {_DELEGATE_FIX}, or mount the v1 hierarchies "
                          f"{','.join(V1_CONTROLLERS)}")


def create(name: str, limits: CgroupLimits, parent: "str | Cgroup | None" = None, *,
           backend: Backend | None = None) -> Cgroup:
    """Make the cgroup `name` (from leaf_name()) under parent, with limits set.

    parent: a cgroup path as /proc/self/cgroup shows it, a directory of a cgroup mount, or
    a Cgroup (nesting: on v2 that one must hold no processes, only child cgroups);
    default: $KAROTTE_CGROUP_PARENT, else the caller's own cgroup (in each v1 hierarchy).
    On v1 an explicit parent must exist in every hierarchy (memory, pids, cpu, cpuacct,
    freezer).
    """
    return (backend or detect()).create(name, limits, parent)


def acquire(limits: CgroupLimits, parent: "str | Cgroup | None" = None, *,
            backend: Backend | None = None) -> Cgroup:
    """create() with a leaf_name(), for a cgroup to be given back with release(): that
    one may come from this process's pool of released, empty cgroups, with the new
    limits written and its counters reset. Making and removing a memory cgroup costs
    the kernel far more than rewriting one (per-cgroup shrinker and stat structures
    built, then torn down by a kworker). Under a Cgroup parent nothing is pooled."""
    b = backend or detect()
    if isinstance(parent, Cgroup):
        return b.create(leaf_name(), limits, parent)
    key = b.pool_key(parent) if _pool.size else None
    while key is not None and (cg := _pool.take(key)) is not None:
        try:
            if cg._thawed():  # a freeze() that raced its release() leaves it frozen
                cg._unpark()
                cg.set_limits(limits)  # may fail: a limit below the page cache it holds
                return cg
        except CgroupError:
            pass
        try:
            cg.destroy()
        except CgroupError:
            cg._close()  # a task got in after all: gc removes it once we are gone
    cg = b.create(leaf_name(), limits, parent)
    cg._pool_key = key
    return cg

