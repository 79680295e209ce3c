"""The proxy's relay once a request or tunnel is checked: long bodies and tunnels move
socket to socket past the streams, through a buffer of the proxy thread's
(karotte/egress/proxy.py, _Relay), and must arrive exactly as sent, in order, metered,
with a buffer held only while bytes are on their way; and a sandbox's listeners are
served without a round trip to the proxy's loop (karotte/egress/server.py), each by its
own session only."""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import select
import socket
import threading
import time

from egress_servers import Gateway, file_server
from karotte.egress import EgressLimits
from karotte.egress import proxy as relay
from karotte.egress.proxy import BUFFER
from test_egress_attacks import connect, curl, read_all, read_response
from test_egress_policy import client_hello

NAMES = {"files.test": ["127.0.0.1"]}
SIZE = 3_000_000  # well past RELAY_AT_LEAST, several buffers' worth


@contextlib.contextmanager
def serving(listener, handle):
    """listener's port, each connection it takes handled by handle(conn) on a thread of its
    own, until the block ends: then the listener and every connection are shut down and
    their threads joined, so that no fd of this process closes later, under another test
    (test_lifecycle's fd counts)."""
    taken: list[tuple[socket.socket, threading.Thread]] = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=handle, args=(conn,), daemon=True)
            taken.append((conn, thread))
            thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield listener.getsockname()[1]
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        acceptor.join(10)
        listener.close()
        for conn, thread in taken:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            thread.join(10)


@contextlib.contextmanager
def echo_server():
    """A TCP server on 127.0.0.1 that sends back every byte it gets, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def echo(conn):
        with conn, contextlib.suppress(OSError):  # a test's proxy may cut it
            conn.settimeout(None)  # whatever socket.setdefaulttimeout() a test set
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    with serving(listener, echo) as port:
        yield port


@contextlib.contextmanager
def one_write_server(body):
    """An HTTP server on 127.0.0.1 that answers each request with body, its head and body
    in one write: the proxy's stream has read part of the body with the head."""
    listener = socket.create_server(("127.0.0.1", 0))
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    def serve(conn):
        with conn:
            request = b""
            while True:
                while b"\r\n\r\n" not in request:
                    if not (chunk := conn.recv(65536)):
                        return
                    request += chunk
                request = request.partition(b"\r\n\r\n")[2]
                conn.sendall(answer)

    with serving(listener, serve) as port:
        yield port


def data(tmp_path):
    body = os.urandom(SIZE)
    (tmp_path / "random.bin").write_bytes(body)
    return body


def test_a_long_body_arrives_whole_and_is_counted(tmp_path):
    body = data(tmp_path)
    with file_server(tmp_path, {}) as files, Gateway(NAMES) as gw:
        session, proxy, _ = gw.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
        out = tmp_path / "got.bin"
        done = curl(proxy, "-f", "-o", str(out), f"http://files.test:{files.port}/random.bin")
        assert done.returncode == 0, done.stderr
        assert out.read_bytes() == body
        (reach,) = session.record().reaches
        assert (reach.allowed, reach.reason) == (True, "ok")
        assert SIZE < reach.bytes_received < SIZE + 1000  # the body and its head


def test_a_body_begun_with_its_head_goes_on_in_order():
    body = os.urandom(SIZE)
    with one_write_server(body) as port, Gateway(NAMES) as gw:
        session, proxy, _ = gw.serve([f"files.test:{port}", f"127.0.0.1:{port}"])
        host = f"files.test:{port}"
        with connect(proxy) as sock:
            for _ in range(2):  # the second on the same connections, after a relayed one
                sock.sendall(f"GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n"
                             .encode())
                assert read_response(sock)[1] == body
        assert [r.reason for r in session.record().reaches] == ["ok"] * 2


def test_long_bodies_on_a_kept_alive_connection_keep_their_framing(tmp_path):
    body = data(tmp_path)
    with file_server(tmp_path, {"hello.txt": "hello\n"}) as files, Gateway(NAMES) as gw:
        session, proxy, _ = gw.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
        host = f"files.test:{files.port}"
        with connect(proxy) as sock:
            for path in ("/random.bin", "/random.bin", "/hello.txt"):
                sock.sendall(f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n\r\n"
                             .encode())
                head, got = read_response(sock)
                assert head.startswith(b"HTTP/1.1 200")
                assert got == (b"hello\n" if path == "/hello.txt" else body)
        assert [r.reason for r in session.record().reaches] == ["ok"] * 3


