"""Control groups: one small API over the cgroup v2 and v1 backends.

A sandbox gets one cgroup (one directory per hierarchy on v1) that caps memory (tmpfs and
shmem pages included, swap forbidden), the number of tasks and CPU bandwidth, and that
can be frozen and emptied no matter what its processes do. ``detect()`` picks the backend:
v2 when the unified hierarchy offers memory, pids and cpu to the parent cgroup, else v1
when the memory, pids, cpu, cpuacct and freezer hierarchies are mounted.

Ordering the caller must respect:
  * put the child in the cgroup before it runs untrusted code: CLONE_INTO_CGROUP with
    ``clone_fd()`` on v2; on v1 hold the child (on a pipe) until ``add(pid)`` returned.
    Memory is charged where it is allocated: pages a process touched before it moved in
    stay charged to its old cgroup;
  * ``kill_all()`` before reading the workspace: it returns only when the cgroup is empty;
  * ``destroy()`` last; it kills, removes every directory, and closes the fds it owns;
  * or ``acquire()`` and ``release()`` instead of ``create()`` and ``destroy()``: released
    cgroups that are provably empty are kept for the next ``acquire()`` (see ``_Pool``);
  * v2 nesting: a cgroup can be the parent of another sandbox's cgroup only while it holds
    no processes itself (the "no internal processes" rule), so a sandbox that will host a
    nested one keeps its own processes in a leaf below it.

Leaf names encode their creator (``leaf_name``) so that ``find_stale`` can tell which
cgroups a crashed host process left behind. They are read in the creator's PID
namespace: ``gc`` must run in the PID namespace of the processes that create sandboxes.
"""
from __future__ import annotations

import atexit
import copy
import errno
import functools
import itertools
import math
import os
import re
import select
import signal
import threading
import time
from typing import Callable
from dataclasses import dataclass

from karotte.errors import CgroupError, HostUnsupported, out_of_fds

PERIOD_US = 100_000  # CPU bandwidth period (cpu.max / cpu.cfs_period_us)
MIN_QUOTA_US = 1_000  # the kernel refuses quotas under 1 ms
PREFIX = "karotte-"
STALE_SEARCH_DEPTH = 8
ENV_PARENT = "KAROTTE_CGROUP_PARENT"
ENV_POOL = "KAROTTE_CGROUP_POOL"
DEFAULT_POOL_SIZE = 16
SOCKET_BUDGET_FLOOR = 16 << 20  # v1: socket buffers allowed at least (bounded by memory)
POOL_MAX_LEFTOVER = 8 << 20  # bytes still charged to a released cgroup that may be reused

V2_CONTROLLERS = ("cpu", "memory", "pids")
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")

