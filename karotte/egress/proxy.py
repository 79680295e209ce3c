"""One client connection of a sandbox, from its first request to its close.

Two kinds of listener lead here. The forward proxy takes CONNECT (a tunnel, checked
once, then its TLS server_name) and absolute-form HTTP (every request checked, the
kept-alive connection's next request too). An upstream listener takes origin-form HTTP
for one named upstream and sends it on with the upstream's scheme, TLS and headers.
Every destination goes through check.check (EGRESS-BYPASS-01); every byte through the
sandbox's Meter; every request or tunnel is one entry of its Log.
"""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
import urllib.parse

from .check import Resolver, Verdict, check
from .hostnames import BadHost, host_header, normalise_host, show, split_authority
from .http1 import (BUFFER, BadMessage, Head, build_head, forwarded_headers, framing,
                    read_head, relay_body, request_line, response, status_code)
from .meter import LimitReached, Meter
from .policy import EgressPolicy, Rule, Upstream
from .record import Entry, Log
from .tls import NotClientHello, read_client_hello

_STATUS = {"connections": (429, "Too Many Requests"), "bytes_total": (429, "Too Many Requests"),
           "bad_request": (400, "Bad Request"), "bad_host": (400, "Bad Request"),
           "not_proxy_request": (400, "Bad Request"), "resolve_failed": (502, "Bad Gateway"),
           "connect_failed": (502, "Bad Gateway"), "upstream_failed": (502, "Bad Gateway"),
           "idle": (504, "Gateway Timeout")}
_FIX = {"not_allowed": "add it to the sandbox's allow-list if the task needs it",
        "ip_literal": "use a name from the allow-list, or list the address itself",
        "internal_address": "list the address itself if the task is meant to reach it",
        "not_proxy_request": "this is an HTTP proxy: send absolute-form requests or CONNECT"}

# Methods whose answer is the request itself (RFC 9110 TRACE; TRACK, its IIS twin): on an
# upstream listener they would hand the agent the credentials the host adds.
ECHOING_METHODS = frozenset({"TRACE", "TRACK"})