def test_a_long_upload_sent_with_its_head_arrives_whole(tmp_path):
    body = os.urandom(SIZE)
    with file_server(tmp_path, {}) as files, Gateway(NAMES) as gw:
        session, proxy, _ = gw.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
        host = f"files.test:{files.port}"
        with connect(proxy) as sock:  # head and body in one write, then a second request
            for _ in range(2):
                sock.sendall(f"POST http://{host}/sha HTTP/1.1\r\nHost: {host}\r\n"
                             f"Content-Length: {SIZE}\r\n\r\n".encode() + body)
                assert read_response(sock)[1] == hashlib.sha256(body).hexdigest().encode()
        reaches = session.record().reaches
        assert len(reaches) == 2 and all(SIZE < r.bytes_sent < SIZE + 1000 for r in reaches)


def connected(proxy, port):
    """A socket whose CONNECT to files.test:port was answered 200, and what came after
    the answer's head."""
    sock = connect(proxy)
    sock.sendall(f"CONNECT files.test:{port} HTTP/1.1\r\nHost: files.test:{port}\r\n\r\n"
                 .encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(4096)
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock, rest


def read_exactly(sock, n):
    """n bytes from sock; the tunnel must not be cut before."""
    got = b""
    while len(got) < n:
        assert (chunk := sock.recv(1 << 20)), "the tunnel was cut"
        got += chunk
    return got


def tunnel_through(proxy, port, payload):
    """CONNECT, a real ClientHello for the name, then payload; what comes back."""
    sock, rest = connected(proxy, port)
    with sock:
        sent = client_hello("files.test") + payload

        def write():
            with contextlib.suppress(OSError):  # the proxy may cut the tunnel first
                sock.sendall(sent)
                sock.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=write)
        writer.start()
        got = rest + read_all(sock)
        writer.join()
        return sent, got


def test_a_tunnel_carries_both_ways_in_order():
    payload = os.urandom(SIZE)
    with echo_server() as port, Gateway(NAMES) as gw:
        session, proxy, _ = gw.serve([f"files.test:{port}", f"127.0.0.1:{port}"])
        sent, got = tunnel_through(proxy, port, payload)
        assert got == sent
        (reach,) = session.record().reaches
        assert reach.allowed and reach.bytes_sent == reach.bytes_received == len(sent)


def test_EGRESS_FLOOD_01_a_tunnel_past_the_total_is_cut_and_counted_to_the_limit():
    with echo_server() as port, Gateway(NAMES) as gw:
        session, proxy, _ = gw.serve([f"files.test:{port}", f"127.0.0.1:{port}"],
                                     limits=EgressLimits(max_bytes=1_000_000,
                                                         bytes_per_second=None))
        sent, got = tunnel_through(proxy, port, os.urandom(SIZE))
        assert len(got) < 1_000_000 and sent.startswith(got)
        (reach,) = session.record().reaches
        assert (reach.allowed, reach.reason) == (True, "bytes_total")
        assert reach.bytes_sent + reach.bytes_received <= 1_000_000


def test_a_default_socket_timeout_of_the_process_does_not_make_the_relay_block():
    """The proxy's thread is in the trainer's process, where a library may have called
    socket.setdefaulttimeout(): the relay's own sockets must stay non-blocking, or each
    read with nothing to read would hold the loop for the timeout and then cut the
    connection (TimeoutError)."""
    payload = os.urandom(SIZE)
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(0.2)
    try:
        with echo_server() as port, Gateway(NAMES) as gw:
            _, proxy, _ = gw.serve([f"files.test:{port}", f"127.0.0.1:{port}"])
            with open_tunnel(proxy, port) as sock:
                sock.settimeout(10)
                time.sleep(0.5)  # the relay waits with nothing to read, past the timeout
                sock.sendall(payload)
                got = read_exactly(sock, len(client_hello("files.test")) + len(payload))
                assert got[-len(payload):] == payload
    finally:
        socket.setdefaulttimeout(old)


