"""The allow-list grammar, parsed in this one place, and the policy of one sandbox.

An entry of `allow` is one of

    NAME[:PORTS]       the name itself (IDNA, any case, one trailing dot allowed)
    *.SUFFIX[:PORTS]   every name below SUFFIX (not SUFFIX itself)
    *[:PORTS]          every name (never an address: those are listed one by one)
    ADDRESS[:PORTS]    an IPv4 address, [IPv6], or a network such as 10.0.0.0/8 or [fd00::/8]

with PORTS a port, or `*` for any; without it, 80 and 443. mode "proxy" (the default)
reaches them through the host-side proxy; mode "ip" (root only, karotte/egress/ip.py)
routes the sandbox's packets to the addresses, TCP and UDP, by nftables rules: names only
(resolved on the host at start), no wildcards, no upstreams. An address is reachable only
when an entry lists it: as an IP literal, and as what an allowed name resolves to when it
is loopback, link-local, private or cloud metadata (karotte/egress/check.py).

A named upstream (`{"model": "https://api.example.com/v1"}`) is a service the agent
reaches as plain HTTP at a fixed address inside its sandbox; the host side adds the
scheme, TLS and the upstream's headers (credentials), which never enter the sandbox.
"""
from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import KarotteError
from .hostnames import BadHost, IPAddress, normalise_host, parse_port, show

DEFAULT_PORTS = frozenset({80, 443})
GRAMMAR = ("NAME[:PORT], *.SUFFIX[:PORT], *[:PORT], an IP address or network "
           "(1.2.3.4, [::1], 10.0.0.0/8)[:PORT]; PORT is a number or *, 80 and 443 when left out")
_UPSTREAM_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")


class EgressConfigError(KarotteError):
    """An allow-list entry, upstream or limit that is not in the grammar; the message
    shows the entry and the grammar."""


@dataclass(frozen=True)
class Rule:
    """One parsed entry of an allow-list. kind: "name", "suffix", "any" or "network"."""

    kind: str
    value: str  # the name, the suffix without "*.", "*", or the network ("10.0.0.0/8")
    ports: frozenset[int] | None  # None: any port

    def matches_name(self, name: str, port: int) -> bool:
        if not self._port(port):
            return False
        if self.kind == "name":
            return name == self.value
        if self.kind == "suffix":
            return name.endswith("." + self.value)
        return self.kind == "any"

    def matches_address(self, address: IPAddress, port: int) -> bool:
        return (self.kind == "network" and self._port(port)
                and address in ipaddress.ip_network(self.value))

    def _port(self, port: int) -> bool:
        return self.ports is None or port in self.ports


def parse_rule(entry: str) -> Rule:
    """One allow-list entry, or EgressConfigError that shows it and the grammar."""
    if not isinstance(entry, str):
        raise EgressConfigError(f"allow-list entry {entry!r} is no string: write {GRAMMAR}")
    try:
        return _parse_rule(entry)
    except (BadHost, ValueError) as exc:
        raise EgressConfigError(f"allow-list entry {entry!r}: {exc}; write {GRAMMAR}") from None


def _parse_rule(entry: str) -> Rule:
    host, ports = _split_ports(entry)
    if host == "*":
        return Rule("any", "*", ports)
    if host.startswith("*."):
        suffix = normalise_host(host[2:])
        if not isinstance(suffix, str):
            raise ValueError("a wildcard covers names, not addresses")
        return Rule("suffix", suffix, ports)
    if "*" in host:
        raise ValueError("'*' stands alone or as the first label ('*.example.com')")
    if "/" in host:
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        return Rule("network", str(ipaddress.ip_network(inner, strict=True)), ports)
    name = normalise_host(host)
    if isinstance(name, str):
        return Rule("name", name, ports)
    return Rule("network", str(ipaddress.ip_network(name)), ports)


def _split_ports(entry: str) -> tuple[str, frozenset[int] | None]:
    if entry.startswith("["):
        close = entry.find("]")
        if close < 0:
            raise ValueError("an IPv6 address is written in brackets, [ADDRESS]")
        host, rest = entry[:close + 1], entry[close + 1:]
    elif entry.count(":") == 1:
        host, rest = entry.split(":")
        rest = ":" + rest
    elif ":" in entry:
        raise ValueError("write an IPv6 address in brackets, [ADDRESS]:PORT")
    else:
        host, rest = entry, ""
    if not rest:
        return host, DEFAULT_PORTS
    if not rest.startswith(":"):
        raise ValueError(f"{rest!r} after the host is no :PORT")
    if rest == ":*":
        return host, None
    return host, frozenset({parse_port(rest[1:], entry)})


@dataclass(frozen=True)
class Upstream:
    """A named service: the agent sends plain HTTP to its local listener; the proxy sends
    the request on to `url` (its path prefixed), over TLS for https, with `headers` added
    (replacing any the agent sent under those names)."""

    name: str
    scheme: str  # "http" or "https"
    host: str | IPAddress
    port: int
    path: str  # prefix of every request's path, "" or "/v1"
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # credentials
    ca_file: str | None = None  # the CA bundle that verifies it, None: the system's

    @property
    def authority(self) -> str:
        return show(self.host, self.port)


