#!/usr/bin/env python3
"""What the egress ip mode adds to a sandbox's start, and where that time goes (root).

    sudo .venv/bin/python scripts/bench_egress_ip.py [--cycles 100] [--json FILE]

create + exec(["true"]) + destroy with network "none" against an ip-mode policy of two
addresses, with its default EgressLimits (all three limits in the rules) and with only
the one that cannot be turned off (max_connections: bytes_per_second and max_bytes None),
interleaved, medians of --cycles after 3 warm-up rounds each; and the
median of each step of the ip mode's start and teardown (karotte/egress/ip.py): the
veth (create, alias, address, up, forwarding), the inside (a netlink socket opened in
the sandbox's namespace by a short thread, IPRoute on its fd: address, up, route), the
check that replies can come back (route lookups, when the host does not forward on every
interface), the nftables table (one libnftables transaction), record (one listing of the
table, which each exec does twice for ExecResult.egress_ip and close once), close (the
last record and the delete of the table), and open (all of the start, the name
resolution included).
The listed addresses are in a namespace this script makes (10.214.99.0/24, behind a veth
that forwards, as a real uplink would), removed at the end; no packet is sent to them.
"""
from __future__ import annotations

import argparse
import functools
import contextlib
import statistics
import subprocess
import sys
import time

import benchlib  # before karotte: it puts this checkout's karotte on sys.path
from karotte.egress import EgressLimits, ip, parse_policy
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

STEPS = {"open": (ip.IpLink, "open"), "veth": (ip.IpLink, "_make_veth"),
         "replies": (ip.IpLink, "_check_replies_come_back"),
         "inside": (ip.IpLink, "_configure_inside"), "nft_load": (ip, "_nft"),
         "record": (ip.IpLink, "record"), "close": (ip.IpLink, "close")}


def _timed(steps: dict[str, list[float]], label: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            # _nft also lists and deletes: only the load of a table is the nft_load step
            if label != "nft_load" or args[0].lstrip().startswith("table"):
                steps[label].append((time.perf_counter() - t) * 1000)
    return run


@contextlib.contextmanager
def peer_namespace():
    ns, dev = "karotte-bench-ip", "kbenchip0"
    run = functools.partial(subprocess.run, check=True, capture_output=True)
    run(["ip", "netns", "add", ns])
    try:
        run(["ip", "link", "add", dev, "type", "veth", "peer", "name", "p0", "netns", ns])
        run(["ip", "addr", "add", "10.214.99.1/24", "dev", dev])
        run(["ip", "link", "set", dev, "up"])
        with open(f"/proc/sys/net/ipv4/conf/{dev}/forwarding", "w") as f:
            f.write("1")
        yield
    finally:
        subprocess.run(["ip", "link", "del", dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--pause", type=float, default=0.0, metavar="S",
                    help="sleep S seconds after each cycle (lets the kernel free the last "
                         "namespace before the next start)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    why = ip.unavailable()
    if why:
        print(f"bench_egress_ip: {why}", file=sys.stderr)
        return 2
    steps: dict[str, list[float]] = {label: [] for label in STEPS}
    for label, (owner, name) in STEPS.items():
        fn = getattr(owner, name)
        if isinstance(owner, type) and name in ("open", "_make_veth"):
            fn = fn.__func__
            setattr(owner, name, classmethod(_timed(steps, label, fn)))
        else:
            setattr(owner, name, _timed(steps, label, fn))
    allow = ["10.214.99.2:5432", "10.214.99.3:22"]
    fewest = EgressLimits(bytes_per_second=None, max_bytes=None)
    specs = {"none": SandboxSpec(),
             "ip": SandboxSpec(network=parse_policy(allow, mode="ip")),
             "ip_fewest_limits": SandboxSpec(network=parse_policy(allow, mode="ip",
                                                                  limits=fewest))}
    times: dict[str, list[float]] = {label: [] for label in specs}
    with peer_namespace():
        for i in range(args.cycles + 3):  # interleaved, so the host's other load hits both
            for label, spec in specs.items():
                if i < 3:  # the first ones warm the cgroup pool, the plan cache, pyroute2
                    for v in steps.values():
                        v.clear()
                t = time.perf_counter()
                with Sandbox(spec) as sb:
                    sb.exec(["true"])
                if i >= 3:
                    times[label].append((time.perf_counter() - t) * 1000)
                time.sleep(args.pause)
    return report(args, steps, times)


def report(args, steps, times) -> int:
    result = {"cycles": args.cycles, "pause_s": args.pause,
              "sandbox_ms": {k: statistics.median(v) for k, v in times.items()},
              "ip_steps_ms": {k: statistics.median(v) for k, v in steps.items()}}
    result["added_ms"] = {k: v - result["sandbox_ms"]["none"]
                          for k, v in result["sandbox_ms"].items() if k != "none"}
    benchlib.print_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
