#!/usr/bin/env python3
"""The egress proxy beside a direct connection, and where the proxy should run.

    scripts/bench_egress.py [--megabytes 200] [--rounds 5] [--requests 2000] [--cycles 200]
                            [--cases download,latency,sandbox] [--json FILE]

All traffic is on 127.0.0.1: a file server in a process of its own, curl and Python
clients, and the proxy (karotte.egress.EgressProxy) in one of two places:

- thread: EgressProxy, a thread with its own event loop in this process (net.py's default);
- process: EgressProcess, the same proxy in a child process of its own;
- floor (download only): a transparent relay that only splices, what any relay costs here.

Each is measured with this process idle, and with a "trainer" thread busy in pure Python
beside it (the GIL is what a trainer's own load could take from the proxy's thread).

Cases: download (curl, --megabytes through each path, --rounds rounds of direct, thread
and process one after another, so that the host's other load hits all three alike: the
median of each path and the median of the rounds' ratios to direct; and the proxy
thread's own CPU seconds per GB, which the host's load moves least), latency (sequential
small GETs on one kept-alive connection, per-request medians), sandbox (create + exec +
destroy, network "none" and a proxy policy one after the other, --cycles of each: the
medians, and the median of the cycles' paired differences).
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
from karotte.egress import (EgressLimits, EgressProcess, EgressProxy, parse_policy,
                            static_resolver)

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


def download(proxy: str | None, port: int, megabytes: int) -> float:
    """MB/s of curl fetching megabytes from port (the server's, or the floor relay's)."""
    url = f"http://{NAME if proxy else '127.0.0.1'}:{port}/{megabytes * 10**6}"
    t = time.perf_counter()
    subprocess.run(["curl", "-fsS", "-o", "/dev/null", *(["-x", proxy] if proxy else []),
                    url], check=True)
    return megabytes / (time.perf_counter() - t)


class Floor:
    """What any relay costs here: a transparent one, to the server, of two blocking
    threads a connection doing nothing but splice(2) through a pipe (no event loop, no
    check, no meter). The proxy cannot beat it; what it adds to it is the proxy's own. Its
    threads are this process's, so a busy trainer's GIL slows it as it does the thread."""

    def __init__(self, port: int):
        self.port, self.listener = port, socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket):
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

    def close(self):
        self.listener.close()


def loop_cpu(proxy: EgressProxy) -> float:
    """CPU seconds the proxy's thread has used (its loop asked)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    proxy.loop.call_soon_threadsafe(lambda: done.set_result(time.thread_time()))
    return done.result()


def downloads(paths: dict[str, int | None], port: int, megabytes: int, rounds: int,
              thread_proxy: EgressProxy) -> tuple[dict[str, list[float]], float]:
    """Each path's MB/s per round, the paths interleaved; and the thread proxy's CPU
    seconds per GB relayed."""
    out: dict[str, list[float]] = {where: [] for where in paths}
    cpu = 0.0
    for _ in range(rounds):
        for where, pport in paths.items():
            proxy = f"http://127.0.0.1:{pport}" if pport and where != "floor" else None
            before = loop_cpu(thread_proxy)
            out[where].append(download(proxy, pport if where == "floor" else port,
                                       megabytes))
            if where == "thread":
                cpu += loop_cpu(thread_proxy) - before
    return out, cpu / (rounds * megabytes / 1000)


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
    from karotte import net
    from karotte.sandbox import Sandbox
    from karotte.spec import SandboxSpec
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
    floor = Floor(port)
    paths = {"direct": None, "floor": floor.listener.getsockname()[1], "thread": thread_port,
             "process": process_port}
    rows: dict[str, dict] = {}
    goals: dict[str, float] = {}
    result: dict = {"machine": benchlib.machine_line(benchlib.machine()), "paths": rows}
    try:
        for load in ("idle", "busy trainer"):
            with contextlib.ExitStack() as stack:
                if load != "idle":
                    stack.enter_context(Busy())
                if "download" in cases:
                    mbs, cpu = downloads(paths, port, args.megabytes, args.rounds,
                                         thread_proxy)
                    if load == "idle":
                        result["thread proxy CPU s/GB"] = round(cpu, 3)
                for where, pport in paths.items():
                    if where == "floor" and "download" not in cases:
                        continue
                    row = rows.setdefault(f"{where}, {load}", {})
                    if "download" in cases:
                        row["MB/s"] = round(statistics.median(mbs[where]))
                        if where != "direct":
                            row["of direct, median of rounds"] = round(statistics.median(
                                t / d for t, d in zip(mbs[where], mbs["direct"])), 3)
                        if where in ("thread", "process"):
                            row["of floor, median of rounds"] = round(statistics.median(
                                t / f for t, f in zip(mbs[where], mbs["floor"])), 3)
                    if "latency" in cases and where != "floor":
                        row["ms/request"] = round(latency(pport, port, args.requests), 3)
                    print(f"{where:8} {load:13} {row}", file=sys.stderr, flush=True)
        if "sandbox" in cases:
            result["sandbox_ms"] = cycles = sandbox_cycles(args.cycles, port)
            goals["create+exec+destroy with the proxy < 0.5 ms more (paired median)"] = \
                cycles["proxy - none, paired"]
    finally:
        process.close()
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