def parse_upstream(name: str, value: object) -> Upstream:
    """`"https://host[:port][/prefix]"`, or {"url": ..., "headers": {...}, "ca_file": ...}."""
    if not (isinstance(name, str) and _UPSTREAM_NAME.match(name)):
        raise EgressConfigError(f"upstream name {name!r}: a lowercase identifier of at most "
                                "32 letters, digits and '_', starting with a letter ('model')")
    if isinstance(value, Upstream):
        return value
    if isinstance(value, str):
        value = {"url": value}
    if not isinstance(value, Mapping) or set(value) - {"url", "headers", "ca_file"}:
        raise EgressConfigError(f"upstream {name!r}: a URL, or a mapping of url, headers "
                                f"and ca_file, not {value!r}")
    url = value.get("url")
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or parts.username is not None or parts.query or parts.fragment):
        raise EgressConfigError(f"upstream {name!r}: url {url!r} is not http(s)://HOST"
                                "[:PORT][/PATH] (credentials go in headers=, never the URL)")
    try:
        host = normalise_host(parts.hostname)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except (BadHost, ValueError) as exc:
        raise EgressConfigError(f"upstream {name!r}: url {url!r}: {exc}") from None
    headers = value.get("headers") or {}
    if not (isinstance(headers, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) and _header_ok(k, v)
            for k, v in headers.items())):
        raise EgressConfigError(f"upstream {name!r}: headers is a mapping of header names "
                                "to values, without CR, LF or NUL")
    ca_file = value.get("ca_file")
    if ca_file is not None and not isinstance(ca_file, str):
        raise EgressConfigError(f"upstream {name!r}: ca_file is a path, not {ca_file!r}")
    return Upstream(name, parts.scheme, host, port, parts.path.rstrip("/"),
                    tuple(headers.items()), ca_file)


def _header_ok(name: str, value: str) -> bool:
    return (re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name) is not None
            and not any(c in value for c in "\r\n\0"))


@dataclass(frozen=True)
class EgressLimits:
    """Per sandbox, over all its connections. Past max_connections a new one is refused
    ("connections"); past max_bytes (both directions together) every connection is cut
    ("bytes_total"); bytes_per_second paces them (None: unpaced)."""

    max_connections: int = 32
    bytes_per_second: int | None = 64 * 2**20
    max_bytes: int | None = 4 * 2**30
    connect_timeout: float = 10.0  # seconds to reach a destination
    idle_timeout: float = 300.0  # seconds a connection may carry nothing

    def __post_init__(self):
        for name in ("max_connections", "bytes_per_second", "max_bytes"):
            value = getattr(self, name)
            if not (value is None and name != "max_connections") and not (
                    isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise EgressConfigError(f"EgressLimits.{name} is a positive integer"
                                        f"{'' if name == 'max_connections' else ' or None'}"
                                        f", not {value!r}")
        for name in ("connect_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and 0 < value < float("inf")):
                raise EgressConfigError(f"EgressLimits.{name} is a positive number of "
                                        f"seconds, not {value!r}")


@dataclass(frozen=True)
class EgressPolicy:
    """What one sandbox may reach: the parsed allow-list, its upstreams, its limits."""

    rules: tuple[Rule, ...] = ()
    upstreams: tuple[Upstream, ...] = ()
    limits: EgressLimits = EgressLimits()
    mode: str = "proxy"  # or "ip": a veth and nftables rules (karotte/egress/ip.py)

    def allows_name(self, name: str, port: int) -> bool:
        return any(rule.matches_name(name, port) for rule in self.rules)

    def lists_address(self, address: IPAddress, port: int) -> bool:
        return any(rule.matches_address(address, port) for rule in self.rules)

    def upstream(self, name: str) -> Upstream:
        return next(u for u in self.upstreams if u.name == name)


def parse_policy(allow: Iterable[str] = (), upstreams: Mapping[str, object] | None = None,
                 limits: EgressLimits | None = None, mode: str = "proxy") -> EgressPolicy:
    """The one entry point: an allow-list, named upstreams and limits -> EgressPolicy."""
    if mode not in ("proxy", "ip"):
        raise EgressConfigError(f"mode is 'proxy' (the host-side proxy) or 'ip' (a veth "
                                f"with nftables rules, root only), not {mode!r}")
    if isinstance(allow, str):
        raise EgressConfigError(f"allow is a list of entries, not the string {allow!r}: "
                                f"write [{allow!r}]")
    if limits is not None and not isinstance(limits, EgressLimits):
        raise EgressConfigError(f"limits is an EgressLimits, not {limits!r}")
    if upstreams is not None and not isinstance(upstreams, Mapping):
        raise EgressConfigError(f"upstreams maps names to URLs, not {upstreams!r}")
    policy = EgressPolicy(tuple(parse_rule(entry) for entry in allow),
                          tuple(parse_upstream(k, v) for k, v in (upstreams or {}).items()),
                          limits or EgressLimits(), mode)
    if mode == "ip":
        _check_ip_mode(policy)
    return policy


def _check_ip_mode(policy: EgressPolicy) -> None:
    """What the ip mode cannot do: it matches addresses, so a name must be one it can
    resolve at start, and no packet carries the host-side proxy's upstreams."""
    if policy.upstreams:
        raise EgressConfigError("named upstreams are served by the proxy: use mode='proxy' "
                                "for them (the ip mode routes packets, it adds no TLS or "
                                "credentials)")
    for rule in policy.rules:
        if rule.kind in ("suffix", "any"):
            raise EgressConfigError(f"allow-list entry {'*.' if rule.kind == 'suffix' else ''}"
                                    f"{rule.value if rule.kind == 'suffix' else '*'}: the ip "
                                    "mode matches addresses, so it takes names and addresses, "
                                    "not wildcards; use mode='proxy' for those")
        if rule.kind == "network" and ipaddress.ip_network(rule.value).version != 4:
            raise EgressConfigError(f"allow-list entry {rule.value}: the ip mode gives the "
                                    "sandbox IPv4 only; list IPv4 addresses")
