"""The allow-list grammar, the one check and the ClientHello reader, on real inputs: the
ClientHellos are made by Python's TLS stack, the names resolved by a table the test holds."""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import ssl

import pytest

from karotte.egress import (EgressConfigError, EgressLimits, EgressRecord, Reach, check,
                            internal, parse_policy, static_resolver)
from karotte.egress.record import MAX_REACHES, Log
from karotte.egress.tls import NotClientHello, read_client_hello


def run(coro):
    return asyncio.run(coro)


class Table:
    """A resolver from a table that notes every name it was asked."""

    def __init__(self, hosts):
        self.asked = []
        self._resolve = static_resolver(hosts)

    async def __call__(self, name, port):
        self.asked.append(name)
        return await self._resolve(name, port)


# --- the grammar ------------------------------------------------------------------

def test_entries_parse_to_rules_with_default_ports():
    policy = parse_policy(["pypi.org", "Bücher.DE.:8443", "*.pythonhosted.org:*", "*",
                           "10.0.0.0/8:5432", "127.0.0.1:8080", "[::1]"])
    assert [(r.kind, r.value, r.ports) for r in policy.rules] == [
        ("name", "pypi.org", frozenset({80, 443})),
        ("name", "xn--bcher-kva.de", frozenset({8443})),
        ("suffix", "pythonhosted.org", None),
        ("any", "*", frozenset({80, 443})),
        ("network", "10.0.0.0/8", frozenset({5432})),
        ("network", "127.0.0.1/32", frozenset({8080})),
        ("network", "::1/128", frozenset({80, 443})),
    ]


@pytest.mark.parametrize("entry", [
    "ex ample.com", "*.*.example.com", "exa*mple.com", "example.com:99999", "example.com:x",
    "fe80::1:443", "10.0.0.1/8", "a..b", "-a.example.com", "example.123", "", "[::1", "*.10.0.0.1",
    "http://example.com", "user@example.com",
])
def test_a_bad_entry_is_refused_with_the_entry_and_the_grammar(entry):
    with pytest.raises(EgressConfigError) as info:
        parse_policy([entry])
    assert repr(entry) in str(info.value) and "*.SUFFIX" in str(info.value)


def test_a_string_in_place_of_a_list_is_refused_with_the_fix():
    with pytest.raises(EgressConfigError, match=r"write \['pypi.org'\]"):
        parse_policy("pypi.org")


def test_an_upstream_keeps_its_credentials_out_of_its_repr_and_its_url():
    policy = parse_policy(upstreams={"model": {"url": "https://API.example.com/v1/",
                                               "headers": {"Authorization": "Bearer sk-1"}}})
    (up,) = policy.upstreams
    assert (up.name, up.scheme, up.host, up.port, up.path) == (
        "model", "https", "api.example.com", 443, "/v1")
    assert "sk-1" not in repr(policy)
    with pytest.raises(EgressConfigError, match="credentials go in headers="):
        parse_policy(upstreams={"model": "https://user:sk-1@api.example.com"})
    with pytest.raises(EgressConfigError, match="lowercase identifier"):
        parse_policy(upstreams={"Model!": "https://api.example.com"})
    with pytest.raises(EgressConfigError, match="without CR, LF or NUL"):
        parse_policy(upstreams={"model": {"url": "https://a.example",
                                          "headers": {"X": "a\r\nB: c"}}})


@pytest.mark.parametrize("field,value", [("max_connections", 0), ("max_connections", None),
                                         ("bytes_per_second", -1), ("max_bytes", 1.5),
                                         ("idle_timeout", float("inf"))])
def test_a_bad_limit_is_refused_naming_the_field(field, value):
    with pytest.raises(EgressConfigError, match=f"EgressLimits.{field}"):
        EgressLimits(**{field: value})


# --- the check --------------------------------------------------------------------

def test_EGRESS_DNS_01_a_name_that_is_not_allowed_is_never_resolved():
    table = Table({"secret-4f2a.evil.test": ["93.184.216.34"]})
    verdict = run(check(parse_policy(["pypi.org"]), "secret-4f2a.evil.test", 443, table))
    assert (verdict.allowed, verdict.reason) == (False, "not_allowed")
    assert table.asked == []


def test_a_name_matches_in_its_one_form_and_on_its_ports_only():
    table = Table({"xn--bcher-kva.de": ["93.184.216.34"],
                   "files.pythonhosted.org": ["151.101.0.223"],
                   "pythonhosted.org": ["151.101.0.223"]})
    policy = parse_policy(["bücher.de", "*.pythonhosted.org"])
    assert run(check(policy, "BÜCHER.de.", 443, table)).allowed
    assert run(check(policy, "xn--bcher-kva.DE", 80, table)).addresses == ("93.184.216.34",)
    assert run(check(policy, "bücher.de", 8080, table)).reason == "not_allowed"
    assert run(check(policy, "files.pythonhosted.org", 443, table)).allowed
    assert run(check(policy, "pythonhosted.org", 443, table)).reason == "not_allowed"
    assert run(check(policy, "evilpythonhosted.org", 443, table)).reason == "not_allowed"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1", "0x7f000001", "2130706433", "0177.0.0.1",
                                  "::1", "[::ffff:127.0.0.1]", "93.184.216.34"])
