"""Cleaning up after a crash: what processes that are gone left on this host, and removing it.

A process that holds sandboxes and dies without running its exit handlers (SIGKILL, a
crash) leaves its cgroups and private directories behind (karotte/lifecycle.py), and, in the ip
mode, the nftables table of each sandbox (and a veth whose namespace is still held). Each is
named after its creator (karotte/names.py), so find() lists only those whose creator is
gone, never a live process's. Creators are judged in this PID namespace: run this in the
one of the processes that create sandboxes. `karotte-sandbox gc` is this on the command
line:

    for removal in gc.remove(gc.find()):
        if removal.error:
            log(f"{removal.leftover.paths}: {removal.error}")
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Iterable

from . import cgroups, hostdirs, names
from .egress import ip
from .errors import KarotteError

CGROUP, DIRECTORY, NETWORK = "cgroup", "directory", "network"


@dataclass(frozen=True)
class Leftover:
    """One thing a process that is gone left behind."""

    kind: str  # CGROUP (and what still runs in it), DIRECTORY (in hostdirs.runtime_dir()),
    # or NETWORK (an ip-mode sandbox's nftables table and veth, karotte/egress/ip.py)
    name: str  # its leaf name, karotte-<pid>.<starttime>-<seq>[-tag]
    paths: tuple[str, ...]  # a cgroup: its directory in each hierarchy (v1), removed together;
    # NETWORK: "nft table inet NAME" and "interface kip<SLOT>"
    creator: int  # the pid of the process that made it
    why: str  # why it is stale, for people


@dataclass(frozen=True)
class Removal:
    """What remove() did with one leftover."""

    leftover: Leftover
    removed: bool  # False on a dry run and when it failed
    error: KarotteError | OSError | None = None  # why it could not be removed


def find() -> list[Leftover]:
    """Everything processes that are gone left here, in removal order: cgroups first, those
    that can freeze their tasks ahead (so a fork bomb stops before the other hierarchies
    are emptied), then private directories, then ip-mode tables and veths."""
    cgroup_dirs: dict[str, list[str]] = {}
    for path in cgroups.find_stale():
        cgroup_dirs.setdefault(os.path.basename(path), []).append(path)
    found = [_leftover(CGROUP, name, paths) for name, paths in cgroup_dirs.items()]
    found += [_leftover(DIRECTORY, os.path.basename(path), [path])
              for path in hostdirs.find_stale()]
    found += [_leftover(NETWORK, name, list(items)) for name, items in ip.find_stale()]
    return found


def remove(leftovers: Iterable[Leftover], *, dry_run: bool = False) -> list[Removal]:
    """Remove each leftover: kill what runs in a cgroup, then remove its directories. A
    failure is reported in its Removal and the others go on. dry_run: remove nothing.
    ValueError, before anything is removed, for a leftover whose creator is alive or
    whose paths are not named after it."""
    leftovers = list(leftovers)
    for leftover in leftovers:
        _check(leftover)
    return [Removal(leftover, False) if dry_run else _remove(leftover)
            for leftover in leftovers]


def _leftover(kind: str, name: str, paths: list[str]) -> Leftover:
    pid, _ = names.creator(name)
    why = f"its creator, process {pid}, has exited"
    if os.path.exists(f"/proc/{pid}"):
        why += f" (pid {pid} is another process now)"
    return Leftover(kind, name, tuple(paths), pid, why)


def _check(leftover: Leftover) -> None:
    if leftover.kind not in (CGROUP, DIRECTORY, NETWORK):
        raise ValueError(f"not a kind of leftover: {leftover.kind!r}")
    if not leftover.paths or (leftover.kind != NETWORK and any(
            os.path.basename(p) != leftover.name for p in leftover.paths)):
        raise ValueError(f"the paths of {leftover.name} are not named after it: "
                         f"{list(leftover.paths)}")
    if names.creator_alive(leftover.name):
        pid, _ = names.creator(leftover.name)
        raise ValueError(f"{leftover.name} is not a leftover: process {pid}, which made it, "
                         f"is alive")


def _remove(leftover: Leftover) -> Removal:
    remove_one = cgroups.remove_stale if leftover.kind == CGROUP else shutil.rmtree
    try:
        if leftover.kind == NETWORK:
            ip.remove_stale(leftover.name, leftover.paths)
        else:
            for path in leftover.paths:
                remove_one(path)
    except (KarotteError, OSError) as exc:
        return Removal(leftover, False, exc)
    return Removal(leftover, True)
