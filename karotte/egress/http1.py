"""HTTP/1.1 messages as the proxy reads them: heads, and where each body ends.

The proxy must know where every request ends, or the bytes after it (a second request
to another host, pipelined on a kept-alive connection) would reach the first request's
destination unchecked (EGRESS-KEEPALIVE-01). So framing is strict: a message with both
Content-Length and Transfer-Encoding, two different lengths, a coding other than chunked
or a folded header is refused, never guessed at (request smuggling).
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

MAX_HEAD = 64 * 1024
# A stream's buffer: what one read may take at once (bodies are relayed in reads this big,
# so the loop runs once per MiB, not per 64 KiB); a head is still held to MAX_HEAD.
BUFFER = 1024 * 1024
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_VERSION = re.compile(rb"HTTP/1\.[01]\Z")
# Headers that describe one hop; the proxy speaks for itself on each side.
HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authorization",
                        "proxy-authenticate", "te", "trailer", "upgrade"})


class BadMessage(Exception):
    """A message the proxy does not parse; the connection is closed after it."""


@dataclass
class Head:
    start: tuple[str, str, str]  # method, target, version; or version, status, reason
    headers: list[tuple[str, str]]
    raw: bytes

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name]

    def tokens(self, name: str) -> list[str]:
        return [t.strip().lower() for v in self.values(name) for t in v.split(",") if t.strip()]


async def read_head(reader: asyncio.StreamReader) -> Head | None:
    """The next message head, or None at a clean end before its first byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise BadMessage("the connection ended inside a message head") from None
    except asyncio.LimitOverrunError:
        raw = b""
    if not raw or len(raw) > MAX_HEAD:
        raise BadMessage(f"a message head over {MAX_HEAD} bytes")
    lines = raw[:-4].split(b"\r\n")
    start = lines[0].split(b" ", 2)
    if len(start) != 3 or any(b"\n" in part or b"\r" in part for part in start):
        raise BadMessage("a malformed start line")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name) or b"\r" in value or b"\n" in value \
                or b"\0" in value:
            raise BadMessage(f"a malformed header line {line[:80]!r}")
        headers.append((name.decode("ascii"), value.strip(b" \t").decode("latin-1")))
    return Head(tuple(p.decode("latin-1") for p in start), headers, raw)


def request_line(head: Head) -> tuple[str, str, str]:
    method, target, version = head.start
    if not _TOKEN.match(method.encode("latin-1")) or not _VERSION.match(
            version.encode("latin-1")):
        raise BadMessage(f"{method[:20]!r} {version[:20]!r} is no HTTP/1.x request line")
    return method, target, version


def status_code(head: Head) -> int:
    version, code, _ = head.start
    if not _VERSION.match(version.encode("latin-1")) or not (code.isdigit() and len(code) == 3):
        raise BadMessage("a malformed status line")
    return int(code)


def framing(head: Head, request_method: str | None = None) -> tuple[str, int]:
    """("none", 0), ("length", n), ("chunked", 0) or ("close", 0): how the body of a
    request (request_method None) or of a response to request_method ends."""
    if request_method is not None:
        code = status_code(head)
        if request_method == "HEAD" or code < 200 or code in (204, 304):
            return "none", 0
    codings = head.tokens("transfer-encoding")
    lengths = {v.strip() for v in head.values("content-length")}
    if codings and lengths:
        raise BadMessage("both Transfer-Encoding and Content-Length")
    if codings:
        if codings != ["chunked"]:
            if request_method is None or codings[-1] == "chunked":
                raise BadMessage(f"transfer coding {', '.join(codings)} (only chunked)")
            return "close", 0
        return "chunked", 0
    if lengths:
        (length,) = lengths if len(lengths) == 1 else (None,)
        if length is None or not (length.isascii() and length.isdigit()) or len(length) > 18:
            raise BadMessage("a malformed or repeated Content-Length")
        return ("length", int(length)) if int(length) else ("none", 0)
    return ("none", 0) if request_method is None else ("close", 0)


Send = Callable[[bytes], Awaitable[None]]


async def relay_body(reader: asyncio.StreamReader, send: Send, kind: str, length: int) -> None:
    """Send a body on as it arrives, to its end as framing() said."""
    if kind == "length":
        while length:
            data = await reader.read(min(length, BUFFER))
            if not data:
                raise BadMessage("the connection ended inside a body")
            length -= len(data)
            await send(data)
    elif kind == "close":
        while data := await reader.read(BUFFER):
            await send(data)
    elif kind == "chunked":
        await _relay_chunked(reader, send)


async def _relay_chunked(reader: asyncio.StreamReader, send: Send) -> None:
    while True:
        line = await _line(reader)
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or len(size_text) > 16 or not all(
                c in b"0123456789abcdefABCDEF" for c in size_text):
            raise BadMessage("a malformed chunk size")
        size = int(size_text, 16)
        await send(line)
        if size == 0:
            break
        await relay_body(reader, send, "length", size)
        if await _line(reader) != b"\r\n":
            raise BadMessage("a chunk not followed by CRLF")
        await send(b"\r\n")
    while (line := await _line(reader)) != b"\r\n":  # trailers, then the end
        await send(line)
    await send(b"\r\n")


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        raise BadMessage("a chunk line cut short or over the head limit") from None


def build_head(start: str, headers: list[tuple[str, str]]) -> bytes:
    return (start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode(
        "latin-1")


def forwarded_headers(head: Head, drop: set[str]) -> list[tuple[str, str]]:
    """The request's end-to-end headers, less those named in drop (lowercase) and those
    its Connection header names."""
    named = set(head.tokens("connection"))
    return [(k, v) for k, v in head.headers
            if k.lower() not in HOP_BY_HOP and k.lower() not in named and k.lower() not in drop]


def response(code: int, reason: str, egress_reason: str, text: str) -> bytes:
    """The proxy's own answer, closing the connection; X-Karotte-Egress names the reason."""
    body = (text + "\n").encode("utf-8", "replace")
    return build_head(f"HTTP/1.1 {code} {reason}", [
        ("X-Karotte-Egress", egress_reason), ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))), ("Connection", "close")]) + body
