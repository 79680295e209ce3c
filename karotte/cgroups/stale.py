"""Cgroups a process left behind: find those of dead creators (by their leaf_name()) in
every hierarchy, kill what is in them and remove them. Names are read in the creator's
PID namespace: gc must run in the PID namespace of the processes that create sandboxes."""
from __future__ import annotations

import os
import time
from typing import Callable

from karotte.names import PREFIX, creator_alive

from ._base import Cgroup
from ._files import _rmdir_tree
from ._mountinfo import _mounts
from .v1 import _V1Cgroup
from .v2 import _V2Cgroup

STALE_SEARCH_DEPTH = 8


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
