#!/usr/bin/env python3
"""What the egress ip mode adds to a sandbox's start, and where that time goes (root).

    sudo .venv/bin/python scripts/bench_egress_ip.py [--cycles 100] [--json FILE]

create + exec(["true"]) + destroy with network "none" against an ip-mode policy of two
addresses (interleaved, medians of --cycles after 3 warm-up rounds each), and the
median of each step of the ip mode's start and teardown (karotte/egress/ip.py): the
veth (create, alias, address, up, forwarding), the inside (a netlink socket opened in
the sandbox's namespace by a short thread, IPRoute on its fd: address, up, route), the
nftables table (one libnftables transaction), and close (delete the table and the veth).
No packet is sent: the addresses are never reached.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

from karotte.egress import ip, parse_policy
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

STEPS = {"veth": (ip.IpLink, "_make_veth"), "inside": (ip.IpLink, "_configure_inside"),
         "nft_load": (ip, "_nft"), "close": (ip.IpLink, "close")}


def _timed(steps: dict[str, list[float]], label: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            steps[label].append((time.perf_counter() - t) * 1000)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    why = ip.unavailable()
    if why:
        print(f"bench_egress_ip: {why}", file=sys.stderr)
        return 2
    steps: dict[str, list[float]] = {label: [] for label in STEPS}
    for label, (owner, name) in STEPS.items():
        fn = getattr(owner, name)
        if isinstance(owner, type) and name == "_make_veth":
            fn = fn.__func__
            setattr(owner, name, classmethod(_timed(steps, label, fn)))
        else:
            setattr(owner, name, _timed(steps, label, fn))
    specs = {"none": SandboxSpec(),
             "ip": SandboxSpec(network=parse_policy(["10.214.99.2:5432", "10.214.99.3:22"],
                                                    mode="ip"))}
    times: dict[str, list[float]] = {label: [] for label in specs}
    for i in range(args.cycles + 3):
        for label, spec in specs.items():
            if i < 3:
                for v in steps.values():
                    v.clear()
            t = time.perf_counter()
            with Sandbox(spec) as sb:
                sb.exec(["true"])
            if i >= 3:
                times[label].append((time.perf_counter() - t) * 1000)
    # _nft runs for the load and for the delete in close(): the load is every other one
    steps["nft_load"] = steps["nft_load"][0::2]
    result = {"cycles": args.cycles,
              "sandbox_ms": {k: statistics.median(v) for k, v in times.items()},
              "ip_steps_ms": {k: statistics.median(v) for k, v in steps.items()}}
    result["added_ms"] = result["sandbox_ms"]["ip"] - result["sandbox_ms"]["none"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
