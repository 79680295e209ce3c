"""The one check every request of every listener goes through (EGRESS-BYPASS-01).

`check(policy, host, port, resolve)` decides a destination in a fixed order: the name in
its one form (hostnames.py), the allow-list, only then the resolver, then every address
the name resolved to. A name that is not allowed is never resolved, so a refused request
carries nothing out through DNS; the caller connects to exactly the addresses checked
here, so a second lookup cannot rebind the name (EGRESS-REBIND-01).
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from .hostnames import BadHost, IPAddress, normalise_host
from .policy import EgressPolicy

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

# Addresses the internet does not route but a host or its cloud does: the cloud metadata
# services are named, although every one of them is in a range below as well.
METADATA = frozenset(map(ipaddress.ip_address, (
    "169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class Verdict:
    """The decision on one destination: allowed with the addresses to connect to, or
    refused with a reason of karotte.egress.record.REASONS."""

    host: str  # as the record shows it (normalised when it could be)
    port: int
    allowed: bool
    reason: str  # "ok" when allowed
    addresses: tuple[str, ...] = ()
    detail: str = ""


def internal(address: IPAddress) -> bool:
    """Loopback, link-local, private, shared, reserved, multicast or metadata, including
    such an IPv4 address inside an IPv4-mapped or NAT64 IPv6 one."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return internal(address.ipv4_mapped)
        if address in _NAT64:
            return internal(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return address in METADATA or address.is_multicast or not address.is_global


async def check(policy: EgressPolicy, host: str, port: int, resolve: Resolver) -> Verdict:
    try:
        name = normalise_host(host)
    except BadHost as exc:
        return Verdict(host[:255], port, False, "bad_host", detail=str(exc))
    if not isinstance(name, str):
        if policy.lists_address(name, port):
            return Verdict(str(name), port, True, "ok", (str(name),))
        return Verdict(str(name), port, False, "ip_literal",
                       detail="an address is reachable only when the allow-list lists it")
    if not policy.allows_name(name, port):
        return Verdict(name, port, False, "not_allowed",
                       detail="no allow-list entry covers this name and port")
    try:
        found = [ipaddress.ip_address(a.split("%")[0]) for a in await resolve(name, port)]
    except (OSError, ValueError, UnicodeError) as exc:
        return Verdict(name, port, False, "resolve_failed", detail=str(exc))
    if not found:
        return Verdict(name, port, False, "resolve_failed", detail="no address")
    for address in found:
        if internal(address) and not policy.lists_address(address, port):
            # An allowed name pointed at the host's own services (DNS rebinding, SSRF).
            return Verdict(name, port, False, "internal_address",
                           detail=f"{name} resolves to {address}, which the allow-list "
                                  "does not list")
    return Verdict(name, port, True, "ok", tuple(dict.fromkeys(map(str, found))))


async def system_resolver(name: str, port: int) -> Sequence[str]:
    """The host's resolver (getaddrinfo), asked only for names already allowed."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [info[4][0] for info in infos]


def static_resolver(hosts: Mapping[str, Sequence[str]]) -> Resolver:
    """A resolver from a fixed table (names as normalise_host writes them): for pinned
    hosts, and for tests, which must never ask real DNS."""
    table = {normalise_host(k): tuple(v) for k, v in hosts.items()}

    async def resolve(name: str, port: int) -> Sequence[str]:
        if name not in table:
            raise OSError(f"{name} is not in the resolver's table")
        return table[name]
    return resolve
