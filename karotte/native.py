"""Thin Python face of the native layer: the spawn call and the init binary's path."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .errors import SandboxError
from .protocol import step_name
from .namespaces import (CLONE_NEWCGROUP, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS,
                         CLONE_NEWPID, CLONE_NEWUSER, CLONE_NEWUTS)

try:
    from ._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise SandboxError(
        "karotte's C extension is not built; run `pip install -e .` in the checkout "
        f"(or scripts/setup) ({exc})") from exc

INIT_PATH = Path(__file__).resolve().parent / "_bin" / "karotte-init"
CHILD_FD = lib.KAROTTE_CHILD_FD

ALL_NAMESPACES = (CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC
                  | CLONE_NEWUTS | CLONE_NEWCGROUP)

_INIT_ARGV = [ffi.new("char[]", b"karotte-init"), ffi.NULL]


class SpawnError(OSError):
    """karotte_spawn failed; `step` says where: one of the STEP_* names (karotte.steps)."""

    def __init__(self, err: int, step: str):
        super().__init__(err, os.strerror(err))
        self.step = step


STEP_THREAD, STEP_CGROUP, STEP_OWNER, STEP_CLONE = (
    "spawn-thread", "spawn-cgroup", "spawn-owner", "spawn-clone3")


def spawn_init(child_fd: int, cgroup_fd: int | None, tasks: Sequence[str] | None = None,
               freezer_state: str | None = None,
               owner: tuple[int, int] | None = None) -> tuple[int, int, object]:
    """Start karotte-init in fresh namespaces; child_fd becomes its fd 3.

    cgroup_fd: a v2 cgroup to start it in (CLONE_INTO_CGROUP); tasks and freezer_state:
    the v1 hierarchies' `tasks` files and the freezer.state that must read THAWED.
    owner: the host (uid, gid) that create, and so own, the user namespace (root only;
    why: docs/userns.md).

    Returns (pid, pidfd, keepalive): hold keepalive until init has answered (or died), as
    the child reads its exec arguments from our memory until its exec. Raises SpawnError.
    """
    if not os.access(INIT_PATH, os.X_OK):
        raise SandboxError(f"{INIT_PATH} is missing or not executable; rebuild with "
                           "`pip install -e .` (or scripts/setup)")
    path = ffi.new("char[]", os.fsencode(INIT_PATH))
    argv = ffi.new("char *[]", _INIT_ARGV)
    envp = ffi.new("char *[]", [ffi.NULL])
    pidfd = ffi.new("int *", -1)
    owner_uid, owner_gid = owner if owner is not None else (-1, -1)
    task_paths = [ffi.new("char[]", os.fsencode(t)) for t in tasks or ()]
    task_list = ffi.new("char *[]", [*task_paths, ffi.NULL]) if tasks else ffi.NULL
    state = ffi.new("char[]", os.fsencode(freezer_state)) if freezer_state else ffi.NULL
    step = ffi.new("int *", 0)
    rc = lib.karotte_spawn(path, argv, envp, child_fd,
                           -1 if cgroup_fd is None else cgroup_fd, task_list, state,
                           ALL_NAMESPACES, owner_uid, owner_gid, pidfd, step)
    if rc < 0:
        raise SpawnError(-rc, step_name(step[0]) if step[0] else STEP_CLONE)
    return rc, pidfd[0], (path, argv, envp)