_NAME = re.compile(r"^karotte-[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
_LEAF = re.compile(r"^karotte-(\d+)\.(\d+)-(\d+)(?:-([A-Za-z0-9_-]{1,64}))?$")
_TAG = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_DELEGATE_FIX = (
    "run in a delegated cgroup, e.g. `systemd-run --user --scope -p Delegate=yes "
    "<command>`, or set KAROTTE_CGROUP_PARENT to a delegated cgroup")


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


# --------------------------------------------------------------------------- file access

_FIXES = {
    errno.EACCES: "Karotte needs write access to this cgroup: run as root, or " + _DELEGATE_FIX,
    errno.EPERM: "Karotte needs write access to this cgroup: run as root, or " + _DELEGATE_FIX,
    errno.ENOENT: "the file or cgroup is missing: the controller is not enabled here, "
                  "or the cgroup was removed",
    errno.ESRCH: "the process is gone",
    errno.EINVAL: "the kernel rejected the value; check it against the parent cgroup's limits",
    errno.EBUSY: "the cgroup is busy; its current usage or tasks prevent this change",
    errno.ENOSPC: "the parent cgroup's limits leave no room; raise them or use another parent",
    errno.EMFILE: "this process is out of file descriptors; raise RLIMIT_NOFILE (ulimit -n)",
    errno.ENFILE: "the host is out of file descriptors (fs.file-max)",
}


def _fail(action: str, path: str, err: OSError, fix: str | None = None) -> CgroupError:
    name = errno.errorcode.get(err.errno, str(err.errno))
    return CgroupError(f"{action} {path} failed: {name} ({os.strerror(err.errno)}); "
                       f"{fix or _FIXES.get(err.errno, 'see the kernel log')}")


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError as e:
        raise _fail("reading", path, e) from e


def _write(path: str, value: str, fix: str | None = None) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _fail(f"opening to write {value!r}:", path, e, fix) from e
    try:
        os.write(fd, value.encode())
    except OSError as e:
        raise _fail(f"writing {value!r} to", path, e, fix) from e
    finally:
        os.close(fd)


def _read_fd(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)  # kernfs files show fresh contents from offset 0
    return os.read(fd, 65536).decode("ascii")


def _keyed(text: str) -> dict[str, int]:
    """'key value' lines (cgroup.events, memory.events, cpu.stat, oom_control) -> dict."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _procs(directory: str) -> set[int]:
    """Tasks (tgids) in a cgroup directory and every cgroup below it."""
    found: set[int] = set()
    for top, dirs, _ in os.walk(directory):
        try:
            with open(os.path.join(top, "cgroup.procs"), encoding="ascii") as f:
                found.update(int(line) for line in f if line.strip())
        except FileNotFoundError:
            dirs.clear()  # removed while we walked
    return found


def _rmdir_tree(directory: str, deadline: float) -> None:
    """rmdir a cgroup and any child cgroups, deepest first. cgroupfs rmdir needs no files
    removed; EBUSY right after the last task died is retried until the deadline."""
    try:
        os.rmdir(directory)  # the usual case: no child cgroups, no walk of the control files
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    for top, _, _ in sorted(os.walk(directory), key=lambda w: -w[0].count("/")):
        delay = 0.001
        while True:
            try:
                os.rmdir(top)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise _fail("removing", top, e, "the cgroup still holds tasks or child "
                                "cgroups; call kill_all() first") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.05)


def _describe_pids(pids) -> str:
    parts = []
    for pid in sorted(pids):
        try:
            stat = open(f"/proc/{pid}/stat", encoding="ascii", errors="replace").read()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            parts.append(f"{pid} ({comm}, state {stat[stat.rindex(')') + 2]})")
        except (OSError, ValueError):
            parts.append(str(pid))
    return ", ".join(parts)


def _sigkill_members(list_members, batch: int = 128) -> None:
    """SIGKILL every task that list_members() reports.

    Each pid is pinned with a pidfd first and signalled only if a second listing still
    shows it: a task that died and whose pid was recycled by a host process between the
    listing and the signal is never hit (the pidfd refers to the dead one: ESRCH).
    Batches bound the open fds whatever pids.max is.
    """
    # Never the trainer itself: on v1, while a thread of it spawns a sandbox in a
    # cgroup, cgroup.procs there (and above) lists the trainer's pid.
    listed = sorted(set(list_members()) - {os.getpid()})
    for start in range(0, len(listed), batch):
        pinned: dict[int, int] = {}
        try:
            for pid in listed[start:start + batch]:
                try:
                    pinned[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    pass
            still = list_members()
            for pid, fd in pinned.items():
                if pid in still:
                    try:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        finally:
            for fd in pinned.values():
                os.close(fd)


# --------------------------------------------------------------------------- host facts

@dataclass(frozen=True)
class _Mount:
    fstype: str  # "cgroup" or "cgroup2"
    point: str  # where it is mounted
    root: str  # which cgroup of the hierarchy is mounted there
    controllers: frozenset[str]  # v1: the controllers of the hierarchy
    device: str  # major:minor of the superblock, one per hierarchy

    def dir_of(self, cgroup_path: str) -> str:
        """The directory of a cgroup path as /proc/<pid>/cgroup gives it."""
        root = self.root.rstrip("/")
        if cgroup_path != root and not cgroup_path.startswith(root + "/"):
            raise CgroupError(f"cgroup {cgroup_path} is outside the part of the hierarchy "
                              f"mounted at {self.point} (mount root {self.root}); mount the "
                              f"whole hierarchy or set {ENV_PARENT} to a cgroup under it")
        return os.path.normpath(self.point + "/" + cgroup_path[len(root):])


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _parse_mountinfo(text: str, known: frozenset[str]) -> list[_Mount]:
    """cgroup mounts in mountinfo text, one per hierarchy (its first mount wins).
    known: the kernel's controller names, to tell them from options such as xattr."""
    found: dict[str, _Mount] = {}
    for line in text.splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        controllers: frozenset[str] = frozenset()
        if rest[0] == "cgroup":  # super options name the controllers: rw,cpu,cpuacct
            controllers = frozenset(rest[2].split(",")) & known
        found.setdefault(fields[2], _Mount(rest[0], _unescape(fields[4]), _unescape(fields[3]),
                                           controllers, fields[2]))
    return list(found.values())


def _mounts() -> list[_Mount]:
    known = frozenset(line.split()[0] for line in _read("/proc/cgroups").splitlines()
                      if line and not line.startswith("#"))
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return _parse_mountinfo(f.read(), known)


def _own_cgroups(pid: int | str = "self") -> dict[str, str]:
    """/proc/<pid>/cgroup as {controller: path}; the v2 entry has the key ''."""
    out = {}
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _parent_env() -> str | None:
    return os.environ.get(ENV_PARENT) or None


# --------------------------------------------------------------------------- names

_seq = itertools.count()
_seq_lock = threading.Lock()


def _starttime(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted from 1


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


def creator_alive(name: str) -> bool:
    """Whether the process that made this leaf_name() still runs (pid and start time)."""
    m = _LEAF.fullmatch(name)
    if not m:
        raise ValueError(f"{name!r} was not made by leaf_name() "
                         f"(karotte-<pid>.<starttime>-<seq>[-tag])")
    try:
        return _starttime(int(m.group(1))) == int(m.group(2))
    except CgroupError:  # no such pid
        return False


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"cgroup name must be 'karotte-', a letter or digit, then up to 199 "
                         f"of [A-Za-z0-9_.-] (so that gc can find it), got {name!r}")


# --------------------------------------------------------------------------- the cgroup

_GUARDED = ("populated", "kill_all", "freeze", "thaw", "memory_peak", "reset_memory_peak",
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
        before it clones (native.spawn_init); v2: None (see clone_fd())."""
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
        lines = _read(f"/proc/{pid}/cgroup").splitlines()
        found = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                found[c] = path
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

    def freeze(self, timeout: float = 5.0) -> None:
        """Stop every task where it stands; returns once all are frozen."""
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
        """At most POOL_MAX_LEFTOVER bytes still charged (page cache, dentries and other
        kernel objects its tasks made outlive them): the next user's memory and peak
        would count what is left. No reclaim: forcing it runs in the caller's thread for
        as long as the agent made it (1.7 s for 570 MiB of dentries), where removing the
        cgroup hands the charge to its parent at once."""
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


class _V2Cgroup(Cgroup):
    version = 2

    def __init__(self, name: str, path: str, swap_enforced: bool, fresh: bool = True):
        """fresh: made just now and still empty; only then is memory.peak set up."""
        super().__init__(name, (path,))
        self.path = path
        self.swap_enforced = swap_enforced
        self.peak_resettable = False
        self._peak_known = True
        self._dir_fd = self._events_fd = self._peak_fd = None
        try:
            self._dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._events_fd = os.open(self._file("cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
            if fresh:
                self._open_peak()
        except OSError as e:
            self._close()
            raise _fail("opening", path, e) from e
        except BaseException:
            self._close()
            raise

    def _open_peak(self) -> None:
        peak = self._file("memory.peak")
        if not os.path.exists(peak):  # before Linux 5.19
            return
        # A per-fd reset (Linux 6.12+) needs a writable fd that we keep and read from.
        # Probe it now, while the cgroup is empty and a reset changes nothing.
        try:
            self._peak_fd = os.open(peak, os.O_RDWR | os.O_CLOEXEC)
            os.write(self._peak_fd, b"reset")
            self.peak_resettable = True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EACCES, errno.EPERM):
                raise
            if self._peak_fd is not None:
                os.close(self._peak_fd)
            self._peak_fd = os.open(peak, os.O_RDONLY | os.O_CLOEXEC)

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _events(self) -> dict[str, int]:
        if self._events_fd is None:
            raise CgroupError(f"cgroup {self.name} was destroyed")
        return _keyed(_read_fd(self._events_fd))

    def _wait_event(self, key: str, want: int, deadline: float) -> bool:
        """Sleep on cgroup.events until key == want: the kernel wakes pollers of the file
        with POLLPRI on every change, so this costs no CPU while tasks die."""
        poller = select.poll()
        poller.register(self._events_fd, select.POLLPRI)
        while True:
            if self._events().get(key) == want:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller.poll(min(left, 0.1) * 1000)  # the 100 ms cap only bounds a lost wakeup

    def clone_fd(self) -> int | None:
        return self._dir_fd

    def populated(self) -> bool:
        return self._events().get("populated", 0) == 1

    def kill_all(self, timeout: float = 5.0) -> None:
        if not self.populated():
            return
        kill = self._file("cgroup.kill")
        if not os.path.exists(kill):
            self._kill_by_freezing(timeout)
            return
        # The kernel kills the whole subtree and fails forks that race with it.
        _write(kill, "1")
        if not self._wait_event("populated", 0, time.monotonic() + timeout):
            raise self._timeout_error(timeout)

    def _kill_by_freezing(self, timeout: float) -> None:
        """kill_all before Linux 5.14, which has no cgroup.kill (needs 5.2's cgroup.freeze)."""
        self._kill_loop(timeout, self._freeze_until, self.thaw,
                        lambda until: self._wait_event("populated", 0, until))

    def _freeze_until(self, deadline: float) -> bool:
        _write(self._file("cgroup.freeze"), "1")
        return self._wait_event("frozen", 1, deadline)

    def freeze(self, timeout: float = 5.0) -> None:
        if not self._freeze_until(time.monotonic() + timeout):
            raise CgroupError(f"cgroup {self.name} did not reach 'frozen 1' in "
                              f"{self._file('cgroup.events')} within {timeout:g}s; tasks: "
                              f"{_describe_pids(self.pids())}")

    def thaw(self) -> None:
        _write(self._file("cgroup.freeze"), "0")

    def memory_peak(self) -> int | None:
        if self._peak_fd is None or not self._peak_known:
            return None
        return int(_read_fd(self._peak_fd))

    def reset_memory_peak(self) -> None:
        """From now on memory_peak() is the peak since this call. Before Linux 6.12 the
        kernel cannot do that, and memory_peak() answers None (unknown) instead of an old
        peak that would be wrong."""
        if self.peak_resettable:
            try:
                os.write(self._peak_fd, b"reset")
                return
            except OSError as e:
                raise _fail("writing 'reset' to", self._file("memory.peak"), e) from e
        self._peak_known = False

    def _oom_count(self) -> int:
        return _keyed(_read(self._file("memory.events"))).get("oom_kill", 0)

    def cpu_seconds(self) -> float:
        return self._cpu_count() - self._cpu_base

    def _cpu_count(self) -> float:
        return _keyed(_read(self._file("cpu.stat")))["usage_usec"] / 1e6

    def _memory_usage(self) -> int:
        return int(_read(self._file("memory.current")))

    def _thawed(self) -> bool:
        return _read(self._file("cgroup.freeze")).strip() == "0"

    def _disown(self) -> None:
        self._dir_fd = self._events_fd = self._peak_fd = None

    def _park(self) -> None:
        self._close()

    def _unpark(self) -> None:
        try:
            self._dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._events_fd = os.open(self._file("cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
            self._open_peak()  # a new fd sees the peak since creation until it resets it
        except OSError as e:
            self._close()
            raise _fail("opening", self.path, e) from e
        if not self.peak_resettable:
            self._close()
            raise CgroupError(f"cgroup {self.name}: memory.peak can no longer be reset")

    def set_limits(self, limits: CgroupLimits) -> None:
        _write(self._file("memory.max"), str(limits.memory))
        _write(self._file("pids.max"), str(limits.pids))
        _write(self._file("cpu.max"), f"{limits.quota_us} {PERIOD_US}")
        self._limits = limits

    def _reset_counters(self) -> None:  # the kernel resets neither: keep a base
        self._oom_base = self._oom_count()
        self._cpu_base = self._cpu_count()

    def _close(self) -> None:
        for fd in (self._dir_fd, self._events_fd, self._peak_fd):
            if fd is not None:
                os.close(fd)
        self._dir_fd = self._events_fd = self._peak_fd = None


def socket_budget(memory: int) -> int:
    """cgroup v1: the bytes of socket buffers a cgroup with this memory limit may hold,
    on top of that limit (v2 counts them in it)."""
    return max(memory // 4, min(memory, SOCKET_BUDGET_FLOOR))


class _V1Cgroup(Cgroup):
    version = 1

    def __init__(self, name: str, dirs: dict[str, str]):
        """dirs: {controller: directory}; co-mounted controllers share a directory."""
        super().__init__(name, tuple(dict.fromkeys(dirs.values())))
        self._dirs = dirs
        self.swap_enforced = "memory" in dirs and os.path.exists(
            os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes"))
        self.peak_resettable = "memory" in dirs

    def _file(self, controller: str, name: str) -> str:
        return os.path.join(self._dirs[controller], name)

    def tasks_files(self) -> list[str] | None:
        self._check_live()
        return [os.path.join(path, "tasks") for path in self.paths]

    def freezer_state_file(self) -> str | None:
        return self._file("freezer", "freezer.state") if "freezer" in self._dirs else None

    def _controllers(self) -> tuple[str, ...]:
        return tuple(self._dirs)

    def populated(self) -> bool:
        return bool(self.pids())

    def _freezer_state(self) -> str:
        return _read(self._file("freezer", "freezer.state")).strip()

    def _freeze_until(self, deadline: float) -> bool:
        if "freezer" not in self._dirs:
            return False
        _write(self._file("freezer", "freezer.state"), "FROZEN")
        delay = 0.0005
        while self._freezer_state() != "FROZEN":
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return True

    def _thaw(self) -> None:
        if "freezer" in self._dirs:
            _write(self._file("freezer", "freezer.state"), "THAWED")

    def _empty_within(self, deadline: float) -> bool:
        delay = 0.0005
        while self.pids():
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return True

    def kill_all(self, timeout: float = 5.0) -> None:
        # v1 frozen tasks keep a pending SIGKILL until thawed, hence freeze/kill/thaw rounds.
        self._kill_loop(timeout, self._freeze_until, self._thaw, self._empty_within)

    def freeze(self, timeout: float = 5.0) -> None:
        if not self._freeze_until(time.monotonic() + timeout):
            raise CgroupError(f"cgroup {self.name}: {self._file('freezer', 'freezer.state')} "
                              f"is {self._freezer_state()!r}, not FROZEN, after {timeout:g}s; "
                              f"tasks: {_describe_pids(self.pids())}")

    def thaw(self) -> None:
        self._thaw()

    def memory_peak(self) -> int | None:
        return int(_read(self._file("memory", "memory.max_usage_in_bytes")))

    def reset_memory_peak(self) -> None:
        _write(self._file("memory", "memory.max_usage_in_bytes"), "0")

    def _oom_count(self) -> int:
        return _keyed(_read(self._file("memory", "memory.oom_control"))).get("oom_kill", 0)

    def set_limits(self, limits: CgroupLimits) -> None:
        limit = self._file("memory", "memory.limit_in_bytes")
        memsw = self._file("memory", "memory.memsw.limit_in_bytes")
        order = [(limit, str(limits.memory))]
        if self.swap_enforced:
            # memsw may never be below the memory limit: when the limit grows, memsw first
            grows = self._limits is not None and limits.memory > self._limits.memory
            order.insert(0 if grows else 1, (memsw, str(limits.memory)))
        for path, value in order:
            _write(path, value)
        tcp = self._file("memory", "memory.kmem.tcp.limit_in_bytes")
        if os.path.exists(tcp):
            # v1 charges socket buffers (TCP and UDP) to a cgroup only once this limit is
            # set, and then to a counter of their own beside the memory limit: without it
            # an agent parks gigabytes in loopback sockets, outside every limit.
            _write(tcp, str(socket_budget(limits.memory)))
        _write(self._file("pids", "pids.max"), str(limits.pids))
        # cpu.cfs_period_us of a new cgroup is the kernel's default, PERIOD_US: only the
        # quota needs writing.
        _write(self._file("cpu", "cpu.cfs_quota_us"), str(limits.quota_us),
               "the kernel rejected the quota: on v1 a child may not get more CPU than "
               "its parent cgroup's cpu.cfs_quota_us allows")
        self._limits = limits

    def _reset_counters(self) -> None:
        _write(self._file("memory", "memory.failcnt"), "0")
        _write(self._file("cpuacct", "cpuacct.usage"), "0")
        self._oom_base = self._oom_count()  # oom_control's count cannot be reset

    def cpu_seconds(self) -> float:
        return int(_read(self._file("cpuacct", "cpuacct.usage"))) / 1e9

    def _memory_usage(self) -> int:
        return int(_read(self._file("memory", "memory.usage_in_bytes")))

    def _thawed(self) -> bool:
        return "freezer" not in self._dirs or self._freezer_state() == "THAWED"


# --------------------------------------------------------------------------- backends

class Backend:
    """A way to make cgroups on this host; get one from detect() or backend()."""

    version: int

    def create(self, name: str, limits: CgroupLimits, parent: str | None = None) -> Cgroup:
        raise NotImplementedError

    def pool_key(self, parent: str | None) -> tuple:
        """Which released cgroups can serve an acquire() under this parent."""
        raise NotImplementedError


class V2Backend(Backend):
    version = 2

    def __init__(self, mount: _Mount):
        self.mount = mount

    def __repr__(self) -> str:
        return f"<cgroup v2 backend at {self.mount.point}>"

    @classmethod
    def probe(cls) -> "V2Backend":
        mounts = [m for m in _mounts() if m.fstype == "cgroup2"]
        if not mounts:
            raise HostUnsupported("cgroups", "no cgroup2 filesystem is mounted")
        backend = cls(mounts[0])
        parent = backend.parent_dir(None)
        available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        missing = sorted(set(V2_CONTROLLERS) - available)
        if missing:
            raise HostUnsupported(
                "cgroups", f"the cgroup2 hierarchy at {mounts[0].point} does not offer "
                f"{','.join(missing)} to {parent} (its cgroup.controllers: "
                f"{' '.join(sorted(available)) or 'none'}); on a hybrid host they are bound "
                f"to v1 hierarchies; otherwise " + _DELEGATE_FIX)
        return backend

    def parent_dir(self, parent: str | None) -> str:
        parent = parent or _parent_env()
        if parent and (parent == self.mount.point or parent.startswith(self.mount.point + "/")):
            return os.path.normpath(parent)
        return self.mount.dir_of(parent or _own_cgroups()[""])

    def _enable_controllers(self, parent: str, explicit: bool) -> None:
        available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        missing = sorted(set(V2_CONTROLLERS) - available)
        if missing:
            raise HostUnsupported(
                "cgroups", f"{parent} cannot give its children the {','.join(missing)} "
                f"controller(s): they are not enabled in its parent's cgroup.subtree_control; "
                + _DELEGATE_FIX)
        control = os.path.join(parent, "cgroup.subtree_control")
        todo = sorted(set(V2_CONTROLLERS) - set(_read(control).split()))
        if not todo:
            return
        try:
            _write(control, " ".join("+" + c for c in todo))
        except CgroupError as e:
            busy = isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.EBUSY
            why = ("it holds processes of its own, and cgroup v2 lets a non-root cgroup either "
                   "hold processes or hand controllers to its children, never both (the 'no "
                   "internal processes' rule)" if busy else str(e))
            whose = "the parent given" if explicit else "the caller's own cgroup"
            raise HostUnsupported(
                "cgroups", f"cannot enable {' '.join('+' + c for c in todo)} in {control} "
                f"({whose}): {why}; " + _DELEGATE_FIX + " whose own processes sit in a leaf"
            ) from e

    def create(self, name: str, limits: CgroupLimits, parent: "str | Cgroup | None" = None) -> Cgroup:
        _check_name(name)
        if isinstance(parent, Cgroup):
            parent_dir = parent.paths[0]  # nested: it must hold no processes of its own
        else:
            parent_dir = self.parent_dir(parent)
        self._enable_controllers(parent_dir, explicit=bool(parent or _parent_env()))
        path = os.path.join(parent_dir, name)
        try:
            os.mkdir(path, 0o755)
        except OSError as e:
            raise _fail("creating", path, e, "pick a fresh name with leaf_name()"
                        if e.errno == errno.EEXIST else None) from e
        cg = None
        try:
            swap = os.path.exists(os.path.join(path, "memory.swap.max"))
            if swap:
                _write(os.path.join(path, "memory.swap.max"), "0")
            # An OOM kills every task of the group, not one victim the rest can replace.
            _write(os.path.join(path, "memory.oom.group"), "1")
            cg = _V2Cgroup(name, path, swap_enforced=swap)
            cg.set_limits(limits)
            return cg
        except BaseException:
            if cg is not None:
                cg._close()
            os.rmdir(path)
            raise

    def pool_key(self, parent: str | None) -> tuple:
        return (2, self.parent_dir(parent))


class V1Backend(Backend):
    version = 1

    def __init__(self, hierarchies: dict[str, _Mount]):
        self.hierarchies = hierarchies  # {controller: mount}

    def __repr__(self) -> str:
        points = dict.fromkeys(m.point for m in self.hierarchies.values())
        return f"<cgroup v1 backend at {' '.join(points)}>"

    @classmethod
    def probe(cls) -> "V1Backend":
        found = {}
        for mount in _mounts():
            if mount.fstype == "cgroup":
                for c in mount.controllers & set(V1_CONTROLLERS):
                    found[c] = mount
        missing = [c for c in V1_CONTROLLERS if c not in found]
        if missing:
            raise HostUnsupported("cgroups", f"no cgroup v1 hierarchy for {','.join(missing)} "
                                  f"in /proc/self/mountinfo")
        return cls(found)

    def parent_dirs(self, parent: str | None) -> dict[str, str]:
        parent = parent or _parent_env()
        for mount in self.hierarchies.values():  # a directory in one hierarchy: its path
            if parent and parent.startswith(mount.point + "/"):
                parent = mount.root.rstrip("/") + parent[len(mount.point):]
        own = None if parent else _own_cgroups()
        return {c: m.dir_of(parent or own[c]) for c, m in self.hierarchies.items()}

    def create(self, name: str, limits: CgroupLimits, parent: "str | Cgroup | None" = None) -> Cgroup:
        _check_name(name)
        if isinstance(parent, _V1Cgroup):
            parents = dict(parent._dirs)  # nested: the same hierarchies, one level down
        else:
            parents = self.parent_dirs(parent)
        dirs = {c: os.path.join(d, name) for c, d in parents.items()}
        made: list[str] = []
        try:
            for path in dict.fromkeys(dirs.values()):
                try:
                    os.mkdir(path, 0o755)
                except OSError as e:
                    raise _fail("creating", path, e, "pick a fresh name with leaf_name()"
                                if e.errno == errno.EEXIST else None) from e
                made.append(path)
            cg = _V1Cgroup(name, dirs)
            cg.set_limits(limits)  # a new cgroup's memsw is unlimited: memory first is right
            return cg
        except BaseException:
            for path in reversed(made):
                os.rmdir(path)
            raise

    def pool_key(self, parent: str | None) -> tuple:
        return (1, tuple(sorted(self.parent_dirs(parent).items())))


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
    raise HostUnsupported("cgroups", f"neither cgroup backend can limit memory, pids and cpu "
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


class _Pool:
    """Empty cgroups this process released, kept for acquire(); at most `size` of them
    ($KAROTTE_CGROUP_POOL, default 16; 0 turns pooling off).

    A cgroup is kept only when it holds no task and no child cgroup, is not frozen,
    has at most POOL_MAX_LEFTOVER bytes still charged, and its peak, OOM and CPU
    counters can be reset, so the next user counts only its own, plus that little
    reclaimable memory. The releasing handle is dead from then on (its methods
    raise CgroupError), and acquire() hands out a new one. The pool is this process's:
    a forked child starts with an empty one and cannot act on its parent's cgroups;
    they are removed at exit, and `gc` removes them after a crash like any cgroup of a
    dead creator."""

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


# --------------------------------------------------------------------------- gc

def _find(match: Callable[[str], bool]) -> list[str]:
    """Cgroup directories whose name matches, in every hierarchy, to a bounded depth; a
    match's children are not listed (they go with it). The cgroups that can freeze their
    tasks (v2, and the v1 freezer hierarchy) come first, so removing in this order stops
    fork bombs before the other hierarchies are emptied."""
    found: list[tuple[int, str]] = []

    def walk(directory: str, depth: int, rank: int) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if match(entry.name):
                found.append((rank, entry.path))
            elif depth < STALE_SEARCH_DEPTH:
                walk(entry.path, depth + 1, rank)

    for mount in _mounts():
        walk(mount.point, 1, 0 if mount.fstype == "cgroup2" or "freezer" in mount.controllers
             else 1)
    return [path for _, path in sorted(found)]


def find_stale(prefix: str = PREFIX) -> list[str]:
    """Directories of karotte-* cgroups whose creator is gone, in every cgroup hierarchy.
    Names that leaf_name() did not make are skipped: nothing tells whose they are."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix must start with {PREFIX!r}, got {prefix!r}")

    def stale(name: str) -> bool:
        try:
            return name.startswith(prefix) and not creator_alive(name)
        except ValueError:
            return False
    return _find(stale)


def find_created_by(pid: int | None = None) -> list[str]:
    """Directories of the karotte-* cgroups that process pid (default: this one) made."""
    prefix = f"{PREFIX}{os.getpid() if pid is None else pid}."
    return _find(lambda name: name.startswith(prefix))


def processes_of(pid: int | None = None) -> list[int]:
    """Host pids (zombies included) in a karotte-* cgroup that process pid (default: this
    one) made: none may outlive the sandbox it was in."""
    mark = f"/{PREFIX}{os.getpid() if pid is None else pid}."
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if mark in f.read():
                    found.append(int(entry))
        except OSError:  # gone meanwhile
            continue
    return found


def remove_stale(path: str, timeout: float = 5.0) -> None:
    """Kill what is inside a karotte-* cgroup directory (and below it) and remove it."""
    path = os.path.realpath(path)  # cpu -> cpu,cpuacct style links sit above hierarchies
    if not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"not a karotte cgroup: {path}")
    mount = next((m for m in _mounts() if path.startswith(m.point.rstrip("/") + "/")), None)
    if mount is None:
        raise ValueError(f"{path} is not in a cgroup filesystem")
    if not os.path.isdir(path):
        return
    name = os.path.basename(path)
    if mount.fstype == "cgroup2":
        cg: Cgroup = _V2Cgroup(name, path, swap_enforced=False, fresh=False)
    else:
        cg = _V1Cgroup(name, {c: path for c in mount.controllers} or {"": path})
    try:
        cg.kill_all(timeout)
        _rmdir_tree(path, time.monotonic() + timeout)
    finally:
        cg._close()
