"""Whether this process is ending: once it is, nothing that needs cleaning up is created.

karotte/lifecycle.py sets it (a signal, or exit) and then removes what the process made;
the modules that create sandboxes and host directories ask it first. It sits below
both, so that every import points down.
"""
from __future__ import annotations

import os
import signal

from .errors import SandboxError

_ending: int | None = None  # the signal that ends this process (0: it is exiting)


def ending() -> int | None:
    """The signal that is ending this process (0 once it is exiting), or None. From then
    on no sandbox or private directory can be created: a worker thread's next episode
    fails at once; end the worker when this is set."""
    return _ending


def begin(signum: int) -> bool:
    """Mark the process as ending by signum (0: exit); True the first time only."""
    global _ending
    if _ending is not None:
        return False
    _ending = signum
    return True


def refuse_if_ending(what: str) -> None:
    """Raise SandboxError instead of creating `what` while the process is ending."""
    if _ending is not None:
        cause = f"got {signal.Signals(_ending).name}" if _ending else "is exiting"
        raise SandboxError(f"not creating {what}: this process {cause} and has stopped "
                           "every sandbox (karotte.lifecycle)")


def _forget() -> None:
    """In a forked child: the parent's ending is not the child's."""
    global _ending
    _ending = None


os.register_at_fork(after_in_child=_forget)
