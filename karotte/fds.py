"""This process's file descriptors: the soft limit raised at import, and the one error for
running out of them (at whichever step of a sandbox's life it happens)."""
from __future__ import annotations

import os
import resource
from functools import wraps

from .errors import CgroupError, SandboxError, out_of_fds


def _raise_fd_limit() -> None:
    """The soft RLIMIT_NOFILE up to the hard one, once: a trainer with a few hundred
    sandboxes needs thousands of fds (why: docs/exec-io.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


_raise_fd_limit()


def fd_exhaustion() -> SandboxError:
    """The one error for running out of fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = f"{len(os.listdir('/proc/self/fd')) - 1} open"
    except OSError:  # listing needs an fd of its own, and there may be none left
        in_use = "all in use"
    return SandboxError(
        f"this process is out of file descriptors ({in_use}, RLIMIT_NOFILE {soft}, hard "
        f"limit {hard}); a live sandbox holds 3 or more and each exec 3 more for a moment: "
        "raise the hard limit (LimitNOFILE= of a systemd unit, ulimit -Hn; Karotte raises "
        "the soft limit to it at import), or close sandboxes")


def naming_fd_exhaustion(method):
    """The method, raising fd_exhaustion() where it ran out of fds (a pipe, a socket,
    a cgroup file) instead of a bare EMFILE."""
    @wraps(method)
    def named(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (OSError, CgroupError) as exc:
            if out_of_fds(exc):
                raise fd_exhaustion() from exc
            raise
    return named
