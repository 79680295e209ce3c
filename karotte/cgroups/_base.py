"""What every cgroup backend offers: limits, the Cgroup handle and its life cycle, and the
Backend that makes them."""
from __future__ import annotations

import copy
import functools
import math
import os
import time
from dataclasses import dataclass

from karotte import names
from karotte.errors import CgroupError

from ._files import _describe_pids, _procs, _rmdir_tree, _sigkill_members, _write
from ._mountinfo import _cgroups_of
from ._pool import _pool

PERIOD_US = 100_000  # CPU bandwidth period (cpu.max / cpu.cfs_period_us)
MIN_QUOTA_US = 1_000  # the kernel refuses quotas under 1 ms
POOL_MAX_LEFTOVER = 8 << 20  # bytes still charged to a released cgroup that may be reused


@dataclass(frozen=True)
class CgroupLimits:
    """Hard limits of one cgroup. Swap is always forbidden where the kernel can say so."""

    memory: int  # bytes: memory.max / memory.limit_in_bytes (and memsw)
    pids: int  # pids.max
    cpus: float  # CPU bandwidth in CPUs, over a 100 ms period

    def __post_init__(self):
        for field in ("memory", "pids"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CgroupLimits.{field} must be a positive integer, got {value!r}")
        if not (isinstance(self.cpus, (int, float)) and math.isfinite(self.cpus) and self.cpus > 0):
            raise ValueError(f"CgroupLimits.cpus must be a positive number, got {self.cpus!r}")

    @property
    def quota_us(self) -> int:
        return max(MIN_QUOTA_US, round(self.cpus * PERIOD_US))


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not names.NAME.fullmatch(name):
        raise ValueError(f"cgroup name must be 'karotte-', a letter or digit, then up to 199 "
                         f"of [A-Za-z0-9_.-] (so that gc can find it), got {name!r}")


_GUARDED = ("populated", "kill_all", "thaw", "memory_peak", "reset_memory_peak",
            "cpu_seconds", "set_limits")


def _live(method):
    """The method, refused (CgroupError) on a released handle or in a forked child."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        self._check_live()
        return method(self, *args, **kwargs)
    return guarded


class Cgroup:
    """One sandbox cgroup. Use as a context manager; exit destroys it."""

    version: int
    name: str
    paths: tuple[str, ...]  # its directories (v1: one per hierarchy)
    swap_enforced: bool  # the kernel keeps its memory out of swap
    peak_resettable: bool  # reset_memory_peak() works on this kernel

    def __init__(self, name: str, paths: tuple[str, ...]):
        self.name = name
        self.paths = paths
        self._destroyed = False
        self._limits: CgroupLimits | None = None  # as last written by set_limits()
        self._oom_base = 0  # OOM kills of earlier users, when acquire() reused it
        self._cpu_base = 0.0  # their CPU seconds, where the kernel cannot reset them
        self._pool_key: tuple | None = None  # set by acquire(): release() may keep it
        self._pid = os.getpid()
        self._released = False  # released to the pool: another handle serves it now

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in _GUARDED:  # every method that reads or changes the cgroup
            if name in cls.__dict__:
                setattr(cls, name, _live(cls.__dict__[name]))

    def owned_here(self) -> bool:
        """False for a cgroup from acquire() in a process forked from the one that took
        it: that process may have released it to its pool and handed it to another
        sandbox since, so this copy must not act on it."""
        return self._pool_key is None or self._pid == os.getpid()

    def _check_live(self) -> None:
        if self._released:
            raise CgroupError(f"cgroup {self.name} was released; it may serve another "
                              f"sandbox now, so this handle can no longer act on it")
        if not self.owned_here():
            raise CgroupError(f"cgroup {self.name} belongs to process {self._pid}, which "
                              f"took it with acquire(); a forked child must not act on it")

    def _handoff(self) -> "Cgroup":
        """A new handle for the pool; this one is dead from now on."""
        fresh = copy.copy(self)
        self._released = self._destroyed = True
        self._disown()
        return fresh

    def _disown(self) -> None:
        """Forget the fds a new handle took over (v2)."""

    def _park(self) -> None:
        """In the pool: hold no fd (v2 closes its own)."""

    def _unpark(self) -> None:
        """Out of the pool: open what _park closed."""

    def __enter__(self) -> "Cgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"<Cgroup v{self.version} {self.name} {' '.join(self.paths)}>"

    def clone_fd(self) -> int | None:
        """v2: an O_DIRECTORY fd of the cgroup for clone3(CLONE_INTO_CGROUP), owned by this
        object and closed by destroy(); v1: None (see tasks_files())."""
        return None

    def tasks_files(self) -> list[str] | None:
        """v1: the `tasks` file of each hierarchy, for a thread that moves itself in
        before it clones (native.spawn_init; docs/cgroups.md says why); v2: None."""
        return None

    def freezer_state_file(self) -> str | None:
        """v1: freezer.state, which that thread checks reads THAWED before it moves."""
        return None

    def place(self, pid: int) -> None:
        """Make sure process pid, started in this cgroup, is in it in every hierarchy:
        anything that moved the whole trainer while its spawning thread was in here
        took that thread along. Moves it in where it is not."""
        self._check_live()
        if self._misplaced(pid):
            self.add(pid)
            if self._misplaced(pid):
                raise CgroupError(f"process {pid} is not in cgroup {self.name} after it was "
                                  f"moved there: {self._misplaced(pid)}")

    def _misplaced(self, pid: int) -> list[str]:
        """The hierarchies of /proc/<pid>/cgroup in which pid is not in this cgroup."""
        wanted = self._controllers()
        found = _cgroups_of(pid)
        return [f"{c or 'v2'}: {found.get(c)}" for c in wanted
                if os.path.basename(found.get(c, "")) != self.name]

    def _controllers(self) -> tuple[str, ...]:
        """As /proc/<pid>/cgroup names this cgroup's hierarchies ("" for v2)."""
        return ("",)

    def populated(self) -> bool:
        """Whether any task is left in the cgroup or below it."""
        raise NotImplementedError

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every task and return once the cgroup is empty; CgroupError naming the
        tasks left if it is not empty within timeout seconds."""
        raise NotImplementedError

    @_live
    def freeze(self, timeout: float = 5.0) -> None:
        """Stop every task where it stands; returns once all are frozen."""
        if not self._freeze_until(time.monotonic() + timeout):
            raise CgroupError(f"cgroup {self.name}{self._not_frozen(timeout)}; tasks: "
                              f"{_describe_pids(self.pids())}")

    def _freeze_until(self, deadline: float) -> bool:
        """Ask the kernel to freeze; whether every task is frozen by the deadline."""
        raise NotImplementedError

    def _not_frozen(self, timeout: float) -> str:
        """The rest of freeze()'s error after the cgroup's name: the file that says not."""
        raise NotImplementedError

    def thaw(self) -> None:
        raise NotImplementedError

    def memory_peak(self) -> int | None:
        """Peak memory in bytes since creation or reset_memory_peak(); None if unknown."""
        raise NotImplementedError

    def reset_memory_peak(self) -> None:
        raise NotImplementedError

    @_live
    def oom_kills(self) -> int:
        """Tasks the OOM killer ended in this cgroup (since acquire() handed it out)."""
        return self._oom_count() - self._oom_base

    def _oom_count(self) -> int:
        raise NotImplementedError

    def set_limits(self, limits: CgroupLimits) -> None:
        """Write the memory, pids and CPU limits (the kernel applies them at once)."""
        raise NotImplementedError

    def _reusable(self) -> bool:
        """Whether this cgroup is as good as new for another sandbox: no task, no child
        cgroup, not frozen, little memory still charged, a peak that can be reset;
        resets its counters. Called only once its tasks are gone."""
        if not self.peak_resettable or self.populated() or not self._no_child_cgroups():
            return False
        if not self._thawed() or not self._little_left():
            return False
        self.reset_memory_peak()
        self._reset_counters()
        return True

    def _reset_counters(self) -> None:
        """From here on, count only the next user's OOM kills and CPU time."""
        raise NotImplementedError

    def _little_left(self) -> bool:
        """At most POOL_MAX_LEFTOVER bytes still charged (page cache, dentries): the next
        user would count them. No forced reclaim; docs/cgroups.md, "The pool", says why."""
        return self._memory_usage() <= POOL_MAX_LEFTOVER

    def _memory_usage(self) -> int:
        raise NotImplementedError

    def _thawed(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        """destroy(), except that a cgroup from acquire() that is provably empty may be
        kept by this process for the next acquire() (new limits, counters reset). This
        handle is dead afterwards either way; a second release() does nothing."""
        if self._released or self._destroyed:
            return
        self._check_live()
        if self._pool_key is None or not _pool.give(self):
            self.destroy()

    def cpu_seconds(self) -> float:
        """CPU time used by all tasks of the cgroup, user and system."""
        raise NotImplementedError

    @_live
    def pids(self) -> list[int]:
        """Host pids of the tasks in the cgroup and below it (union over hierarchies)."""
        found: set[int] = set()
        for path in self.paths:
            found |= _procs(path)
        return sorted(found)

    def _members(self) -> set[int]:
        return set(self.pids())

    @_live
    def add(self, pid: int) -> None:
        """Move a process in (every hierarchy on v1). Its children inherit the cgroup."""
        for path in self.paths:
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def destroy(self) -> None:
        """Kill every task, then remove every directory. Idempotent. On failure it raises
        and leaves the cgroup as it is, so that a retry or `gc` can finish the job."""
        if self._destroyed:
            return
        self._check_live()
        try:
            # Already emptied by its owner (the usual case)? The kernel refuses to remove
            # a cgroup that holds a task (EBUSY), so this cannot leave one running.
            os.rmdir(self.paths[0])
        except FileNotFoundError:
            pass
        except OSError:
            self.kill_all()
        deadline = time.monotonic() + 5.0
        for path in self.paths:
            _rmdir_tree(path, deadline)
        self._close()
        self._destroyed = True

    def _close(self) -> None:
        pass

    def _timeout_error(self, timeout: float) -> CgroupError:
        left = self.pids()
        return CgroupError(f"cgroup {self.name} still holds {len(left)} task(s) {timeout:g}s "
                           f"after the kill: {_describe_pids(left)}; tasks in state D wait "
                           f"on the kernel (a hung filesystem or device)")

    def _no_child_cgroups(self) -> bool:
        # kernfs counts a directory's subdirectories in its link count, like ext4
        return all(os.stat(path).st_nlink == 2 for path in self.paths)

    def _kill_loop(self, timeout: float, freeze, thaw, empty_within) -> None:
        """Freeze, SIGKILL every task, thaw, until empty. Frozen tasks cannot fork, so a
        fork bomb cannot outrun the listing; SIGKILL ends tasks that ignore SIGTERM or are
        stopped; the kill goes by cgroup, so setsid and double-fork daemons are found."""
        deadline = time.monotonic() + timeout
        # A task is in paths[0] if it is in any: add() writes it first, children inherit.
        if not _procs(self.paths[0]):
            return
        while True:
            if not self._members():
                return
            # A task in state D can stall freezing; the kill is safe without it (pidfds).
            freeze(min(deadline, time.monotonic() + 0.5))
            try:
                _sigkill_members(self._members)
            finally:
                thaw()
            if empty_within(min(deadline, time.monotonic() + 0.5)):
                return
            if time.monotonic() > deadline:
                raise self._timeout_error(timeout)


class Backend:
    """A way to make cgroups on this host; get one from detect() or backend()."""

    version: int

    def create(self, name: str, limits: CgroupLimits, parent: str | None = None) -> Cgroup:
        raise NotImplementedError

    def pool_key(self, parent: str | None) -> tuple:
        """Which released cgroups can serve an acquire() under this parent."""
        raise NotImplementedError

