"""Ids and user namespaces: which host ids a sandbox's ids map to, who owns its user
namespace, and why the kernel refused to make one.

As root, a sandbox's 65536 ids map onto a reserved host range from KAROTTE_UID_BASE, and
its user namespace is owned by (and its agent runs as) one of the NS_OWNERS host ids
after it, a different one per sandbox. Unprivileged, the kernel lets us map only the
caller's own ids. The argument for both is in docs/userns.md.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import struct
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Sequence

from .errors import HostUnsupported

AGENT_UID = 1000  # the agent's uid and gid inside the sandbox
DEFAULT_UID_BASE = 0x7000_0000  # root: first host id of the sandboxes' range
ENV_UID_BASE = "KAROTTE_UID_BASE"
NS_OWNERS = 65536  # root: host ids after the mapped range that own user namespaces
ID_TABLES = ("/etc/passwd", "/etc/group")
SUBID_TABLES = ("/etc/subuid", "/etc/subgid")
NS_GET_OWNER_UID = 0xB704  # ioctl on a user namespace fd: _IO(0xb7, 0x4)

# The lines of `karotte-sandbox check` that a bad KAROTTE_UID_BASE range takes away.
_RANGE_LINES = ("separate-host-uid", "own-userns-owner")


def uid_base() -> int:
    """The first host id of the sandboxes' range as root: $KAROTTE_UID_BASE or the default."""
    return int(os.environ.get(ENV_UID_BASE, DEFAULT_UID_BASE))


def ns_owner_ids(base: int = DEFAULT_UID_BASE) -> range:
    """The host uids that own sandboxes' user namespaces (and that their agents run as),
    for a root caller with KAROTTE_UID_BASE base: the NS_OWNERS after the mapped range."""
    return range(base + 65536, base + 65536 + NS_OWNERS)


@dataclass(frozen=True)
class Identity:
    """The id maps of one sandbox's user namespace, as the host writes them."""

    uid_map: str
    gid_map: str
    deny_setgroups: bool
    nested: bool  # agent runs in a user namespace of its own (unprivileged caller)
    owner_uid: int  # the agent's uid as init sees it: owner of /workspace and /home/agent
    owner_gid: int
    ns_owners: int | None = None  # root: first of the host ids that own user namespaces

    def agent_uid_map(self, owner: tuple[int, int] | None) -> str:
        """The uid map of a sandbox whose user namespace `owner` owns (root): the agent's
        uid 1000 is that owner's host uid; the other ids keep the shared range."""
        if owner is None:
            return self.uid_map
        base = self.ns_owners - 65536
        return (f"0 {base} {AGENT_UID}\n{AGENT_UID} {owner[0]} 1\n"
                f"{AGENT_UID + 1} {base + AGENT_UID + 1} {65536 - AGENT_UID - 1}\n")

    def ns_owner(self) -> tuple[int, int] | None:
        """The host uid and gid that create the next sandbox's user namespace, or None for
        the caller's own: each process starts at a random one of NS_OWNERS, then takes the
        next for each sandbox (why: docs/userns.md)."""
        if self.ns_owners is None:
            return None
        global _owner_next
        with _owner_lock:
            if _owner_next is None:
                _owner_next = secrets.randbelow(NS_OWNERS)
            k, _owner_next = _owner_next, (_owner_next + 1) % NS_OWNERS
        return self.ns_owners + k, self.ns_owners + k


_owner_next: int | None = None  # per process: a forked child picks its own start
_owner_lock = threading.Lock()


def _forget_owner_start() -> None:
    global _owner_next, _owner_lock
    _owner_next, _owner_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_owner_start)


def identity() -> Identity:
    """The id maps for a sandbox made by this process now."""
    if os.geteuid() == 0:
        base = uid_base()
        check_reserved_ids(base)
        return Identity(f"0 {base} 65536\n", f"0 {base} 65536\n", False, False,
                        AGENT_UID, AGENT_UID, ns_owners=ns_owner_ids(base).start)
    # Without privilege the kernel lets us map exactly our own ids; the agent gets a
    # nested namespace in which that id is 1000 (see agent_child in csrc/init/agent.c).
    return Identity(f"0 {os.geteuid()} 1\n", f"0 {os.getegid()} 1\n", True, True, 0, 0)


