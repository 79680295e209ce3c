"""Exceptions. Each message names the cause and the fix."""

from __future__ import annotations

import errno

from .protections import PROTECTIONS


class KarotteError(Exception):
    """Base class of every error Karotte raises on purpose."""


class HostUnsupported(KarotteError):
    """This host cannot enforce a protection that was asked for (or is a default).

    ``protections`` names what it takes away, as the lines of ``karotte-sandbox check``
    (``protection`` is the first); the message says why and how to fix it.
    """

    def __init__(self, protection: str | tuple[str, ...], message: str):
        names = (protection,) if isinstance(protection, str) else tuple(protection)
        unknown = [n for n in names if n not in PROTECTIONS]
        if not names or unknown:
            raise ValueError(f"HostUnsupported names {unknown or 'nothing'}: name lines of "
                             f"`karotte-sandbox check` (karotte.protections.PROTECTIONS)")
        super().__init__(f"{', '.join(names)}: {message}")
        self.protections = names
        self.protection = names[0]
        self.detail = message


class SandboxError(KarotteError):
    """The sandbox could not be created or has failed; the message says where.

    ``step`` names the step of the start that failed, as karotte-init or the spawn
    reported it (a key of ``karotte.steps.STEPS``), or is None.
    """

    def __init__(self, message: str, step: str | None = None):
        super().__init__(message)
        self.step = step


class SandboxClosed(SandboxError):
    """An operation on a sandbox that was destroyed or whose init died."""


class CgroupError(KarotteError):
    """A cgroup operation failed (create, limit, kill, remove)."""


def out_of_fds(exc: BaseException | None) -> bool:
    """Whether exc was caused, anywhere down its chain, by running out of file descriptors.

    That is the state of this process (or of the host's file table), never a missing
    feature: it must not be reported as one, nor degraded around.
    """
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
