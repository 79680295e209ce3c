#!/usr/bin/env python3
"""What the record of each exec costs: exec(["true"]) in a sandbox with a proxy policy,
its ExecResult.egress made (the sandbox's session) against not made (no session), the
two interleaved so that the host's other load hits both.

    scripts/bench_egress_record.py [--execs 300]

Four cases: the thread proxy and EgressProcess, each with an empty log and with a full
one (1000 refused requests first: the proxy's cap). Prints the medians in ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

from karotte import net
from karotte.egress import EgressProcess, parse_policy
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

FILL = ("import socket\nfor i in range(1000):\n"
        "    s = socket.create_connection(('127.0.0.1', 3128))\n"
        "    s.sendall(b'GET http://y.test/ HTTP/1.1\\r\\nHost: y.test\\r\\n"
        "Connection: close\\r\\n\\r\\n')\n"
        "    while s.recv(65536): pass\n")


def case(execs: int, full: bool) -> tuple[float, float]:
    with Sandbox(SandboxSpec(network=parse_policy(["x.test"]))) as sb:
        if full:
            sb.exec(["python3", "-c", FILL], timeout=120)
        core, session = sb._core, sb._core.egress
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(execs):
            for recorded in (True, False):
                core.egress = session if recorded else None  # None: end_exec makes none
                t = time.perf_counter()
                sb.exec(["true"])
                times[recorded].append((time.perf_counter() - t) * 1000)
        core.egress = session
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--execs", type=int, default=300)
    args = ap.parse_args()
    for where in ("thread", "process"):
        proxy = EgressProcess() if where == "process" else None
        old = net.use_egress_proxy(proxy) if proxy else None
        try:
            for full in (False, True):
                recorded, bare = case(args.execs, full)
                print(f"{where:8} {'full' if full else 'empty'} log: {recorded:.3f} ms recorded, "
                      f"{bare:.3f} ms not, {recorded - bare:+.3f} ms")
        finally:
            if proxy:
                net.use_egress_proxy(old)
                proxy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