def buffers_held(gw) -> int:
    """How many relay buffers the proxy's thread holds now (asked on its loop)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    gw.proxy.loop.call_soon_threadsafe(lambda: done.set_result(relay._buffers.held))
    return done.result(10)


def until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


def open_tunnel(proxy, port):
    """A socket with a tunnel open to files.test:port, past its ClientHello."""
    sock, _ = connected(proxy, port)
    sock.sendall(client_hello("files.test"))
    return sock


def test_an_idle_tunnel_holds_no_buffer_and_a_stalled_one_holds_one():
    """Memory: a buffer is the relay's from a read to the end of its send. Open tunnels
    that carried bytes and wait hold none; a tunnel whose far end stops reading holds one
    (the read it cannot send yet), and gives it back when it is cut."""
    first = len(client_hello("files.test")) + 8 * BUFFER  # past what the stream reads ahead
    relaying, stalled = threading.Event(), threading.Event()

    def read_then_stall(conn):  # reads the first bytes (so the relay has taken over), no more
        with conn:
            conn.settimeout(None)
            got = 0
            while got < first and (chunk := conn.recv(1 << 20)):
                got += len(chunk)
            relaying.set()
            stalled.wait(30)

    with echo_server() as echo, serving(socket.create_server(("127.0.0.1", 0)),
                                        read_then_stall) as sink, Gateway(NAMES) as gw:
        _, proxy, _ = gw.serve([f"files.test:{p}" for p in (echo, sink)]
                               + [f"127.0.0.1:{p}" for p in (echo, sink)])
        idle = [open_tunnel(proxy, echo) for _ in range(8)]
        try:
            for sock in idle:  # hello's echo, then a megabyte there and back
                payload = os.urandom(1 << 20)
                sock.sendall(payload)
                read_exactly(sock, len(client_hello("files.test")) + len(payload))
            until(lambda: buffers_held(gw) == 0)
            with open_tunnel(proxy, sink) as sock:
                sock.sendall(bytes(8 * BUFFER))
                assert relaying.wait(10)
                sock.setblocking(False)
                sent = 0
                # until every buffer on the way is full: the socket takes nothing for 0.5 s
                while sent < 256 * BUFFER and select.select([], [sock], [], 0.5)[1]:
                    with contextlib.suppress(BlockingIOError):
                        sent += sock.send(bytes(BUFFER))
                assert sent < 256 * BUFFER, "the stalled sink took it all"
                until(lambda: buffers_held(gw) == 1)
            stalled.set()
            until(lambda: buffers_held(gw) == 0)
        finally:
            relaying.set()
            stalled.set()
            for sock in idle:
                sock.close()


def test_a_listener_closed_and_its_number_reused_serves_only_the_new_session(tmp_path):
    with file_server(tmp_path, {"hello.txt": "hello\n"}) as files, Gateway(NAMES) as gw:
        allow = [f"files.test:{files.port}", f"127.0.0.1:{files.port}"]
        old, old_proxy, _ = gw.serve(allow)
        old_fd = int(old._servers[0].fileno())
        old.close()
        new, new_proxy, _ = gw.serve(allow)
        assert new._servers[0].fileno() == old_fd  # the number the old listener had
        assert curl(new_proxy, "-f", f"http://files.test:{files.port}/hello.txt"
                    ).stdout == "hello\n"
        assert old.record().reaches == () and len(new.record().reaches) == 1
        assert curl(old_proxy, f"http://files.test:{files.port}/hello.txt").returncode != 0


def test_a_forked_child_closing_its_copy_of_a_session_leaves_the_parent_served(tmp_path):
    with file_server(tmp_path, {"hello.txt": "hello\n"}) as files, Gateway(NAMES) as gw:
        session, proxy, _ = gw.serve([f"files.test:{files.port}", f"127.0.0.1:{files.port}"])
        pid = os.fork()
        if pid == 0:
            try:
                session.close()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert curl(proxy, "-f", f"http://files.test:{files.port}/hello.txt"
                    ).stdout == "hello\n"
