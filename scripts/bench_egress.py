#!/usr/bin/env python3
"""The egress proxy beside a direct connection, and where the proxy should run.

    scripts/bench_egress.py [--megabytes 200] [--rounds 5] [--requests 2000] [--cycles 200]
                            [--cases download,latency,sandbox] [--json FILE]

All traffic is on loopback: a file server in a process of its own on the host's
127.0.0.1, curl and Python clients, and the proxy (karotte.egress.EgressProxy) in one of
two places:

- thread: EgressProxy, a thread with its own event loop in this process (net.py's default);
- process: EgressProcess, the same proxy in a child process of its own;
- floor (download only): a transparent relay of two threads that only move bytes, by
  splice(2) or by a copy through a buffer: what any relay costs here.

Each is measured with this process idle, and with a "trainer" thread busy in pure Python
beside it (the GIL is what a trainer's own load could take from the proxy's thread).

Cases: download (curl, --megabytes through each path, --rounds rounds of all paths one
after another, so that the host's other load hits them alike: direct is curl on the host,
each other path curl inside a sandbox of the proxy mode whose listener that path serves,
as an agent downloads; each timed by curl's own clock; the median of each path and the
median of the rounds' ratios to direct; and the proxy thread's own CPU seconds per GB,
which the host's load moves least), latency (sequential small GETs on one kept-alive
connection, per-request medians, by a client on the host through a listener on the
host's loopback), sandbox (create + exec + destroy, network "none" and a proxy policy one
after the other, --cycles of each: the medians, and the median of the cycles' paired
differences).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import http.server
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import benchlib  # noqa: F401 - before karotte: it puts this checkout's karotte on sys.path
from karotte import net
from karotte.egress import (EgressLimits, EgressProcess, EgressProxy, parse_policy,
                            static_resolver)
from karotte.egress.record import Log
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

UNLIMITED = EgressLimits(bytes_per_second=None, max_bytes=None)
NAME = "files.test"


class _Files(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a head and a body in two writes: no delayed ACK

    def log_message(self, *args):
        pass

    def do_GET(self):  # /N: N bytes
        size = int(self.path.strip("/") or 0)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        block = bytes(1 << 20)
        while size:
            n = min(size, len(block))
            self.wfile.write(block[:n])
            size -= n


def serve_files() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    print(server.server_address[1], flush=True)
    server.serve_forever()


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _child(*args: str) -> tuple[subprocess.Popen, int]:
    child = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    return child, int(child.stdout.readline())


class Busy:
    """A trainer thread that computes in pure Python, holding the GIL as it may."""

    def __init__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        x = 0
        while not self.stop.is_set():
            for i in range(10000):
                x += i * i

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def download(proxy: str | None, port: int, megabytes: int, sandbox=None) -> float:
    """MB/s of curl fetching megabytes from port (the server's, or the floor relay's), by
    curl's own clock: on the host (direct), or inside sandbox (the agent's side)."""
    url = f"http://{NAME if proxy else '127.0.0.1'}:{port}/{megabytes * 10**6}"
    argv = ["curl", "-fsS", "-o", "/dev/null", "-w", "%{time_total}",
            *(["-x", proxy] if proxy else []), url]
    if sandbox is None:
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    else:
        result = sandbox.exec(argv, timeout=60)
        if result.exit_code != 0:
            raise RuntimeError(f"curl in the sandbox: {result.stderr.decode()!r}")
        out = result.stdout.decode()
    return megabytes / float(out)


class Floor:
    """What any relay costs here: a transparent one, to the server, of two blocking
    threads a connection doing nothing but move bytes (no event loop, no check, no meter),
    by splice(2) through a pipe or by a copy through a buffer. The proxy cannot beat the
    better of the two; what it adds to it is the proxy's own. It serves a sandbox's forward
    proxy listener as EgressProxy would (net.use_egress_proxy), so that curl inside reaches
    it as the agent reaches the proxy. Its threads are this process's, so a busy trainer's
    GIL slows it as it does the thread."""

    def __init__(self, port: int, how: str):
        self.port, self.pid = port, os.getpid()
        self._pump = {"splice": self._splice, "copy": self._copy}[how]
        self._listeners: list[socket.socket] = []
        self._log = Log()

    def serve(self, policy, proxy: socket.socket, upstreams=None) -> Floor:
        self._listeners.append(proxy)
        threading.Thread(target=self._accept, args=(proxy,), daemon=True).start()
        return self

    # what the sandbox asks of the session it was served by: a record with nothing in it
    def mark(self):
        return self._log.mark()

    def since(self, mark, limit):
        return self._log.since(mark, limit)

    def close(self, wait: bool = False) -> None:
        for listener in self._listeners:
            listener.close()

    def _accept(self, listener: socket.socket):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _splice(a: socket.socket, b: socket.socket):
        r, w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        try:
            while n := os.splice(a.fileno(), w, 1 << 20):
                while n:
                    n -= os.splice(r, b.fileno(), n)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            os.close(r)
            os.close(w)

    @staticmethod
    def _copy(a: socket.socket, b: socket.socket):
        buf = bytearray(1 << 20)
        try:
            with memoryview(buf) as view:
                while n := a.recv_into(buf):
                    b.sendall(view[:n])
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def loop_cpu(proxy: EgressProxy) -> float:
    """CPU seconds the proxy's thread has used (its loop asked)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    proxy.loop.call_soon_threadsafe(lambda: done.set_result(time.thread_time()))
    return done.result()


