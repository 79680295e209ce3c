"""cgroup v1: one directory in each of the memory, pids, cpu, cpuacct and freezer
hierarchies (co-mounted ones share it), placed by a spawning thread that moves itself in,
killed in freeze/kill/thaw rounds."""
from __future__ import annotations

import errno
import os
import time

from karotte.errors import HostUnsupported
from karotte.protections import CGROUP_LINES

from ._base import Backend, Cgroup, CgroupLimits, _check_name
from ._files import _fail, _keyed, _read, _write
from ._mountinfo import _Mount, _cgroups_of, _mounts, _parent_env

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
SOCKET_BUDGET_FLOOR = 16 << 20  # v1: socket buffers allowed at least (bounded by memory)


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

    def _not_frozen(self, timeout: float) -> str:
        return (f": {self._file('freezer', 'freezer.state')} is {self._freezer_state()!r}, "
                f"not FROZEN, after {timeout:g}s")

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
            raise HostUnsupported(CGROUP_LINES, f"no cgroup v1 hierarchy for {','.join(missing)} "
                                  f"in /proc/self/mountinfo")
        return cls(found)

    def parent_dirs(self, parent: str | None) -> dict[str, str]:
        parent = parent or _parent_env()
        for mount in self.hierarchies.values():  # a directory in one hierarchy: its path
            if parent and parent.startswith(mount.point + "/"):
                parent = mount.root.rstrip("/") + parent[len(mount.point):]
        own = None if parent else _cgroups_of()
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

