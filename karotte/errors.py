"""Exceptions. Each message names the cause and the fix."""


class KarotteError(Exception):
    """Base class of every error Karotte raises on purpose."""


class HostUnsupported(KarotteError):
    """This host cannot enforce a protection that was asked for (or is a default).

    ``protection`` names it (as in ``karotte-sandbox check``); the message says why
    and how to fix it.
    """

    def __init__(self, protection: str, message: str):
        super().__init__(f"{protection}: {message}")
        self.protection = protection
        self.detail = message


class SandboxError(KarotteError):
    """The sandbox could not be created or has failed; the message says where."""


class SandboxClosed(SandboxError):
    """An operation on a sandbox that was destroyed or whose init died."""


class CgroupError(KarotteError):
    """A cgroup operation failed (create, limit, kill, remove)."""
