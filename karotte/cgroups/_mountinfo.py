"""Where the cgroup hierarchies are (/proc/self/mountinfo) and where a process sits in
them (/proc/<pid>/cgroup)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from karotte.errors import CgroupError

from ._files import _read

ENV_PARENT = "KAROTTE_CGROUP_PARENT"


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


def _cgroups_of(pid: int | str = "self") -> dict[str, str]:
    """/proc/<pid>/cgroup as {controller: path}; the v2 entry has the key ''."""
    out = {}
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _parent_env() -> str | None:
    return os.environ.get(ENV_PARENT) or None