def downloads(sandboxes: dict, port: int, megabytes: int, rounds: int,
              thread_proxy: EgressProxy) -> tuple[dict[str, list[float]], float]:
    """Each path's MB/s per round, the paths interleaved (direct on the host, the others
    by curl inside each path's sandbox); and the thread proxy's CPU seconds per GB
    relayed."""
    out: dict[str, list[float]] = {"direct": [], **{where: [] for where in sandboxes}}
    cpu = 0.0
    for _ in range(rounds):
        out["direct"].append(download(None, port, megabytes))
        for where, sb in sandboxes.items():
            floor = where.startswith("floor")
            proxy = None if floor else f"http://127.0.0.1:{net.PROXY_PORT}"
            before = loop_cpu(thread_proxy)
            out[where].append(download(proxy, net.PROXY_PORT if floor else port,
                                       megabytes, sb))
            if where == "thread":
                cpu += loop_cpu(thread_proxy) - before
    return out, cpu / (rounds * megabytes / 1000)


def path_sandboxes(stack: contextlib.ExitStack, serving: dict, port: int) -> dict:
    """A sandbox of the proxy mode for each path, its listeners served by that path's
    proxy (or floor): the agent's side of a download."""
    policy = parse_policy([f"{NAME}:{port}", f"127.0.0.1:{port}"], limits=UNLIMITED)
    sandboxes = {}
    for where, proxy in serving.items():
        old = net.use_egress_proxy(proxy)
        try:
            sandboxes[where] = stack.enter_context(Sandbox(SandboxSpec(network=policy)))
        finally:
            net.use_egress_proxy(old)
    return sandboxes


def latency(proxy_port: int | None, port: int, requests: int) -> float:
    """Median ms per small GET on one kept-alive connection, measured by a client in a
    process of its own (one in this process would share the busy trainer's GIL)."""
    child = subprocess.run([sys.executable, __file__, "--latency-client",
                            f"{proxy_port or 0},{port},{requests}"],
                           capture_output=True, text=True, check=True)
    return float(child.stdout)


def latency_client(proxy_port: int | None, port: int, requests: int) -> float:
    sock = socket.create_connection(("127.0.0.1", proxy_port or port))
    target = f"http://{NAME}:{port}/16" if proxy_port else "/16"
    request = f"GET {target} HTTP/1.1\r\nHost: {NAME}:{port}\r\n\r\n".encode()
    times = []
    buffer = b""
    for _ in range(requests):
        t = time.perf_counter()
        sock.sendall(request)
        while b"\r\n\r\n" not in buffer or len(buffer.split(b"\r\n\r\n", 1)[1]) < 16:
            buffer += sock.recv(65536)
        buffer = buffer.split(b"\r\n\r\n", 1)[1][16:]
        times.append((time.perf_counter() - t) * 1000)
    sock.close()
    return statistics.median(times)