def climbs(target: str) -> bool:
    """Whether an origin-form target's path has a '.' or '..' segment, as a server that
    decodes %2e or takes a backslash for a slash would see it: the upstream's base path
    (https://api.example.com/v1) is then no bound, with the host's credentials added.
    Clients normalise such segments away before they send (curl, urllib, requests)."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    return any(segment in (".", "..")
               for segment in urllib.parse.unquote(path).replace("\\", "/").split("/"))


class Gate:
    """One sandbox's egress: its policy, resolver, limits and log, shared by all its
    listeners and connections."""

    def __init__(self, policy: EgressPolicy, resolve: Resolver):
        self.policy, self.resolve = policy, resolve
        self.meter = Meter(policy.limits)
        self.log = Log()
        self._contexts: dict[str, ssl.SSLContext] = {}

    def upstream_policy(self, up: Upstream) -> EgressPolicy:
        """The upstream's own host and port are allowed; what it resolves to is checked
        like any name's, against the sandbox's listed addresses."""
        own = (Rule("name", up.host, frozenset({up.port})) if isinstance(up.host, str)
               else Rule("network", f"{up.host}/{up.host.max_prefixlen}", frozenset({up.port})))
        listed = tuple(r for r in self.policy.rules if r.kind == "network")
        return EgressPolicy((own,) + listed, (), self.policy.limits)

    def tls(self, up: Upstream) -> ssl.SSLContext:
        if up.name not in self._contexts:
            self._contexts[up.name] = ssl.create_default_context(cafile=up.ca_file)
        return self._contexts[up.name]


class _Ended(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _Dest:
    def __init__(self, key: tuple, address: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter):
        self.key, self.address, self.reader, self.writer = key, address, reader, writer


async def serve(gate: Gate, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                upstream: Upstream | None) -> None:
    """Serve one accepted connection to its end; never raises."""
    via = "proxy" if upstream is None else f"upstream:{upstream.name}"
    if not gate.meter.try_open():
        entry = gate.log.open(via, "", 0)
        entry.decide(False, "connections", f"{gate.policy.limits.max_connections} "
                     "connections open, EgressLimits.max_connections")
        await _answer_and_close(writer, entry)
        return
    client = _Client(gate, reader, writer, upstream)
    try:
        await client.run()
    except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
        pass  # the agent's side went away: its entry already says what was carried
    finally:
        gate.meter.close()
        await client.close()


async def _answer_and_close(writer: asyncio.StreamWriter, entry: Entry) -> None:
    code, phrase = _STATUS.get(entry.reason, (403, "Forbidden"))
    fix = _FIX.get(entry.reason)
    text = (f"karotte egress: {entry.via} {show(entry.host, entry.port)} refused: "
            f"{entry.reason}" + (f" ({entry.detail})" if entry.detail else "")
            + (f"; {fix}" if fix else ""))
    try:
        writer.write(response(code, phrase, entry.reason, text))
        await asyncio.wait_for(writer.drain(), 5)
    except (OSError, asyncio.TimeoutError):
        pass
    writer.close()


class _Client:
    def __init__(self, gate: Gate, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, upstream: Upstream | None):
        self.gate, self.reader, self.writer, self.upstream = gate, reader, writer, upstream
        self.limits = gate.policy.limits
        self.dest: _Dest | None = None
        self.stamp = time.monotonic()

    async def run(self) -> None:
        while True:
            try:
                head = await asyncio.wait_for(read_head(self.reader), self.limits.idle_timeout)
            except asyncio.TimeoutError:
                return
            except BadMessage as exc:
                await self._refuse(self.gate.log.open("proxy", "", 0), "bad_request", str(exc))
                return
            if head is None:
                return
            if not await self._request(head):
                return

    async def close(self) -> None:
        self._drop_dest()
        self.writer.close()

    def _drop_dest(self) -> None:
        if self.dest is not None:
            self.dest.writer.close()
            self.dest = None

    async def _refuse(self, entry: Entry, reason: str, detail: str = "",
                      allowed: bool = False) -> bool:
        entry.decide(allowed, reason, detail)
        await _answer_and_close(self.writer, entry)
        return False

    async def _request(self, head: Head) -> bool:
        """Handle one request; whether the connection stays open for the next."""
        log = self.gate.log
        try:
            method, target, version = request_line(head)
        except BadMessage as exc:
            return await self._refuse(log.open("proxy", "", 0), "bad_request", str(exc))
        if self.upstream is not None:
            return await self._to_upstream(head, method, target, version)
        if method == "CONNECT":
            await self._tunnel(target)
            return False
        return await self._forward(head, method, target, version)

    # --- absolute-form HTTP -------------------------------------------------------
    async def _forward(self, head: Head, method: str, target: str, version: str) -> bool:
        log = self.gate.log
        parts = urllib.parse.urlsplit(target)
        if not parts.scheme and target.startswith("/"):
            return await self._refuse(log.open("http", (head.values("host") or [""])[0][:255],
                                               0), "not_proxy_request")
        if parts.scheme != "http" or not parts.netloc or "@" in parts.netloc:
            return await self._refuse(log.open("http", "", 0), "bad_request",
                                      f"{target[:200]!r} is no http://HOST[:PORT]/PATH URL")
        try:
            host, port = split_authority(parts.netloc, 80)
        except BadHost as exc:
            return await self._refuse(log.open("http", parts.netloc[:255], 0), "bad_host",
                                      str(exc))
        entry = log.open("http", str(host), port)
        hosts = head.values("host")
        try:
            if len(hosts) > 1 or (hosts and split_authority(hosts[0], 80) != (host, port)):
                # fronting by Host: the connection goes to one host, the request to another
                return await self._refuse(entry, "host_mismatch",
                                          f"Host: {', '.join(hosts)[:200]}")
        except BadHost as exc:
            return await self._refuse(entry, "host_mismatch", str(exc))
        verdict = await check(self.gate.policy, str(host), port, self.gate.resolve)
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        headers = [("Host", host_header(host, port, 80))]
        return await self._send_request(entry, verdict, head, method, path, version,
                                        headers + forwarded_headers(head, {"host"}), None)

    # --- a named upstream ---------------------------------------------------------
    async def _to_upstream(self, head: Head, method: str, target: str, version: str) -> bool:
        up = self.upstream
        entry = self.gate.log.open(f"upstream:{up.name}", str(up.host), up.port)
        if not target.startswith("/") or method.upper() == "CONNECT":  # no tunnel either
            return await self._refuse(entry, "bad_request", f"an upstream listener takes "
                                      f"origin-form requests (GET /path), not "
                                      f"{method[:20]} {target[:200]!r}")
        if climbs(target):  # out of the upstream's base path, to a server that normalises
            return await self._refuse(entry, "bad_request", f"an upstream listener takes paths "
                                      f"below its upstream's base path: no '.' or '..' "
                                      f"segment, spelled with %2e or a backslash or not, in "
                                      f"{target[:200]!r}")
        if method.upper() in ECHOING_METHODS:  # the upstream would echo the credentials back
            return await self._refuse(entry, "bad_request", f"{method[:20]} is refused on an "
                                      f"upstream listener: its answer echoes the request, with "
                                      f"the credentials the host adds to it")
        verdict = await check(self.gate.upstream_policy(up), str(up.host), up.port,
                              self.gate.resolve)
        drop = {"host"} | {k.lower() for k, _ in up.headers}  # the agent sets no credential
        host = host_header(up.host, up.port, 443 if up.scheme == "https" else 80)
        headers = [("Host", host)] + forwarded_headers(head, drop) + list(up.headers)
        return await self._send_request(entry, verdict, head, method, up.path + target,
                                        version, headers, up)

    # --- one exchange -------------------------------------------------------------
    async def _send_request(self, entry: Entry, verdict: Verdict, head: Head, method: str,
                            path: str, version: str, headers: list[tuple[str, str]],
                            up: Upstream | None) -> bool:
        try:
            body_kind, body_length = framing(head)
        except BadMessage as exc:
            return await self._refuse(entry, "bad_request", str(exc))
        if not verdict.allowed:
            return await self._refuse(entry, verdict.reason, verdict.detail)
        entry.decide(True, "ok")
        dest = await self._connect(entry, verdict, up)
        if dest is None:
            return False
        answered = False

        async def request_body() -> None:
            await self._send(dest.writer, build_head(f"{method} {path} {version}", headers),
                             entry, True)
            try:
                await self._relay(self.reader, self.writer, dest.writer, entry, True,
                                  body_kind, body_length)
            except BadMessage as exc:
                raise _Ended("bad_request", str(exc)) from None

        async def reply() -> tuple[Head, str]:
            nonlocal answered
            try:
                while True:
                    rhead = await read_head(dest.reader)
                    if rhead is None:
                        raise BadMessage("the destination closed without a response")
                    code = status_code(rhead)
                    kind, length = framing(rhead, method)
                    answered = True
                    await self._send(self.writer, rhead.raw, entry, False)
                    if code >= 200 or code == 101:
                        break
                await self._relay(dest.reader, dest.writer, self.writer, entry, False,
                                  kind, length)
            except BadMessage as exc:
                raise _Ended("upstream_failed", str(exc)) from None
            return rhead, kind

        sending = asyncio.ensure_future(request_body())
        replying = asyncio.ensure_future(reply())
        try:
            await self._watch({sending, replying}, until={replying})
        except _Ended as exc:
            self._drop_dest()
            if answered:
                entry.end(exc.reason, exc.detail)
                return False
            return await self._refuse(entry, exc.reason, exc.detail, allowed=True)
        rhead, kind = replying.result()
        done = not sending.cancelled()  # the whole request went, not cut by the reply
        if kind == "close" or not done or rhead.start[0] != "HTTP/1.1" \
                or "close" in rhead.tokens("connection") or status_code(rhead) == 101:
            self._drop_dest()
        return (done and kind != "close" and version == "HTTP/1.1"
                and "close" not in head.tokens("connection") and status_code(rhead) != 101)

    async def _connect(self, entry: Entry, verdict: Verdict, up: Upstream | None):
        """A connection to one of exactly the addresses the check passed (no second
        lookup, EGRESS-REBIND-01): the open one when it goes there, else a new one."""
        key = (verdict.host, verdict.port, up.name if up else None)
        if (self.dest is not None and self.dest.key == key
                and self.dest.address in verdict.addresses
                and not self.dest.writer.is_closing() and not self.dest.reader.at_eof()):
            return self.dest
        self._drop_dest()
        context = self.gate.tls(up) if up is not None and up.scheme == "https" else None
        errors = []
        for address in verdict.addresses:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    address, verdict.port, limit=BUFFER, ssl=context,
                    server_hostname=str(up.host) if context else None),
                    self.limits.connect_timeout)
            except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
                errors.append(f"{address}: {exc or 'timed out'}")
                continue
            self.dest = _Dest(key, address, reader, writer)
            return self.dest
        await self._refuse(entry, "connect_failed", "; ".join(errors)[:500], allowed=True)
        return None

    # --- CONNECT ------------------------------------------------------------------
    async def _tunnel(self, target: str) -> None:
        log = self.gate.log
        try:
            host, port = split_authority(target, None)
        except BadHost as exc:
            await self._refuse(log.open("connect", target[:255], 0), "bad_host", str(exc))
            return
        entry = log.open("connect", str(host), port)
        verdict = await check(self.gate.policy, str(host), port, self.gate.resolve)
        if not verdict.allowed:
            await self._refuse(entry, verdict.reason, verdict.detail)
            return
        entry.decide(True, "ok")
        dest = await self._connect(entry, verdict, None)
        if dest is None:
            return
        self.writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        try:
            raw, hello = await asyncio.wait_for(read_client_hello(self.reader),
                                                self.limits.connect_timeout)
        except (NotClientHello, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            entry.decide(False, "not_tls", str(exc) or "no ClientHello in time")
            return
        if hello.encrypted:
            entry.decide(False, "ech", "an encrypted ClientHello hides the name it greets")
            return
        try:
            named = None if hello.server_name is None else normalise_host(hello.server_name)
        except BadHost:
            named = hello.server_name
        if named != (host if isinstance(host, str) else None):
            entry.decide(False, "sni_mismatch", f"server_name {hello.server_name!r}")
            return
        try:
            await self._send(dest.writer, raw, entry, True)
            await self._watch({
                asyncio.ensure_future(self._pump(self.reader, self.writer, dest.writer,
                                                 entry, True)),
                asyncio.ensure_future(self._pump(dest.reader, dest.writer, self.writer,
                                                 entry, False))})
        except _Ended as exc:
            entry.end(exc.reason, exc.detail)

    async def _pump(self, reader: asyncio.StreamReader, source: asyncio.StreamWriter,
                    writer: asyncio.StreamWriter, entry: Entry, up: bool) -> None:
        try:
            await self._relay(reader, source, writer, entry, up, "close", 0)
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, ssl.SSLError) as exc:
            raise _Ended("ok" if up else "upstream_failed", str(exc)) from None

    # --- every byte ---------------------------------------------------------------
    async def _account(self, n: int, entry: Entry, up: bool) -> None:
        """Meter n bytes about to go on (where every limit applies), and count them."""
        try:
            await self.gate.meter.take(n)
        except LimitReached as exc:
            raise _Ended(exc.reason, str(exc)) from None
        if up:  # counted before it goes, so a record read once the client has it shows it
            entry.sent += n
        else:
            entry.received += n
        self.stamp = time.monotonic()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes, entry: Entry,
                    up: bool) -> None:
        await self._account(len(data), entry, up)
        writer.write(data)
        await writer.drain()

    async def _relay(self, reader: asyncio.StreamReader, source: asyncio.StreamWriter,
                     writer: asyncio.StreamWriter, entry: Entry, up: bool, kind: str,
                     length: int) -> None:
        """A body as framing() said ("close": a tunnel's stream too) from the source
        connection (its reader and writer) to writer. A long one between two plain TCP
        sockets moves socket to socket, past the streams (_Relay); the rest (short and
        chunked bodies, TLS to an upstream) through the streams."""
        if (kind == "close" or (kind == "length" and length >= RELAY_AT_LEAST)) \
                and _plain_socket(source) and _plain_socket(writer):
            await _Relay(self, reader, source, writer, entry, up).run(
                None if kind == "close" else length)
        else:
            await relay_body(reader, self._sender(writer, entry, up), kind, length)

    def _sender(self, writer: asyncio.StreamWriter, entry: Entry, up: bool):
        return lambda data: self._send(writer, data, entry, up)

    async def _watch(self, tasks: set[asyncio.Future], until: set[asyncio.Future] | None = None
                     ) -> None:
        """Run tasks until those of `until` (all, when None) are done; the first error
        ends them all, and so does idle_timeout without a byte either way."""
        until = set(tasks if until is None else until)
        idle = self.limits.idle_timeout
        pending = set(tasks)
        try:
            while until & pending:
                done, pending = await asyncio.wait(pending, timeout=min(idle, 5.0),
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
                if not done and time.monotonic() - self.stamp >= idle:
                    raise _Ended("idle", f"nothing carried for {idle:g} s")
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError) as exc:
            raise _Ended("upstream_failed", str(exc) or type(exc).__name__) from None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# --- the socket relay ------------------------------------------------------------
RELAY_AT_LEAST = 256 * 1024  # a shorter body is not worth taking the sockets over
KEEP_BUFFERS = 4  # a thread's idle buffers kept for the next read (BUFFER each)


class _Buffers(threading.local):
    """Each proxy thread's buffers of BUFFER bytes. A relay holds one only from a read to
    the end of its send, so an idle tunnel holds none."""

    def __init__(self):
        self.free: list[bytearray] = []
        self.held = 0  # taken and not given back: one per relay with bytes on their way

    def take(self) -> bytearray:
        buf = self.free.pop() if self.free else bytearray(BUFFER)
        self.held += 1
        return buf

    def give(self, buf: bytearray) -> None:
        self.held -= 1
        if len(self.free) < KEEP_BUFFERS:
            self.free.append(buf)


_buffers = _Buffers()


def _dup(transport: asyncio.Transport) -> socket.socket:
    """A socket of its own on the transport's, so that the loop's reader and writer
    callbacks name an fd no transport holds. Non-blocking whatever the process's
    socket.setdefaulttimeout() (a trainer's library may set one): the relay waits on the
    loop, never in a call."""
    fd = os.dup(transport.get_extra_info("socket").fileno())
    try:
        sock = socket.socket(fileno=fd)
    except BaseException:
        os.close(fd)
        raise
    sock.setblocking(False)
    return sock


def _plain_socket(writer: asyncio.StreamWriter) -> bool:
    return (writer.get_extra_info("ssl_object") is None
            and writer.get_extra_info("socket") is not None)


class _Relay:
    """One direction of a connection, moved socket -> buffer -> socket by the proxy's
    thread, past the streams: up to BUFFER bytes a read, each read sent whole before the
    next. It pauses the source's transport, sends on what the stream had read ahead, and
    then takes the source's socket; it takes the destination's once its transport's
    buffer is empty. So the order of bytes is kept; both go back to their transports at
    the end. Every read is metered (_Client._account) before it goes on, so the limits
    and the record are those of the streamed path: at most one read (BUFFER, what a
    stream read takes) is held back by a refused take, and none of it is sent.

    Why a copy and not splice(2): splice moves page references, so a segment it builds
    holds at most MAX_SKB_FRAGS (17) small pages, about 64 KiB; a send from a buffer
    builds segments as large as the link takes (the sandbox's loopback: 512 KiB, BIG
    TCP, csrc/init/net.c). The kernel's per-segment work is most of a loopback's cost:
    in scripts/bench_egress.py's runs a bare splice relay reached 0.33-0.41 of direct and
    a bare copy relay 0.81-0.93 (docs/egress.md, Where the proxy runs).
    """

    def __init__(self, client: _Client, reader: asyncio.StreamReader,
                 source: asyncio.StreamWriter, writer: asyncio.StreamWriter, entry: Entry,
                 up: bool):
        self.client, self.reader, self.writer, self.entry, self.up = (
            client, reader, writer, entry, up)
        self.source, self.dest = source.transport, writer.transport
        self.loop = asyncio.get_running_loop()

    async def run(self, length: int | None) -> None:
        """Move length bytes (None: to the source's end)."""
        # The stream reads no more from here: what it read ahead goes first, then the
        # relay takes over, however fast the source sends (a stream that is refilled as
        # it drains would otherwise carry the whole body)
        self.source.pause_reading()
        limits = self.dest.get_write_buffer_limits()
        try:
            left = await self._drain_stream(length)
            if left == 0:
                return
            if self.reader.at_eof():  # the stream saw the end already, and holds nothing
                if length is not None:
                    raise BadMessage("the connection ended inside a body")
                return
            await self._drain_dest()
            await self._move(left)
        finally:
            self.dest.set_write_buffer_limits(limits[1], limits[0])
            if not self.source.is_closing():
                self.source.resume_reading()

    async def _drain_stream(self, length: int | None) -> int | None:
        """What the stream read ahead goes first, as it came; what is left to move."""
        # asyncio has no public count of what a StreamReader holds: its buffer's length
        while (held := len(self.reader._buffer)) and length != 0:
            data = await self.reader.read(held if length is None else min(held, length))
            # a stream that had paused its transport itself (full) resumes it as it
            # drains: paused again, so that nothing more comes into the stream
            self.source.pause_reading()
            await self.client._send(self.writer, data, self.entry, self.up)
            if length is not None:
                length -= len(data)
        return length

    async def _drain_dest(self) -> None:
        if self.dest.get_write_buffer_size():
            self.dest.set_write_buffer_limits(0)  # drain() now waits for an empty buffer
            await self.writer.drain()

    async def _move(self, length: int | None) -> None:
        with _dup(self.source) as src, _dup(self.dest) as dst:
            while length != 0:
                buf = _buffers.take()
                try:
                    n = await self._carry(src, dst, buf, length)
                finally:
                    _buffers.give(buf)
                if n is None:  # nothing to read: wait for it, holding no buffer
                    await self._ready(self.loop.add_reader, self.loop.remove_reader, src)
                elif n == 0:
                    if length is not None:
                        raise BadMessage("the connection ended inside a body")
                    return
                elif length is not None:
                    length -= n

    async def _carry(self, src: socket.socket, dst: socket.socket, buf: bytearray,
                     length: int | None) -> int | None:
        """One read into buf, metered, then sent whole: its size; 0 at the source's end,
        None when there is nothing to read yet."""
        try:
            n = src.recv_into(buf, BUFFER if length is None else min(BUFFER, length))
        except BlockingIOError:
            return None
        if n:
            await self.client._account(n, self.entry, self.up)
            with memoryview(buf) as view:
                sent = 0
                while sent < n:
                    try:
                        sent += dst.send(view[sent:n], socket.MSG_NOSIGNAL)
                    except BlockingIOError:
                        await self._ready(self.loop.add_writer, self.loop.remove_writer, dst)
        return n

    async def _ready(self, add, remove, sock: socket.socket) -> None:
        ready = self.loop.create_future()
        add(sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            remove(sock.fileno())
