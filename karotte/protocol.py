"""Python side of csrc/protocol.h: the host <-> karotte-init control channel.

Messages are SOCK_SEQPACKET datagrams: a header (type, id) and records (tag, length,
bytes, padded to 8). Keep the numbers in step with protocol.h.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

MAX_MSG = 256 * 1024

# host -> init
CONFIG, EXEC, SIGNAL, GO = 1, 2, 3, 4
# init -> host
READY, SETUP_ERR, EXEC_ERR, EXITED, TTY = 101, 102, 104, 105, 106

# record tags
T_IDS, T_HOSTNAME, T_MOUNT, T_SECCOMP, T_RLIMIT, T_LOOPBACK = 1, 2, 3, 4, 5, 6
T_ARGV, T_ENV, T_CWD, T_TTY = 20, 21, 22, 23
T_SIGNAL = 30
T_ERRNO, T_WHAT, T_WAIT_STATUS, T_RUSAGE = 40, 41, 43, 44

# mount plan operations and flags
M_BIND, M_TMPFS, M_PROC, M_DEVPTS, M_SYMLINK, M_DIR, M_FILE = 1, 2, 3, 4, 5, 6, 7
MF_RDONLY, MF_DEV = 0x1, 0x2

_HEADER = struct.Struct("<II")
_RECORD = struct.Struct("<II")
_MOUNT = struct.Struct("<IIIIIIQQ")
_RLIMIT = struct.Struct("<IIQQ")


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
        return self.record(tag, struct.pack("<I", value))

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
        return struct.unpack("<I", self.records[tag])[0]

    def text(self, tag: int) -> str:
        return self.records.get(tag, b"").rstrip(b"\0").decode(errors="replace")


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


def rusage(reply: Reply) -> tuple[float, float, int]:
    """(user seconds, system seconds, max RSS bytes) of an EXITED reply."""
    utime_us, stime_us, maxrss_kib = struct.unpack("<QQQ", reply.records[T_RUSAGE])
    return utime_us / 1e6, stime_us / 1e6, maxrss_kib * 1024