def sandbox_cycles(cycles: int, port: int) -> dict[str, float]:
    net.use_egress_proxy(EgressProxy(static_resolver({NAME: ["127.0.0.1"]})))
    specs = {"none": SandboxSpec(),
             "proxy": SandboxSpec(network=parse_policy([f"{NAME}:{port}",
                                                       f"127.0.0.1:{port}"]))}
    times: dict[str, list[float]] = {label: [] for label in specs}
    for i in range(cycles + 3):  # interleaved, so that the host's other load hits both
        for label, spec in specs.items():
            t = time.perf_counter()
            with Sandbox(spec) as sb:
                sb.exec(["true"])
            if i >= 3:  # the first ones warm the cgroup pool and the plan cache
                times[label].append((time.perf_counter() - t) * 1000)
    out = {label: statistics.median(v) for label, v in times.items()}
    out["proxy - none, paired"] = statistics.median(
        p - n for p, n in zip(times["proxy"], times["none"]))
    return out


CASES = ("download", "latency", "sandbox")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megabytes", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma-separated, of " + ", ".join(CASES))
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--serve-files", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--latency-client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.latency_client:
        proxy_port, port, requests = map(int, args.latency_client.split(","))
        print(latency_client(proxy_port or None, port, requests))
        return 0
    if args.serve_files:
        serve_files()
        return 0
    cases = set(args.cases.split(","))
    if cases - set(CASES):
        ap.error(f"unknown cases {sorted(cases - set(CASES))}: of {', '.join(CASES)}")
    files, port = _child("--serve-files")
    thread_proxy = EgressProxy(static_resolver({NAME: ["127.0.0.1"]}))
    sock = _listener()
    thread_proxy.serve(parse_policy([f"{NAME}:{port}", f"127.0.0.1:{port}"], limits=UNLIMITED),
                       proxy=sock)
    thread_port = sock.getsockname()[1]
    process = EgressProcess({NAME: ["127.0.0.1"]})
    sock = _listener()
    process_port = sock.getsockname()[1]
    process.serve(parse_policy([f"{NAME}:{port}", f"127.0.0.1:{port}"], limits=UNLIMITED),
                  proxy=sock)
    floors = {f"floor, {how}": Floor(port, how) for how in ("splice", "copy")}
    latency_ports = {"direct": None, "thread": thread_port, "process": process_port}
    rows: dict[str, dict] = {}
    goals: dict[str, float] = {}
    result: dict = {"machine": benchlib.machine_line(benchlib.machine()), "paths": rows}
    try:
        with contextlib.ExitStack() as sandboxes_open:
            sandboxes = path_sandboxes(sandboxes_open, {
                **floors, "thread": thread_proxy, "process": process}, port) \
                if "download" in cases else {}
            for load in ("idle", "busy trainer"):
                with contextlib.ExitStack() as stack:
                    if load != "idle":
                        stack.enter_context(Busy())
                    if "download" in cases:
                        mbs, cpu = downloads(sandboxes, port, args.megabytes, args.rounds,
                                             thread_proxy)
                        if load == "idle":
                            result["thread proxy CPU s/GB"] = round(cpu, 3)
                    for where in ["direct", *sandboxes] if sandboxes else latency_ports:
                        row = rows.setdefault(f"{where}, {load}", {})
                        if "download" in cases:
                            row["MB/s"] = round(statistics.median(mbs[where]))
                            if where != "direct":
                                row["of direct, median of rounds"] = round(statistics.median(
                                    t / d for t, d in zip(mbs[where], mbs["direct"])), 3)
                            if where in ("thread", "process"):
                                row["of floor (copy), median of rounds"] = round(
                                    statistics.median(t / f for t, f in zip(
                                        mbs[where], mbs["floor, copy"])), 3)
                        if "latency" in cases and where in latency_ports:
                            row["ms/request"] = round(
                                latency(latency_ports[where], port, args.requests), 3)
                        print(f"{where:14} {load:13} {row}", file=sys.stderr, flush=True)
        if "sandbox" in cases:
            result["sandbox_ms"] = cycles = sandbox_cycles(args.cycles, port)
            goals["create+exec+destroy with the proxy < 0.5 ms more (paired median)"] = \
                cycles["proxy - none, paired"]
    finally:
        process.close()
        for floor in floors.values():
            floor.close()
        files.kill()
        files.wait()
        thread_proxy.close()
    thread, direct = rows.get("thread, idle", {}), rows.get("direct, idle", {})
    if "download" in cases:
        goals["throughput through the thread >= 50% of direct (median of rounds)"] = \
            thread["of direct, median of rounds"]
    if "latency" in cases:
        goals["added latency per request < 1 ms (median)"] = round(
            thread["ms/request"] - direct["ms/request"], 3)
    result["goals"] = goals
    benchlib.print_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
