"""Host names and authorities as the egress check compares them: one normal form.

Every name the proxy meets (an allow-list entry, a CONNECT authority, an absolute URL, a
Host header, a TLS SNI) goes through `normalise_host`, so two spellings of one host
compare equal and a spelling the resolver would read as an address is an address:
"127.1", "0x7f000001" and "2130706433" are what inet_aton makes of them, 127.0.0.1, and
are refused as IP literals unless that address is listed (EGRESS-IPLIT-01).
"""
from __future__ import annotations

import ipaddress
import re
import socket

from ..errors import KarotteError

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class BadHost(KarotteError):
    """A host or authority that is no host name, address or port; the message says why."""


def normalise_host(text: str) -> str | IPAddress:
    """A name in its one form (IDNA A-labels, lowercase, no trailing dot), or the address
    it spells. Raises BadHost for anything else (empty labels, spaces, a numeric last
    label, over 253 bytes)."""
    if not isinstance(text, str) or not text:
        raise BadHost(f"{text!r} is no host name")
    if any(c.isspace() or not c.isprintable() or c in "/\\@?#" for c in text):
        # inet_aton stops at a space: "127.0.0.1 x" would otherwise pass as an address
        raise BadHost(f"{text!r} is no host name: it holds a space, control or URL character")
    if text.startswith("[") and text.endswith("]"):
        return _ipv6(text[1:-1], text)
    if ":" in text:
        return _ipv6(text, text)
    try:  # every form inet_aton reads, since getaddrinfo would read it the same way
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        pass
    name = text[:-1] if text.endswith(".") else text
    try:
        name = name.encode("idna").decode("ascii").lower()
        name.encode("ascii").decode("idna")  # an xn-- label must be valid punycode
    except UnicodeError as exc:
        raise BadHost(f"{text!r} is no host name ({exc})") from None
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise BadHost(f"{text!r} is no host name: labels of letters, digits, '-' and '_', "
                      "1 to 63 each, 253 bytes in all")
    if labels[-1].isdigit():
        raise BadHost(f"{text!r} is no host name: its last label is a number")
    return name


def _ipv6(inner: str, text: str) -> IPAddress:
    try:
        return ipaddress.IPv6Address(inner)
    except ValueError:
        raise BadHost(f"{text!r} is no host name or IPv6 address") from None


def parse_port(text: str, what: str) -> int:
    """A TCP port written in decimal, 1 to 65535."""
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise BadHost(f"{what}: port {text!r} is not a number from 1 to 65535")
    return int(text)


def split_authority(text: str, default_port: int | None) -> tuple[str | IPAddress, int]:
    """`host:port`, `[v6]:port`, or a host alone when default_port is given."""
    if text.startswith("["):
        close = text.find("]")
        host, rest = text[:close + 1], text[close + 1:]
        if close < 0 or (rest and not rest.startswith(":")):
            raise BadHost(f"{text!r}: an IPv6 authority is [ADDRESS] or [ADDRESS]:PORT")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise BadHost(f"{text!r}: write an IPv6 address in brackets, [ADDRESS]:PORT")
    else:
        host, port_text = text, None
    if port_text is None:
        if default_port is None:
            raise BadHost(f"{text!r} names no port: write HOST:PORT")
        return normalise_host(host), default_port
    return normalise_host(host), parse_port(port_text, text)


def show(host: str | IPAddress, port: int) -> str:
    """host:port as a record and a message write it ([v6]:port for IPv6)."""
    if isinstance(host, ipaddress.IPv6Address):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def host_header(host: str | IPAddress, port: int, default_port: int) -> str:
    """The Host header for host:port, without the port when it is the scheme's default."""
    text = show(host, port)
    return text.rsplit(":", 1)[0] if port == default_port else text
