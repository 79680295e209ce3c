"""Why a sandbox did not start: a failed spawn, a SETUP_ERR from karotte-init, or an init
gone without a word, each turned into the exception that names the cause and the fix
(karotte/steps.py has each setup step's hint; karotte/imageroot.py the overlay's)."""
from __future__ import annotations

import errno
import os

from . import cgroups, imageroot, native, steps
from . import protocol as p
from .errors import CgroupError, HostUnsupported, SandboxError
from .userns import userns_blocker

_OVERLAY_STEPS = ("overlay-lower", "overlay-upper", "overlay")
# What a tree the caller named, not the kernel, is to blame for: a plain SandboxError.
_TREE_ERRNOS = (errno.EACCES, errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG)


def setup_error(reply: p.Reply) -> SandboxError | HostUnsupported:
    """The error of a SETUP_ERR reply: on an image's overlay steps the host's (unless the
    tree named is to blame), else the step's, with its hint."""
    err = reply.u32(p.T_ERRNO)
    if reply.step in _OVERLAY_STEPS and err not in _TREE_ERRNOS:
        return imageroot.overlay_unsupported(reply.text(p.T_WHAT), err, os.uname().release)
    hint = steps.step(reply.step).hint(err)
    return SandboxError(f"sandbox setup failed at '{reply.text(p.T_WHAT)}': {os.strerror(err)}"
                        + (f" ({hint})" if hint else ""), step=reply.step)


def spawn_error(exc: native.SpawnError, cg: cgroups.Cgroup | None) -> Exception:
    """The error of a failed karotte_spawn, by its step."""
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    if exc.step == native.STEP_CGROUP:
        if exc.errno == errno.EBUSY:
            return CgroupError(f"cgroup {cg.name} is frozen, or its parent is: a sandbox "
                               "started in it would stop at once; thaw the parent cgroup")
        return CgroupError(f"moving the spawning thread into cgroup {cg.name} failed: {name} "
                           f"({exc.strerror}); check the tasks files of {' '.join(cg.paths)}")
    if exc.step == native.STEP_THREAD:
        return SandboxError(f"no thread could be started for the spawn: {name} "
                            f"({exc.strerror}); raise the limit on threads or processes",
                            step=exc.step)
    if exc.step == native.STEP_OWNER:
        return SandboxError(f"taking the user namespace's owner ids failed: {name} "
                            f"({exc.strerror}); they need a root caller", step=exc.step)
    if exc.errno in (errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EUSERS):
        return HostUnsupported("user-namespace", userns_blocker(exc.errno))
    return SandboxError(f"clone3 of the sandbox failed: {exc.strerror}", step=exc.step)


def init_gone(pidfd: int) -> SandboxError:
    """The error of an init (pidfd) that closed the channel before READY without a word."""
    try:
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (OSError, TypeError):
        info = None
    if info is not None and info.si_code == os.CLD_EXITED and info.si_status == 127:
        return SandboxError(f"could not execute {native.INIT_PATH} in the new namespaces")
    return SandboxError("karotte-init exited during setup without saying why")
