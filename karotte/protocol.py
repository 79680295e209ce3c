"""Python side of csrc/protocol.h: the host <-> karotte-init control channel.

Messages are SOCK_SEQPACKET datagrams: a header (type, id) and records (tag, length,
bytes, padded to 8). Every number and struct layout here is protocol.h's own, as the C
compiler reads it: karotte/_protocol_h.py is generated from the header (by
scripts/protocol_h.py; tests/test_protocol.py fails while it is stale). Plain Python,
so the mount plan and the probe import it without the C extension.
"""
from __future__ import annotations

import array
import socket
import struct
from dataclasses import dataclass
from typing import Iterator

from . import _protocol_h as h

MAX_MSG = h.KP_MAX_MSG
ROOT_CAPS = h.KP_ROOT_CAPS  # the most T_CAPS may give the agent

# host -> init
CONFIG, EXEC, SIGNAL, GO = h.KP_CONFIG, h.KP_EXEC, h.KP_SIGNAL, h.KP_GO
# init -> host
READY, SETUP_ERR, EXEC_ERR, EXITED, TTY = (h.KP_READY, h.KP_SETUP_ERR, h.KP_EXEC_ERR,
                                           h.KP_EXITED, h.KP_TTY)

# record tags
T_IDS, T_HOSTNAME, T_MOUNT, T_SECCOMP, T_RLIMIT, T_LOOPBACK, T_CAPS = (
    h.KT_IDS, h.KT_HOSTNAME, h.KT_MOUNT, h.KT_SECCOMP, h.KT_RLIMIT, h.KT_LOOPBACK, h.KT_CAPS)
T_ARGV, T_ENV, T_CWD, T_TTY = h.KT_ARGV, h.KT_ENV, h.KT_CWD, h.KT_TTY
T_SIGNAL = h.KT_SIGNAL
T_ERRNO, T_WHAT, T_STEP, T_WAIT_STATUS, T_RUSAGE = (h.KT_ERRNO, h.KT_WHAT, h.KT_STEP,
                                                    h.KT_WAIT_STATUS, h.KT_RUSAGE)

# mount plan operations and flags
M_BIND, M_TMPFS, M_PROC, M_DEVPTS, M_SYMLINK, M_DIR, M_FILE, M_OVERLAY, M_LAYER = (
    h.KM_BIND, h.KM_TMPFS, h.KM_PROC, h.KM_DEVPTS, h.KM_SYMLINK, h.KM_DIR, h.KM_FILE,
    h.KM_OVERLAY, h.KM_LAYER)
MF_RDONLY, MF_DEV, MF_NOSYMFOLLOW = h.KMF_RDONLY, h.KMF_DEV, h.KMF_NOSYMFOLLOW

# Where a start or an exec failed (enum kp_step), by name: KS_MOUNT_PROC is "mount-proc".
# karotte/steps.py says what each means.
STEPS: dict[int, str] = {code: name[len("KS_"):].lower().replace("_", "-")
                         for code, name in h.STEP_NAMES.items()}


def step_name(code: int) -> str:
    """The name of a KT_STEP code, or of karotte_spawn's *step_out."""
    return STEPS.get(code, f"unknown-{code}")


def _layout(name: str, fields: str) -> struct.Struct:
    """struct `name` of protocol.h as the compiler lays it out; fields: its fields in
    order, as this module packs them (checked, so that a reordered field fails here)."""
    size, layout = h.STRUCTS[name]
    if [field for field, _, _ in layout] != fields.split():
        raise ImportError(f"struct {name} has the fields {[f for f, _, _ in layout]}; "
                          f"karotte/protocol.py packs {fields.split()}")
    at = 0
    for field, offset, width in layout:
        if offset != at:
            raise ImportError(f"struct {name}.{field} follows padding: protocol.h spells out "
                              "every byte")
        at += width
    if at != size:
        raise ImportError(f"struct {name} ends in padding: protocol.h spells out every byte")
    return struct.Struct("=" + "".join({4: "I", 8: "Q"}[width] for _, _, width in layout))


