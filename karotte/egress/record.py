"""What a sandbox reached: one entry per CONNECT tunnel or HTTP request, as frozen data.

The proxy writes the log from its event loop; a trainer reads `EgressRecord` snapshots
from any thread. The log holds at most MAX_REACHES entries; what comes after is counted
in `dropped`, so a flood of refused requests cannot grow the trainer's memory.
"""
from __future__ import annotations

import threading

from ..results import EgressRecord, Reach  # plain data, also in a grader's ctx.run results

# The closed set of Reach.reason. "ok": allowed and ended normally.
REASONS = frozenset({
    "ok",
    "not_allowed",  # no allow-list entry covers the name and port
    "ip_literal",  # an address the allow-list does not list
    "internal_address",  # an allowed name resolved to loopback/private/link-local/metadata
    "bad_host",  # no host name, address or port
    "host_mismatch",  # the Host header names another host than the request's target
    "sni_mismatch",  # the tunnel's TLS server_name is not the CONNECT authority
    "ech",  # an encrypted ClientHello hides the name the tunnel greets
    "not_tls",  # a CONNECT tunnel that did not start with a TLS ClientHello
    "bad_request",  # a request the proxy does not parse (or smuggling-shaped framing)
    "not_proxy_request",  # an origin-form request to the forward proxy
    "resolve_failed",  # an allowed name did not resolve
    "connect_failed",  # an allowed destination did not accept (or not in time)
    "upstream_failed",  # the destination broke the exchange
    "connections",  # past EgressLimits.max_connections
    "bytes_total",  # past EgressLimits.max_bytes: cut
    "bytes_per_second",  # the ip mode: packets past EgressLimits.bytes_per_second, dropped
    "idle",  # nothing carried for EgressLimits.idle_timeout
})
MAX_REACHES = 1000


class Entry:
    """A Reach while it is still open: its byte counts grow."""

    __slots__ = ("via", "host", "port", "allowed", "reason", "sent", "received", "detail")

    def __init__(self, via: str, host: str, port: int):
        self.via, self.host, self.port = via, host, port
        self.allowed, self.reason, self.detail = False, "ok", ""
        self.sent = self.received = 0

    def decide(self, allowed: bool, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        self.allowed, self.reason, self.detail = allowed, reason, detail

    def end(self, reason: str, detail: str = "") -> None:
        """An allowed entry cut short keeps allowed=True and says why it ended."""
        assert reason in REASONS, reason
        if self.reason == "ok":
            self.reason, self.detail = reason, detail

    def freeze(self) -> Reach:
        return Reach(self.via, self.host, self.port, self.allowed, self.reason,
                     self.sent, self.received, self.detail)


class Log:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: list[Entry] = []
        self._dropped = 0

    def open(self, via: str, host: str, port: int) -> Entry:
        entry = Entry(via, host, port)
        with self._lock:
            if len(self._entries) < MAX_REACHES:
                self._entries.append(entry)
            else:
                self._dropped += 1
        return entry

    def snapshot(self) -> EgressRecord:
        with self._lock:
            return EgressRecord(tuple(e.freeze() for e in self._entries), self._dropped)

    def mark(self) -> tuple[int, int]:
        """Where the log is now: (entries held, entries seen), for since()."""
        with self._lock:
            return len(self._entries), len(self._entries) + self._dropped

    def since(self, mark: tuple[int, int], limit: int) -> EgressRecord:
        """The entries opened after mark, at most `limit` held, the rest counted. The log
        only appends, and past MAX_REACHES only counts, so the entries held past mark's
        are exactly the new ones it holds."""
        held, seen = mark
        with self._lock:
            new = tuple(e.freeze() for e in self._entries[held:held + limit])
            return EgressRecord(new, len(self._entries) + self._dropped - seen - len(new))