def test_EGRESS_IPLIT_01_an_address_in_any_spelling_needs_its_own_entry(host):
    table = Table({})
    verdict = run(check(parse_policy(["*"]), host, 80, table))
    assert (verdict.allowed, verdict.reason, table.asked) == (False, "ip_literal", [])


def test_a_listed_address_is_reachable_as_a_literal_on_its_port():
    policy = parse_policy(["127.0.0.1:8080", "[::1]:*"])
    assert run(check(policy, "127.1", 8080, Table({}))).addresses == ("127.0.0.1",)
    assert run(check(policy, "127.0.0.1", 8081, Table({}))).reason == "ip_literal"
    assert run(check(policy, "[::1]", 22, Table({}))).allowed


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1",
                                     "169.254.169.254", "100.100.100.200", "0.0.0.0", "::1",
                                     "fe80::1", "fd00:ec2::254", "::ffff:10.0.0.1",
                                     "64:ff9b::a9fe:a9fe", "224.0.0.1"])
def test_EGRESS_REBIND_01_an_allowed_name_that_resolves_inside_is_refused(address):
    table = Table({"api.example.com": ["93.184.216.34", address]})
    verdict = run(check(parse_policy(["api.example.com"]), "api.example.com", 443, table))
    assert (verdict.allowed, verdict.reason) == (False, "internal_address")
    assert str(ipaddress.ip_address(address)) in verdict.detail
    assert internal(ipaddress.ip_address(address))


def test_an_internal_address_the_list_names_is_reachable_through_an_allowed_name():
    table = Table({"pypi.test": ["127.0.0.1"]})
    policy = parse_policy(["pypi.test:3141", "127.0.0.0/8:3141"])
    assert run(check(policy, "pypi.test", 3141, table)).addresses == ("127.0.0.1",)
    assert not internal(ipaddress.ip_address("93.184.216.34"))


def test_a_name_that_does_not_resolve_is_refused_as_such():
    verdict = run(check(parse_policy(["gone.test"]), "gone.test", 80, Table({})))
    assert (verdict.allowed, verdict.reason) == (False, "resolve_failed")


# --- the ClientHello --------------------------------------------------------------

def client_hello(server_hostname):
    """The first flight of Python's TLS client, as it would go on the wire."""
    context = ssl.create_default_context()
    if server_hostname is None:
        context.check_hostname = False
    tls = context.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(),
                           server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def read_hello(data):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_client_hello(reader)
    return run(go())


def test_the_server_name_of_a_real_client_hello_is_read():
    data = client_hello("Files.Test")
    raw, hello = read_hello(data + b"after")
    assert raw == data and hello.server_name == "Files.Test" and not hello.encrypted
    assert read_hello(client_hello(None))[1].server_name is None


def test_a_client_hello_split_over_two_records_is_read_whole():
    data = client_hello("files.test")
    body = data[5:]
    split = (data[:3] + len(body[:40]).to_bytes(2, "big") + body[:40]
             + data[:3] + len(body[40:]).to_bytes(2, "big") + body[40:])
    assert read_hello(split)[1].server_name == "files.test"


@pytest.mark.parametrize("data", [b"SSH-2.0-OpenSSH_9.2\r\n", b"GET / HTTP/1.1\r\n\r\n",
                                  b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00"])
def test_what_is_no_client_hello_is_refused(data):
    with pytest.raises((NotClientHello, asyncio.IncompleteReadError)):
        read_hello(data)


# --- the record -------------------------------------------------------------------

def test_the_record_is_frozen_bounded_and_plain_json():
    log = Log()
    for i in range(MAX_REACHES + 5):
        log.open("http", f"h{i}.test", 80).decide(False, "not_allowed")
    record = log.snapshot()
    assert isinstance(record, EgressRecord) and len(record.reaches) == MAX_REACHES
    assert record.dropped == 5 and len(record.refused) == MAX_REACHES
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.reaches[0].host = "x"
    assert record.to_dict()["reaches"][0] == dataclasses.asdict(
        Reach("http", "h0.test", 80, False, "not_allowed", 0, 0))


def with_extension(hello, kind, data):
    """A real ClientHello record with one more extension appended (lengths fixed up)."""
    body = bytearray(hello[9:])
    at = 34
    at += 1 + body[at]  # session id
    at += 2 + int.from_bytes(body[at:at + 2], "big")  # cipher suites
    at += 1 + body[at]  # compression methods
    extension = kind.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data
    body[at:at + 2] = (int.from_bytes(body[at:at + 2], "big") + len(extension)).to_bytes(2, "big")
    body += extension
    handshake = b"\x01" + len(body).to_bytes(3, "big") + bytes(body)
    return hello[:3] + len(handshake).to_bytes(2, "big") + handshake


def test_an_encrypted_client_hello_is_seen():
    hello = with_extension(client_hello("files.test"), 0xFE0D, b"\x00" * 32)
    assert read_hello(hello)[1].encrypted


def test_a_second_server_name_extension_is_refused():
    name = b"evil.test"
    sni = (len(name) + 3).to_bytes(2, "big") + b"\x00" + len(name).to_bytes(2, "big") + name
    with pytest.raises(NotClientHello, match="appears twice"):
        read_hello(with_extension(client_hello("files.test"), 0, sni))
