"""cgroup v2: one directory in the unified hierarchy, placed with CLONE_INTO_CGROUP, killed
with cgroup.kill, watched through cgroup.events."""
from __future__ import annotations

import errno
import os
import select
import time

from karotte.errors import CgroupError, HostUnsupported
from karotte.protections import CGROUP_LINES

from ._base import PERIOD_US, Backend, Cgroup, CgroupLimits, _check_name
from ._files import _DELEGATE_FIX, _fail, _keyed, _read, _read_fd, _write
from ._mountinfo import _Mount, _cgroups_of, _mounts, _parent_env

V2_CONTROLLERS = ("cpu", "memory", "pids")


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

    def _not_frozen(self, timeout: float) -> str:
        return f" did not reach 'frozen 1' in {self._file('cgroup.events')} within {timeout:g}s"

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
            raise HostUnsupported(CGROUP_LINES, "no cgroup2 filesystem is mounted")
        backend = cls(mounts[0])
        parent = backend.parent_dir(None)
        available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        missing = sorted(set(V2_CONTROLLERS) - available)
        if missing:
            raise HostUnsupported(
                CGROUP_LINES, f"the cgroup2 hierarchy at {mounts[0].point} does not offer "
                f"{','.join(missing)} to {parent} (its cgroup.controllers: "
                f"{' '.join(sorted(available)) or 'none'}); on a hybrid host they are bound "
                f"to v1 hierarchies; otherwise " + _DELEGATE_FIX)
        return backend

    def parent_dir(self, parent: str | None) -> str:
        parent = parent or _parent_env()
        if parent and (parent == self.mount.point or parent.startswith(self.mount.point + "/")):
            return os.path.normpath(parent)
        return self.mount.dir_of(parent or _cgroups_of()[""])

    def _enable_controllers(self, parent: str, explicit: bool) -> None:
        available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        missing = sorted(set(V2_CONTROLLERS) - available)
        if missing:
            raise HostUnsupported(
                CGROUP_LINES, f"{parent} cannot give its children the {','.join(missing)} "
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
                CGROUP_LINES, f"cannot enable {' '.join('+' + c for c in todo)} in {control} "
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