def sandbox_owner() -> tuple[int, int]:
    """Host uid and gid for what sandboxes may read: root inside every sandbox (init
    binds it) and the agent gid, which all sandboxes share (the agent's uid is one of its
    own per sandbox: Identity.agent_uid_map)."""
    if os.geteuid() == 0:
        base = uid_base()
        return base, base + AGENT_UID
    return os.geteuid(), os.getegid()


@lru_cache(maxsize=4)
def check_reserved_ids(base: int) -> None:
    """The host ids Karotte takes as root, [base, base + 65536 + NS_OWNERS), must fit in
    32 bits and belong to no local account or group, nor to any user's subordinate ids
    (/etc/subuid, /etc/subgid): a process running as one of them could signal, trace or
    enter sandboxes."""
    top = ns_owner_ids(base).stop
    if base < 1 or top > 0xFFFF_FFFF:
        raise HostUnsupported(_RANGE_LINES, f"KAROTTE_UID_BASE {base:#x} leaves no room for the "
                              f"{top - base} host ids Karotte uses from it (up to {top:#x}); "
                              f"pick a base from 1 to {0xFFFF_FFFF - (top - base):#x}")
    for table, fields in _table_rows(ID_TABLES):
        if len(fields) > 2 and fields[2].isdigit() and base <= int(fields[2]) < top:
            raise HostUnsupported(
                _RANGE_LINES, f"{table} has {fields[0]!r} with id {fields[2]}, inside the "
                f"host ids Karotte uses as root ({base:#x}-{top - 1:#x}): that account "
                f"could enter sandboxes; set KAROTTE_UID_BASE to a free range")
    for table, fields in _table_rows(SUBID_TABLES):
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            first, count = int(fields[1]), int(fields[2])
            if first < top and base < first + count:
                raise HostUnsupported(
                    _RANGE_LINES, f"{table} gives {fields[0]!r} the ids {first:#x}-"
                    f"{first + count - 1:#x}, which overlap the host ids Karotte uses as "
                    f"root ({base:#x}-{top - 1:#x}): that user's containers could run as "
                    f"sandbox ids; set KAROTTE_UID_BASE to a free range")


def _table_rows(tables: Sequence[str]) -> Iterator[tuple[str, list[str]]]:
    """(table, colon-separated fields) of each line of the tables that exist."""
    for table in tables:
        try:
            with open(table, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            yield table, line.split(":")


def userns_owner(pid: int) -> int | None:
    """The host uid that owns process pid's user namespace (NS_GET_OWNER_UID)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return struct.unpack("I", fcntl.ioctl(fd, NS_GET_OWNER_UID, b"\0" * 4))[0]
    except OSError:
        return None
    finally:
        os.close(fd)


def _sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/{name}", encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def userns_cause(err: int) -> tuple[str, str]:
    """(cause, fix) for a user namespace the kernel refused with errno err."""
    if _sysctl("kernel/apparmor_restrict_unprivileged_userns") == "1":
        return ("unprivileged user namespaces are restricted by AppArmor "
                "(kernel.apparmor_restrict_unprivileged_userns=1)",
                "run as root, or set it to 0, or give this program an AppArmor profile with "
                "`userns,`")
    if _sysctl("kernel/unprivileged_userns_clone") == "0":
        return ("unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone=0)",
                "run as root or set it to 1")
    if _sysctl("user/max_user_namespaces") == "0":
        return ("user namespaces are disabled (user.max_user_namespaces=0)",
                "set it to e.g. 65536")
    if err in (errno.ENOSPC, errno.EUSERS):
        return ("the limit on nested or total user namespaces is reached "
                "(user.max_user_namespaces, or nesting depth 32)",
                "raise it or end other sandboxes")
    return ("the kernel refused to create a user namespace; if this runs in a container, its "
            "seccomp profile or missing privileges may block unshare/clone (e.g. Docker's "
            "default profile)", "run on the host, or with a profile that allows it")


def userns_blocker(err: int) -> str:
    """Why creating a user namespace failed with errno err, and how to fix it."""
    cause, fix = userns_cause(err)
    return f"{cause}; {fix}"
