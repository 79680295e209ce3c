"""The TLS ClientHello a client sends first in a CONNECT tunnel, read for its SNI.

The proxy does not decrypt; it reads the first handshake message, which TLS sends in the
clear, and lets the tunnel carry it on only when its server_name is the CONNECT authority
(EGRESS-SNI-01: a tunnel opened to an allowed name must not greet another one, which an
allowed CDN would route). Encrypted ClientHello is refused, since it hides the real name.
"""
from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

_HANDSHAKE, _CLIENT_HELLO = 22, 1
_SERVER_NAME, _ECH = 0, 0xFE0D
MAX_HELLO = 64 * 1024  # a ClientHello with post-quantum key shares is under 2 KiB


class NotClientHello(Exception):
    """The first bytes of a tunnel are not a TLS ClientHello the proxy can read."""


@dataclass(frozen=True)
class ClientHello:
    server_name: str | None
    encrypted: bool  # an encrypted_client_hello extension is present


async def read_client_hello(reader: asyncio.StreamReader) -> tuple[bytes, ClientHello]:
    """The raw records that carry the whole ClientHello (to send on), and what it says."""
    raw = bytearray()
    message = bytearray()
    while len(message) < 4 or len(message) < 4 + int.from_bytes(message[1:4], "big"):
        header = await reader.readexactly(5)
        kind, major, length = header[0], header[1], struct.unpack("!H", header[3:5])[0]
        if kind != _HANDSHAKE or major != 3 or not 0 < length <= 16384 + 2048:
            raise NotClientHello("the tunnel did not start with a TLS handshake record")
        raw += header + await reader.readexactly(length)
        message += raw[-length:]
        if len(raw) > MAX_HELLO:
            raise NotClientHello(f"the ClientHello is longer than {MAX_HELLO} bytes")
    if message[0] != _CLIENT_HELLO:
        raise NotClientHello("the first handshake message is not a ClientHello")
    body_end = 4 + int.from_bytes(message[1:4], "big")
    if len(message) != body_end:
        raise NotClientHello("a record carries more than the ClientHello")
    return bytes(raw), parse_client_hello(bytes(message[4:body_end]))


def parse_client_hello(body: bytes) -> ClientHello:
    """The server_name and the ECH flag of a ClientHello's body (after its 4-byte header)."""
    r = _Reader(body)
    r.take(2 + 32)  # legacy_version, random
    r.vector(1)  # legacy_session_id
    r.vector(2)  # cipher_suites
    r.vector(1)  # legacy_compression_methods
    if r.done():
        return ClientHello(None, False)
    extensions = _Reader(r.vector(2))
    if not r.done():
        raise NotClientHello("bytes after the ClientHello's extensions")
    seen: set[int] = set()
    name = None
    while not extensions.done():
        kind = extensions.u16()
        data = extensions.vector(2)
        if kind in seen:
            raise NotClientHello(f"extension {kind} appears twice")
        seen.add(kind)
        if kind == _SERVER_NAME:
            name = _server_name(data)
    return ClientHello(name, _ECH in seen)


def _server_name(data: bytes) -> str:
    names = _Reader(_Reader(data).vector(2))
    found = []
    while not names.done():
        kind = names.take(1)[0]
        value = names.vector(2)
        if kind == 0:
            found.append(value)
    if len(found) != 1:
        raise NotClientHello("server_name must carry exactly one host_name")
    try:
        return found[0].decode("ascii")
    except UnicodeDecodeError:
        raise NotClientHello("the server_name is not ASCII") from None


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise NotClientHello("the ClientHello is cut short")
        self.at += n
        return self.data[self.at - n:self.at]

    def u16(self) -> int:
        return struct.unpack("!H", self.take(2))[0]

    def vector(self, size: int) -> bytes:
        return self.take(int.from_bytes(self.take(size), "big"))

    def done(self) -> bool:
        return self.at == len(self.data)