_HEADER = _layout("kp_header", "type id")
_RECORD = _layout("kp_record", "tag len")
_MOUNT = _layout("kp_mount", "op flags mode uid gid pad size inodes")
_RLIMIT = _layout("kp_rlimit", "resource pad cur max")
_RUSAGE = _layout("kp_rusage", "utime_us stime_us maxrss_kib")


class Message:
    """Builder of one outgoing message."""

    def __init__(self, type_: int, id_: int = 0):
        self._parts = [_HEADER.pack(type_, id_)]
        self._size = _HEADER.size

    def record(self, tag: int, data: bytes = b"") -> "Message":
        pad = -len(data) % 8
        self._parts += [_RECORD.pack(tag, len(data)), data, b"\0" * pad]
        self._size += _RECORD.size + len(data) + pad
        return self

    def u32(self, tag: int, value: int) -> "Message":
        return self.record(tag, struct.pack("=I", value))

    def string(self, tag: int, text: str | bytes) -> "Message":
        raw = text.encode() if isinstance(text, str) else text
        if b"\0" in raw:
            raise ValueError(f"NUL byte in {raw[:40]!r}")
        return self.record(tag, raw + b"\0")

    def strings(self, tag: int, items) -> "Message":
        raw = []
        for item in items:
            b = item.encode() if isinstance(item, str) else bytes(item)
            if b"\0" in b:
                raise ValueError(f"NUL byte in argument or environment entry {b[:40]!r}")
            raw.append(b + b"\0")
        return self.record(tag, b"".join(raw))

    def mount(self, op: int, dst: str, src: str | bytes = b"", *, flags: int = 0,
              mode: int = 0o755, uid: int = 0, gid: int = 0, size: int = 0,
              inodes: int = 0) -> "Message":
        raw_src = src.encode() if isinstance(src, str) else src
        if op == M_FILE:
            size = len(raw_src)
        else:
            raw_src += b"\0"
        body = _MOUNT.pack(op, flags, mode, uid, gid, 0, size, inodes) + raw_src + dst.encode() + b"\0"
        return self.record(T_MOUNT, body)

    def rlimit(self, resource: int, cur: int, max_: int) -> "Message":
        return self.record(T_RLIMIT, _RLIMIT.pack(resource, 0, cur, max_))

    def to_bytes(self) -> bytes:
        data = b"".join(self._parts)
        if len(data) > MAX_MSG:
            raise ValueError(
                f"control message of {len(data)} bytes is over the {MAX_MSG}-byte limit "
                "(a very long command line or environment?)")
        return data


@dataclass(frozen=True)
class Reply:
    type: int
    id: int
    records: dict[int, bytes]

    def u32(self, tag: int) -> int:
        return struct.unpack("=I", self.records[tag])[0]

    def text(self, tag: int) -> str:
        return self.records.get(tag, b"").rstrip(b"\0").decode(errors="replace")

    @property
    def step(self) -> str | None:
        """Where a SETUP_ERR or EXEC_ERR failed, by name (see STEPS); None in other replies."""
        return step_name(self.u32(T_STEP)) if T_STEP in self.records else None


def _records(data: bytes, pos: int) -> Iterator[tuple[int, bytes]]:
    while pos < len(data):
        tag, length = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        yield tag, data[pos:pos + length]
        pos += length + (-length % 8)


def parse(data: bytes) -> Reply:
    if len(data) < _HEADER.size:
        raise ValueError("short message from karotte-init")
    type_, id_ = _HEADER.unpack_from(data)
    return Reply(type_, id_, dict(_records(data, _HEADER.size)))


def recv(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int], int]:
    """One message from init: (data, fds, recvmsg flags). The fds are close-on-exec
    (MSG_CMSG_CLOEXEC, which socket.recv_fds drops): the workspace's and the upper's fds and
    a pty's master must not reach a program the trainer starts."""
    data, ancdata, flags, _addr = sock.recvmsg(
        MAX_MSG, socket.CMSG_SPACE(maxfds * array.array("i").itemsize), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


def rusage(reply: Reply) -> tuple[float, float, int]:
    """(user seconds, system seconds, max RSS bytes) of an EXITED reply."""
    utime_us, stime_us, maxrss_kib = _RUSAGE.unpack(reply.records[T_RUSAGE])
    return utime_us / 1e6, stime_us / 1e6, maxrss_kib * 1024
