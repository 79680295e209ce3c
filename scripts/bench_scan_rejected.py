#!/usr/bin/env python3
"""What one rejected entry costs the custody scan: time, and memory held by the result.

    scripts/bench_scan_rejected.py [--entries N] [--kinds fifo,symlink,deep] [--runs R]

For each kind, an agent fills its workspace with N entries the scan must reject (FIFOs,
dangling symlinks with 200-byte names, or FIFOs 30 directories deep), the sandbox is
killed, and scan_and_copy walks it R times. Reported: microseconds per rejected entry
(median of the runs), the Python memory the walk allocated at its peak (tracemalloc, in
one more run, untimed),
and the violations the result holds. The sandbox's inode limit is raised to fit N.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc

import benchlib  # noqa: F401 - before karotte: it puts this checkout's karotte on sys.path
from karotte.sandbox import Sandbox
from karotte.scan import ScanLimits, scan_and_copy
from karotte.spec import MiB, SandboxSpec

PLANTS = {
    "fifo": "python3 -c 'import os\nfor i in range({n}): os.mkfifo(f\"f{{i:07d}}\")'",
    "symlink": "python3 -c 'import os\nfor i in range({n}): "
               "os.symlink(\"/nowhere\", f\"{{i:07d}}\" + \"l\" * 193)'",
    "deep": "python3 -c 'import os\nd = \"/\".join([\"d\" * 8] * 30)\nos.makedirs(d)\n"
            "for i in range({n}): os.mkfifo(f\"{{d}}/f{{i:07d}}\")'",
}


def measure(kind: str, entries: int, runs: int) -> dict:
    spec = SandboxSpec(inodes=entries + 1024, disk=256 * MiB, timeout=600)
    limits = ScanLimits(max_entries=entries + 1024, max_seconds=120)
    with Sandbox(spec) as sb:
        r = sb.exec(["/bin/sh", "-c", PLANTS[kind].format(n=entries)])
        if r.exit_code != 0:
            raise RuntimeError(f"planting {kind} failed: {r.stderr[-500:]!r}")
        sb.kill_all()
        times, peak, result = [], 0, None
        for run in range(runs + 1):  # the last run only for memory: tracemalloc slows it
            dest = tempfile.mkdtemp(prefix="karotte-bench-scan-", dir="/dev/shm")
            try:
                if run == runs:
                    tracemalloc.start()
                t = time.perf_counter()
                result = scan_and_copy(sb.workspace_fd, dest, limits)
                if run < runs:
                    times.append(time.perf_counter() - t)
                else:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
            finally:
                shutil.rmtree(dest)
    held = len(result.violations)
    dropped = getattr(result, "violations_dropped", 0)
    return {"kind": kind, "entries": entries, "seconds": statistics.median(times),
            "us_per_entry": statistics.median(times) / entries * 1e6,
            "peak_alloc_bytes": peak, "violations_held": held,
            "violations_dropped": dropped}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=50_000)
    parser.add_argument("--kinds", default="fifo,symlink,deep")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for kind in args.kinds.split(","):
        m = measure(kind, args.entries, args.runs)
        print(f"{kind:8} {m['entries']} entries: {m['seconds']:.2f} s, "
              f"{m['us_per_entry']:.1f} us per entry, peak {m['peak_alloc_bytes'] / MiB:.1f} MiB "
              f"allocated (tracemalloc), {m['violations_held']} violations held, "
              f"{m['violations_dropped']} counted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
