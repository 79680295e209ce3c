#!/usr/bin/env python3
"""Karotte's sandbox life cycle against its peers, measured side by side in one run.

    scripts/bench_sandbox.py [--quick] [--runs N] [--sandboxes N] [--parent-gib G]
                             [--cases a,b] [--json FILE]

Cases (each reports medians with p10/p90, and ratios):

  lifecycle   create + exec /bin/true + destroy: Karotte (defaults: cgroup limits and
              seccomp included) against bwrap with the same mounts and seccomp filter,
              runc with a bundle of the same read-only binds and the same cgroup limits,
              and `unshare -Urpfmn --mount-proc` (the floor: namespaces, no mounts of its
              own). Peers run as subprocesses of this driver; every competitor is timed
              by the same wall clock around one whole run, round-robin, so drift hits all.
              Karotte runs twice: back to back, and after 100 ms idle (sandboxes made now
              and then find kernel state cold that back-to-back runs keep warm).
  exec        one exec of /bin/true in a live sandbox, many times (sync and asyncio).
  big_parent  create + destroy and create + first exec while this process holds a few
              GiB resident, against the same process small (Karotte spawns with
              CLONE_VM, so the cost must not grow with the parent; an os.fork() control
              shows what a page-table copy would cost).
  density     idle sandboxes held open at once: host memory per sandbox, creation time
              as the count grows, then teardown and a check that nothing is left.
  phases      where the time of one create, first exec and destroy goes, back to back
              and after idle, from timers wrapped around Karotte's internal steps (the
              names are in scripts/benchlib.py: one that is gone or never called stops
              the benchmark with its name, never a phase that times nothing).

The peers are in bench_peers.py. A peer that is missing or fails on this host is
reported as skipped with the reason, never with a number. The benchmark needs what
Karotte needs (root, or unprivileged user namespaces with a delegated cgroup).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import mmap
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict
from typing import Callable

from benchlib import (SANDBOX_CGROUP_PHASES, SANDBOX_PHASES, Goal, PhaseTimer, Series,
                      Stats, fmt_ms, karotte_line, load_line, machine_line, meminfo,
                      render_cases_and_goals)
from benchlib import main as bench_main
from bench_peers import TRUE, Bwrap, Competitor, NoSandbox, PeerFailed, Runc, Unshare
from karotte import cgroups
from karotte.sandbox import AsyncSandbox, Sandbox
from karotte.spec import GiB, MiB, SandboxSpec

CASES = ("lifecycle", "exec", "big_parent", "density", "phases")

# The goals this benchmark reports on (ratios are Karotte / other).
GOAL_VS_BWRAP = 1.0  # lifecycle: faster than bwrap
GOAL_VS_FLOOR = 1.5  # lifecycle: within 1.5x of unshare
GOAL_EXEC_MS = 2.0  # exec: median under 2 ms
GOAL_BIG_PARENT = 1.2  # big_parent: within 1.2x of the small parent
GOAL_DENSITY = 500  # density: idle sandboxes held at once


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


# --------------------------------------------------------------------------- /proc

def _status_bytes(key: str, pid: int | str = "self") -> int:
    """A 'kB' field of /proc/<pid>/status (VmRSS, VmPTE, ...) in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _read_int(path: str) -> int:
    with open(path, encoding="ascii") as f:
        return int(f.read().split()[0])


# --------------------------------------------------------------------------- Karotte

class KarotteLifecycle(Competitor):
    """Sandbox(spec) + exec /bin/true + close, in this process (the defaults: the host's
    userland; bench_image_sandbox.py passes specs on an image)."""

    name = "karotte"
    describe = "Sandbox(SandboxSpec()) + exec /bin/true + close, in this process"

    def __init__(self, spec: SandboxSpec | None = None, name: str | None = None,
                 describe: str | None = None):
        self.spec = spec or SandboxSpec()
        self.name = name or self.name
        self.describe = describe or self.describe

    def run_once(self) -> int:
        t0 = time.perf_counter_ns()
        with Sandbox(self.spec) as sb:
            r = sb.exec([TRUE])
        t1 = time.perf_counter_ns()
        if r.exit_code != 0:
            raise RuntimeError(f"{self.name}: /bin/true ended with {r}")
        return t1 - t0


class KarotteAfterIdle(KarotteLifecycle):
    """The same run after a pause in which this driver creates nothing: a sandbox made
    now and then, not back to back. Kernel state that back-to-back runs keep warm
    (on cgroup v1, the lock a task migration takes) has gone cold by then."""

    name = "karotte, after 100 ms idle"
    describe = ("as karotte, each run preceded by an untimed 100 ms sleep (sandboxes "
                "created now and then rather than back to back)")
    IDLE_SECONDS = 0.1

    def run_once(self) -> int:
        time.sleep(self.IDLE_SECONDS)
        return super().run_once()


class KarotteNoPool(KarotteLifecycle):
    """The same run with the cgroup pool turned off: every sandbox makes its cgroup
    directories and removes them (what the first sandboxes of a process do)."""

    name = "karotte, cgroup pool off"
    describe = (f"as karotte with {cgroups.ENV_POOL}=0: a new cgroup per sandbox, removed "
                "when it closes")

    def run_once(self) -> int:
        saved = os.environ.get(cgroups.ENV_POOL)
        os.environ[cgroups.ENV_POOL] = "0"
        try:
            return super().run_once()
        finally:
            if saved is None:
                del os.environ[cgroups.ENV_POOL]
            else:
                os.environ[cgroups.ENV_POOL] = saved


def _timed_calls(fn: Callable[[], int], n: int) -> list[int]:
    return [fn() for _ in range(n)]


# --------------------------------------------------------------------------- case 1

def race(competitors: list[Competitor], runs: int, warmup: int, log,
         label: str = "lifecycle") -> dict[str, Series]:
    """Each competitor's run, `runs` times, round-robin with a rotating start (no
    competitor always runs first or always follows the same other one), after `warmup`
    untimed runs each. One that cannot run here, or fails, is skipped with its reason."""
    series = {c.name: Series(c.name, c.describe) for c in competitors}
    live: list[Competitor] = []
    try:
        for c in competitors:
            why = c.prepare()
            if why is None:
                try:
                    _timed_calls(c.run_once, warmup)
                    live.append(c)
                except PeerFailed as exc:
                    why = str(exc)
            if why is not None:
                series[c.name].skipped = why
                log(f"  {c.name}: skipped: {why}")
        for i in range(runs if live else 0):
            k = i % len(live)
            for c in live[k:] + live[:k]:
                if series[c.name].skipped is not None:
                    continue
                try:
                    series[c.name].samples_ns.append(c.run_once())
                except PeerFailed as exc:
                    series[c.name].skipped = f"failed at run {i + 1}: {exc}"
                    series[c.name].samples_ns.clear()
            if (i + 1) % max(1, runs // 4) == 0:
                log(f"  {label}: {i + 1}/{runs} rounds")
    finally:
        for c in competitors:
            c.cleanup()
    return series


def case_lifecycle(runs: int, warmup: int, log) -> dict:
    competitors: list[Competitor] = [KarotteLifecycle(), Bwrap(), Unshare(), Runc(),
                                     NoSandbox(), KarotteAfterIdle(), KarotteNoPool()]
    series = race(competitors, runs, warmup, log)
    karotte = series["karotte"].median_ms
    ratios = {name: _ratio(karotte, s.median_ms) for name, s in series.items()
              if name != "karotte"}
    return {"runs": runs, "warmup": warmup,
            "series": [s.to_json() for s in series.values()],
            "karotte_over": ratios}


# --------------------------------------------------------------------------- case 2

def case_exec(runs: int, async_runs: int, warmup: int, log) -> dict:
    sync = Series("karotte exec (sync)", "Sandbox.exec(['/bin/true']) in a live sandbox")
    reported = Series("karotte exec (ExecResult.wall_seconds)",
                      "the same execs as Karotte's own wall_seconds: request sent to exit "
                      "report received")
    with Sandbox(SandboxSpec()) as sb:
        for _ in range(warmup):
            sb.exec([TRUE])
        for i in range(runs):
            t0 = time.perf_counter_ns()
            r = sb.exec([TRUE])
            t1 = time.perf_counter_ns()
            if r.exit_code != 0:
                raise RuntimeError(f"exec {i}: /bin/true ended with {r}")
            sync.samples_ns.append(t1 - t0)
            reported.samples_ns.append(round(r.wall_seconds * 1e9))
    log(f"  exec: {runs} sync execs done")

    asy = Series("karotte exec (asyncio)", "await AsyncSandbox.exec(['/bin/true'])")

    async def drive() -> None:
        async with AsyncSandbox(SandboxSpec()) as sb:
            for _ in range(warmup):
                await sb.exec([TRUE])
            for i in range(async_runs):
                t0 = time.perf_counter_ns()
                r = await sb.exec([TRUE])
                t1 = time.perf_counter_ns()
                if r.exit_code != 0:
                    raise RuntimeError(f"async exec {i}: /bin/true ended with {r}")
                asy.samples_ns.append(t1 - t0)

    asyncio.run(drive())
    log(f"  exec: {async_runs} asyncio execs done")
    return {"runs": runs, "async_runs": async_runs,
            "series": [sync.to_json(), reported.to_json(), asy.to_json()]}


# --------------------------------------------------------------------------- case 3

class ResidentBlock:
    """`size` bytes of private anonymous memory, every page written, held by this
    process. 4 KiB pages where the kernel lets us ask (MADV_NOHUGEPAGE), so the page
    tables are as large as they get: the case a page-table copy would suffer most."""

    def __init__(self, size: int):
        rss0 = _status_bytes("VmRSS")
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.map.madvise(mmap.MADV_NOHUGEPAGE)
        chunk = b"\x5a" * (64 * MiB)  # not zero: every page gets a frame of its own
        for off in range(0, size, len(chunk)):
            end = min(size, off + len(chunk))
            self.map[off:end] = chunk[:end - off]
        self.rss_growth = _status_bytes("VmRSS") - rss0
        if self.rss_growth < 0.95 * size:
            raise RuntimeError(f"only {self.rss_growth >> 20} MiB of {size >> 20} MiB became "
                               "resident (memory pressure?)")

    def close(self) -> None:
        self.map.close()


def _create_destroy() -> int:
    t0 = time.perf_counter_ns()
    Sandbox(SandboxSpec()).close()
    return time.perf_counter_ns() - t0


def _create_first_exec() -> int:
    t0 = time.perf_counter_ns()
    sb = Sandbox(SandboxSpec())
    try:
        r = sb.exec([TRUE])
        t1 = time.perf_counter_ns()
    finally:
        sb.close()
    if r.exit_code != 0:
        raise RuntimeError(f"/bin/true ended with {r}")
    return t1 - t0


def _fork_control() -> int:
    t0 = time.perf_counter_ns()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return time.perf_counter_ns() - t0


def case_big_parent(runs: int, fork_runs: int, size: int, log) -> dict:
    """Blocks small -> big -> small: drift between blocks shows as a gap between the
    two small blocks, which are reported together."""
    kinds = {"create+destroy": _create_destroy, "create+first exec": _create_first_exec,
             "os.fork()+wait (control)": _fork_control}
    samples = {(kind, state): [] for kind in kinds for state in ("small", "big")}
    facts = {}

    def block(state: str, n: int) -> None:
        for i in range(n):
            for kind in ("create+destroy", "create+first exec"):
                samples[kind, state].append(kinds[kind]())
        for _ in range(max(1, fork_runs // 2 if state == "small" else fork_runs)):
            samples["os.fork()+wait (control)", state].append(_fork_control())

    for _ in range(3):
        _create_first_exec()
    gc.collect()
    facts["small_rss_bytes"] = _status_bytes("VmRSS")
    block("small", (runs + 1) // 2)
    log("  big_parent: first small block done; allocating")
    t0 = time.perf_counter()
    big = ResidentBlock(size)
    facts["alloc_seconds"] = time.perf_counter() - t0
    facts["big_rss_bytes"] = _status_bytes("VmRSS")
    facts["big_pte_bytes"] = _status_bytes("VmPTE")
    facts["resident_block_bytes"] = size
    facts["rss_growth_bytes"] = big.rss_growth
    try:
        block("big", runs)
    finally:
        big.close()
    log("  big_parent: big block done")
    block("small", runs // 2)
    facts["small_pte_bytes"] = _status_bytes("VmPTE")

    series, ratios = [], {}
    for kind in kinds:
        small = Series(f"{kind}, small parent", kind, samples[kind, "small"])
        large = Series(f"{kind}, parent +{size / GiB:g} GiB resident", kind,
                       samples[kind, "big"])
        series += [small.to_json(), large.to_json()]
        ratios[kind] = _ratio(large.median_ms, small.median_ms)
    return {"runs": runs, "facts": facts, "series": series, "big_over_small": ratios}


# --------------------------------------------------------------------------- case 4

def _cgroup_memory(cg) -> tuple[int | None, int | None]:
    """(memory charged to the cgroup, of which kernel memory) in bytes, v1 or v2."""
    for path in cg.paths:
        for usage, kmem in (("memory.current", None),
                            ("memory.usage_in_bytes", "memory.kmem.usage_in_bytes")):
            try:
                used = _read_int(os.path.join(path, usage))
            except OSError:
                continue
            k = None
            if kmem:
                try:
                    k = _read_int(os.path.join(path, kmem))
                except OSError:
                    pass
            return used, k
    return None, None


def _smaps_pss(pid: int) -> tuple[int, int]:
    """(Rss, Pss) of a process in bytes."""
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return rss, pss


def _own_leftovers() -> dict:
    """karotte-* cgroups this process made (names carry its pid) and karotte-init
    processes that are its children; and, apart, any made by other processes, and the
    empty cgroups this process keeps for reuse (cgroups.acquire)."""
    mine_prefix = f"{cgroups.PREFIX}{os.getpid()}."
    pooled = cgroups.pooled_paths()
    own_cg, other_cg = [], []
    points = sorted({line.split()[4] for line in open("/proc/self/mountinfo")
                     if " - cgroup" in line})
    for point in points:
        for top, dirs, _ in os.walk(point):
            for d in list(dirs):
                if d.startswith(cgroups.PREFIX):
                    path = os.path.join(top, d)
                    if path not in pooled:
                        (own_cg if d.startswith(mine_prefix) else other_cg).append(path)
            if top.count("/") - point.count("/") >= 6:
                dirs.clear()
    own_init, other_init = [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm == "karotte-init":
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            (own_init if ppid == os.getpid() else other_init).append(int(entry))
    return {"own_cgroups": own_cg, "own_init_processes": own_init,
            "own_pooled_empty_cgroups": len(pooled),
            "other_karotte_cgroups": other_cg, "other_karotte_init_processes": other_init}


def _own_superblocks(pid: int) -> int:
    """Filesystems (superblocks) mounted in a sandbox that the host does not have. Each
    registers a memcg-aware shrinker, and every memory cgroup on the host keeps
    per-shrinker state: this is what makes many sandboxes cost more than linear."""
    def devices(path: str) -> set[str]:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return {line.split()[2] for line in f}
    return len(devices(f"/proc/{pid}/mountinfo") - devices("/proc/self/mountinfo"))


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _host_limits(fds_per_sandbox: float, nofile: int, fds0: int, per_sandbox_bytes: float | None,
                 avail: int, held: int) -> dict:
    """How many idle sandboxes each host limit allows, from what one sandbox uses."""
    out = {}
    if fds_per_sandbox > 0:
        out["RLIMIT_NOFILE of the driver"] = {
            "limit": nofile, "allows": int((nofile - fds0) / fds_per_sandbox),
            "why": f"{fds_per_sandbox:g} fds per sandbox in the driver"}
    for name, path in (("kernel.pid_max", "/proc/sys/kernel/pid_max"),
                       ("user.max_user_namespaces", "/proc/sys/user/max_user_namespaces"),
                       ("user.max_mnt_namespaces", "/proc/sys/user/max_mnt_namespaces")):
        try:
            value = _read_int(path)
        except OSError:
            continue
        out[name] = {"limit": value, "allows": value,
                     "why": "one per idle sandbox (its init; more while it runs commands)"
                     if name == "kernel.pid_max" else "one per sandbox (two when unprivileged)"}
    if cgroups.detect().version == 1:
        out["cgroup v1 memory cgroup ids"] = {
            "limit": 65535, "allows": 65535 - 1,
            "why": "the kernel numbers memory cgroups in 16 bits (MEM_CGROUP_ID_MAX)"}
    if per_sandbox_bytes and per_sandbox_bytes > 0:
        out["memory (MemAvailable)"] = {
            "limit": avail, "allows": held + int(avail / per_sandbox_bytes),
            "why": f"{per_sandbox_bytes / MiB:.2f} MiB of host memory per idle sandbox"}
    return out


FD_RESERVE = 64  # fds kept back while filling the table, so that measuring and closing work
CURVE_KEYS = ("MemAvailable", "Slab", "SUnreclaim", "Percpu", "PageTables", "KernelStack")


def _curve_point(n: int, before: dict[str, int], rss0: int, t_start: float,
                 recent_ns: list[int]) -> dict:
    m = meminfo()
    point = {"held": n, "seconds": round(time.perf_counter() - t_start, 3),
             "recent_create_median_ms": statistics.median(recent_ns) / 1e6,
             "driver_rss_growth_bytes": _status_bytes("VmRSS") - rss0}
    for key in CURVE_KEYS:  # growth; for MemAvailable the drop
        delta = m.get(key, 0) - before.get(key, 0)
        point[f"{key}_growth_bytes" if key != "MemAvailable" else "MemAvailable_drop_bytes"] = \
            -delta if key == "MemAvailable" else delta
    return point


def case_density(target: int, log) -> dict:
    soft0, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft0 != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    gc.collect()
    # One sandbox first: the driver's one-time costs (imports, cached seccomp filter,
    # parsed rootfs) are not per-sandbox growth.
    Sandbox(SandboxSpec()).close()
    before = meminfo()
    rss0, fds0 = _status_bytes("VmRSS"), _fd_count()
    reserve = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(FD_RESERVE)]
    boxes: list[Sandbox] = []
    create_ns: list[int] = []
    curve = []
    stopped_by = None
    step = max(1, target // 10)
    t_start = time.perf_counter()
    try:
        while len(boxes) < target:
            t0 = time.perf_counter_ns()
            try:
                sb = Sandbox(SandboxSpec())
            except Exception as exc:  # noqa: BLE001 - the limit we ran into is the result
                stopped_by = f"{type(exc).__name__}: {exc}"
                log(f"  density: stopped at {len(boxes)}: {stopped_by}")
                break
            create_ns.append(time.perf_counter_ns() - t0)
            boxes.append(sb)
            n = len(boxes)
            if n % step == 0 or n == target:
                curve.append(_curve_point(n, before, rss0, t_start, create_ns[-step:]))
                log(f"  density: {n} held, MemAvailable -"
                    f"{curve[-1]['MemAvailable_drop_bytes'] / MiB:.0f} MiB, recent create "
                    f"median {curve[-1]['recent_create_median_ms']:.1f} ms")
        for fd in reserve:
            os.close(fd)
        reserve.clear()
        held = len(boxes)
        create_seconds = time.perf_counter() - t_start
        time.sleep(0.5)  # let per-cpu counters and deferred frees settle
        after = meminfo()
        rss1, fds1 = _status_bytes("VmRSS"), _fd_count()
        cg_used, cg_kmem, init_rss, init_pss = [], [], [], []
        for sb in boxes:
            used, kmem = _cgroup_memory(sb.cgroup)
            if used is not None:
                cg_used.append(used)
            if kmem is not None:
                cg_kmem.append(kmem)
            try:
                r, p = _smaps_pss(sb.init_pid)
                init_rss.append(r)
                init_pss.append(p)
            except OSError:
                pass
        # They are live, not just present: the first and the last still run commands.
        superblocks = _own_superblocks(boxes[0].init_pid) if boxes else None
        alive = all(sb.exec([TRUE]).exit_code == 0 for sb in (boxes[:1] + boxes[-1:])) \
            if boxes else None
    finally:
        for fd in reserve:
            os.close(fd)
        t_close = time.perf_counter()
        close_errors = []
        for sb in boxes:
            try:
                sb.close()
            except Exception as exc:  # noqa: BLE001 - reported, the rest still close
                close_errors.append(f"{type(exc).__name__}: {exc}")
        close_seconds = time.perf_counter() - t_close
    time.sleep(0.5)
    leftovers = _own_leftovers()
    end = meminfo()
    fds2 = _fd_count()
    if soft0 != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft0, hard))

    def per(total: float) -> float | None:
        return total / held if held else None

    keys = ("MemAvailable", "MemFree", "Slab", "SUnreclaim", "KernelStack", "PageTables",
            "Shmem", "Percpu")
    per_sandbox = per(before["MemAvailable"] - after["MemAvailable"])
    tenth = max(1, held // 10)
    return {
        "target": target, "held": held, "stopped_by": stopped_by,
        "rlimit_nofile": {"soft_before": soft0, "soft_used": hard, "hard": hard},
        "live_check_exec_ok": alive,
        "superblocks_per_sandbox": superblocks,
        "create_seconds": create_seconds, "close_seconds": close_seconds,
        "close_errors": close_errors,
        "series": [Series("create (first tenth held)", "Sandbox(SandboxSpec())",
                          create_ns[:tenth]).to_json(),
                   Series("create (last tenth held)", "Sandbox(SandboxSpec())",
                          create_ns[-tenth:]).to_json()],
        "create_all_ns": create_ns,
        # Growth of each: what N idle sandboxes added (for MemAvailable/MemFree: the drop).
        "meminfo_delta_bytes": {k: (before.get(k, 0) - after.get(k, 0))
                                * (1 if k in ("MemAvailable", "MemFree") else -1)
                                for k in keys},
        "per_sandbox_bytes": {
            "host_mem_available_drop": per_sandbox,
            "kernel_slab_growth": per(after["Slab"] - before["Slab"]),
            "page_tables_growth": per(after["PageTables"] - before["PageTables"]),
            "kernel_stack_growth": per(after["KernelStack"] - before["KernelStack"]),
            "cgroup_memory_usage_mean": statistics.mean(cg_used) if cg_used else None,
            "cgroup_kmem_usage_mean": statistics.mean(cg_kmem) if cg_kmem else None,
            "init_rss_mean": statistics.mean(init_rss) if init_rss else None,
            "init_pss_mean": statistics.mean(init_pss) if init_pss else None,
            "driver_rss_growth": per(rss1 - rss0),
            "driver_fds": per(fds1 - fds0),
        },
        "cgroup_memory_usage_sum_bytes": sum(cg_used),
        "growth_curve": curve,
        "host_limits": _host_limits(per(fds1 - fds0) or 0, hard, fds0, per_sandbox,
                                    after["MemAvailable"], held),
        "after_close": {
            "mem_available_recovered_bytes": end["MemAvailable"] - after["MemAvailable"],
            "mem_available_vs_before_bytes": end["MemAvailable"] - before["MemAvailable"],
            "driver_fds_left": fds2 - fds0,
            **leftovers,
        },
        "clean": not leftovers["own_cgroups"] and not leftovers["own_init_processes"]
                 and fds2 == fds0 and not close_errors,
    }


# --------------------------------------------------------------------------- case 5

def phase_table() -> dict[str, tuple[str, str]]:
    """The steps to time: the sandbox's, and the cgroup steps of the running backend."""
    return {**SANDBOX_PHASES, **SANDBOX_CGROUP_PHASES[cgroups.detect().version]}


def reach_every_phase() -> None:
    """Untimed: a sandbox made without the pool (leaf_name, mkdir, rmdir) and a cgroup
    kill with init alive (the freeze and SIGKILL rounds), steps that the measured cycles
    may not reach; PhaseTimer then checks that each wrapped name is the one called."""
    saved = os.environ.get(cgroups.ENV_POOL)
    os.environ[cgroups.ENV_POOL] = "0"
    try:
        Sandbox(SandboxSpec()).close()
    finally:
        if saved is None:
            del os.environ[cgroups.ENV_POOL]
        else:
            os.environ[cgroups.ENV_POOL] = saved
    with Sandbox(SandboxSpec()) as sb:
        sb.cgroup.kill_all()


def phase_run(events: list[tuple[str, int, int]], t0: int, t1: int, t2: int,
               t3: int) -> dict[str, int]:
    """One instrumented cycle's events -> {phase: ns}; a phase called twice is summed."""
    out = {"create: total": t1 - t0, "first exec: total": t2 - t1, "destroy: total": t3 - t2}
    start_end = ready = None
    for label, s, e in events:
        if label == "channel send":
            if s > t1:
                continue  # the EXEC message: part of begin_exec
            label = "create: send GO + CONFIG"
        elif label == "create: whole start() before waiting":
            start_end = e
        elif label == "create: READY receive" and ready is None:
            ready = s
        out[label] = out.get(label, 0) + (e - s)
    if start_end is not None and ready is not None:
        # Between start() returning and the READY receive the host only polls: this is
        # init exec'ing and building the mount tree.
        out["create: wait for READY (init exec + mount tree)"] = ready - start_end
    return out


def instrumented_cycle(timer: PhaseTimer, spec: SandboxSpec, idle: float) -> dict[str, int]:
    """One create, first exec and destroy of Sandbox(spec) under timer: {phase: ns}."""
    time.sleep(idle)
    timer.take()
    t0 = time.perf_counter_ns()
    sb = Sandbox(spec)
    t1 = time.perf_counter_ns()
    sb.exec([TRUE])
    t2 = time.perf_counter_ns()
    sb.close()
    t3 = time.perf_counter_ns()
    return phase_run(timer.take(), t0, t1, t2, t3)


def _instrumented_cycles(timer: PhaseTimer, runs: int, idle: float) -> dict[str, list[int]]:
    totals: dict[str, list[int]] = {}
    for _ in range(runs):
        for label, ns in instrumented_cycle(timer, SandboxSpec(), idle).items():
            totals.setdefault(label, []).append(ns)
    return totals


def case_phases(runs: int, log) -> dict:
    """Back-to-back cycles, then a quarter as many after KarotteAfterIdle's pause: the
    two columns show which step the pause makes slow."""
    idle_runs = max(3, runs // 4)
    with PhaseTimer(phase_table()) as timer:
        reach_every_phase()
        for _ in range(3):
            with Sandbox(SandboxSpec()) as sb:
                sb.exec([TRUE])
        timer.take()
        back_to_back = _instrumented_cycles(timer, runs, 0.0)
        after_idle = _instrumented_cycles(timer, idle_runs, KarotteAfterIdle.IDLE_SECONDS)
    log(f"  phases: {runs} + {idle_runs} instrumented create/exec/destroy cycles done")
    return {"runs": runs, "idle_runs": idle_runs, "idle_seconds": KarotteAfterIdle.IDLE_SECONDS,
            "phases": {label: asdict(Stats.of(ns)) for label, ns in sorted(back_to_back.items())},
            "phases_after_idle": {label: asdict(Stats.of(ns))
                                  for label, ns in sorted(after_idle.items())},
            "samples_ns": back_to_back, "samples_after_idle_ns": after_idle,
            "note": "medians of each phase over the runs; phases nest (a step's time "
                    "includes the steps named under it); the timers add about 1 us each"}


# --------------------------------------------------------------------------- report

def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / MiB:.2f} MiB"


HEADER = ["| series | median ms | p10 ms | p90 ms | n | ratio |",
          "|---|---:|---:|---:|---:|---:|"]


def _series_rows(series: list[dict], baseline: float | None = None) -> list[str]:
    """Table rows; the ratio column is median / baseline when a baseline is given."""
    rows = []
    for s in series:
        if s["status"] == "skipped":
            rows.append(f"| {s['name']} | skipped: {s['reason']} | | | | |")
            continue
        st = s["stats"]
        ratio = _fmt_ratio(_ratio(st["median_ms"], baseline)) if baseline else ""
        rows.append(f"| {s['name']} | {fmt_ms(st['median_ms'])} | {fmt_ms(st['p10_ms'])} | "
                    f"{fmt_ms(st['p90_ms'])} | {st['n']} | {ratio} |")
    return rows


def goals(cases: dict) -> list[Goal]:
    out = []
    lc = cases.get("lifecycle")
    if lc:
        med = {s["name"]: s["stats"]["median_ms"] for s in lc["series"] if s["status"] == "ok"}
        k = med.get("karotte")
        for peer, limit, text in (("bwrap", GOAL_VS_BWRAP, "Karotte faster than bwrap"),
                                  ("unshare (floor)", GOAL_VS_FLOOR,
                                   "Karotte within 1.5x of the unshare floor")):
            if peer not in med or k is None:
                out.append(Goal(text, f"ratio < {limit:g}", f"{peer} not measured", None))
            else:
                r = k / med[peer]
                out.append(Goal(text, f"karotte/{peer.split()[0]} < {limit:g}",
                                f"{k:.2f} ms vs {med[peer]:.2f} ms = {r:.2f}x", r < limit))
    ex = cases.get("exec")
    if ex:
        m = ex["series"][0]["stats"]["median_ms"]
        out.append(Goal("exec of /bin/true in a live sandbox", f"median < {GOAL_EXEC_MS:g} ms",
                        f"{m:.3f} ms", m < GOAL_EXEC_MS))
    bp = cases.get("big_parent")
    if bp:
        gib = bp["facts"]["resident_block_bytes"] / GiB
        for kind in ("create+destroy", "create+first exec"):
            r = bp["big_over_small"][kind]
            out.append(Goal(f"{kind} with the parent {gib:g} GiB resident vs small",
                            f"ratio <= {GOAL_BIG_PARENT:g}", _fmt_ratio(r),
                            None if r is None else r <= GOAL_BIG_PARENT))
    dn = cases.get("density")
    if dn:
        out.append(Goal("idle sandboxes held at once", f">= {GOAL_DENSITY}",
                        f"{dn['held']} (asked for {dn['target']})"
                        + (f", stopped by {dn['stopped_by']}" if dn["stopped_by"] else ""),
                        dn["held"] >= GOAL_DENSITY))
        out.append(Goal("nothing left after closing them", "no own cgroups, inits or fds",
                        "clean" if dn["clean"] else _leftover_text(dn), dn["clean"]))
    return out


def _leftover_text(dn: dict) -> str:
    left = dn["after_close"]
    errors = dn["close_errors"]
    text = (f"own karotte-* cgroups {len(left['own_cgroups'])}, own karotte-init processes "
            f"{len(left['own_init_processes'])}, driver fds {left['driver_fds_left']:+d}, "
            f"close() errors {len(errors)}")
    if errors:
        text += " (" + "; ".join(sorted(set(errors))) + ")"
    return text


def _render_lifecycle(lc: dict) -> list[str]:
    k = next((s for s in lc["series"] if s["name"] == "karotte"), None)
    km = k["stats"]["median_ms"] if k and k["status"] == "ok" else None
    return [f"## 1. create + exec /bin/true + destroy ({lc['runs']} runs each, round-robin; "
            f"ratio = median / Karotte's)", "", *HEADER, *_series_rows(lc["series"], km), "",
            *(f"- {s['name']}: {s['what']}" for s in lc["series"]), load_line(lc), ""]


def _render_exec(ex: dict) -> list[str]:
    return ["## 2. exec /bin/true in a live sandbox", "", *HEADER,
            *_series_rows(ex["series"]), "", load_line(ex), ""]


def _render_big_parent(bp: dict) -> list[str]:
    f = bp["facts"]
    lines = [f"## 3. spawn with the parent holding {f['resident_block_bytes'] / GiB:g} GiB "
             f"resident (ratio = median / the small parent's)", "",
             f"- driver RSS {f['small_rss_bytes'] / MiB:.0f} MiB -> {f['big_rss_bytes'] / MiB:.0f}"
             f" MiB, page tables {f['small_pte_bytes'] / MiB:.1f} MiB -> "
             f"{f['big_pte_bytes'] / MiB:.1f} MiB (4 KiB pages); allocated and written in "
             f"{f['alloc_seconds']:.1f} s", "", *HEADER]
    ser = bp["series"]
    for i in range(0, len(ser), 2):  # (small, big) pairs
        lines += _series_rows(ser[i:i + 2], ser[i]["stats"]["median_ms"])
    return lines + ["", load_line(bp), ""]


def _render_density(dn: dict) -> list[str]:
    p = dn["per_sandbox_bytes"]
    left = dn["after_close"]
    fds = "-" if p["driver_fds"] is None else f"{p['driver_fds']:.2f}"
    limits = sorted(dn["host_limits"].items(), key=lambda kv: kv[1]["allows"])
    return [f"## 4. idle sandboxes held at once: {dn['held']} of {dn['target']} asked"
            + (f" (stopped by {dn['stopped_by']})" if dn["stopped_by"] else ""), "",
            "| per idle sandbox | value |", "|---|---:|",
            f"| host MemAvailable drop | {_mib(p['host_mem_available_drop'])} |",
            f"| of which kernel slab | {_mib(p['kernel_slab_growth'])} |",
            f"| of which page tables | {_mib(p['page_tables_growth'])} |",
            f"| of which kernel stacks | {_mib(p['kernel_stack_growth'])} |",
            f"| charged to its memory cgroup | {_mib(p['cgroup_memory_usage_mean'])} |",
            f"| its init: RSS / PSS | {_mib(p['init_rss_mean'])} / {_mib(p['init_pss_mean'])} |",
            f"| driver RSS growth | {_mib(p['driver_rss_growth'])} |",
            f"| driver fds | {fds} |",
            f"| filesystems (superblocks) of its own | {dn['superblocks_per_sandbox']} |",
            "", *HEADER, *_series_rows(dn["series"]), "",
            f"- created all in {dn['create_seconds']:.1f} s, closed all in "
            f"{dn['close_seconds']:.1f} s; RLIMIT_NOFILE soft "
            f"{dn['rlimit_nofile']['soft_before']} -> {dn['rlimit_nofile']['soft_used']}; "
            f"the first and last sandbox still ran a command: {dn['live_check_exec_ok']}",
            f"- after closing all: {'clean' if dn['clean'] else 'NOT CLEAN'} "
            f"({_leftover_text(dn)}; karotte-* cgroups of other processes, not ours: "
            f"{len(left['other_karotte_cgroups'])})",
            "- host limits, tightest first: " + "; ".join(
                f"{name} = {v['limit']} allows ~{v['allows']} ({v['why']})"
                for name, v in limits),
            load_line(dn), ""]


def _render_phases(ph: dict) -> list[str]:
    lines = [f"## 5. where one create, first exec and destroy go ({ph['runs']} instrumented "
             f"cycles back to back, {ph['idle_runs']} after {1000 * ph['idle_seconds']:g} ms "
             f"idle; phases nest)", "",
             "| phase | median ms | p10 ms | p90 ms | median ms after idle |",
             "|---|---:|---:|---:|---:|"]
    order = ("create", "first exec", "exec", "destroy", "cgroup")

    def key(item):
        label = item[0]
        group = next((i for i, o in enumerate(order) if label.startswith(o)), len(order))
        return group, "total" not in label, label
    for label, st in sorted(ph["phases"].items(), key=key):
        idle = ph["phases_after_idle"].get(label)
        lines.append(f"| {label} | {fmt_ms(st['median_ms'])} | {fmt_ms(st['p10_ms'])} | "
                     f"{fmt_ms(st['p90_ms'])} | {fmt_ms(idle and idle['median_ms'])} |")
    return lines + ["", load_line(ph), ""]


def render(result: dict) -> str:
    m = result["machine"]
    peers = "; ".join(f"{name}: {v or 'missing'}" for name, v in m["peers"].items())
    lines = [f"# Karotte sandbox benchmark, {m['date']}", "", machine_line(m),
             f"- cgroups: {m['cgroup_backend']}; transparent hugepages: "
             f"{m['transparent_hugepage']}",
             f"- peers: {peers}", karotte_line(m),
             f"- command: `{result['command']}`", ""]
    renderers = {"lifecycle": _render_lifecycle, "exec": _render_exec,
                 "big_parent": _render_big_parent, "density": _render_density,
                 "phases": _render_phases}
    return render_cases_and_goals(lines, result, CASES, renderers)


# --------------------------------------------------------------------------- main

def _options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="a few runs of every case (CI smoke), 0.5 GiB resident, 10 sandboxes")
    ap.add_argument("--runs", type=int,
                    help="runs per competitor in case 1 (default 200, quick 5); case 2 runs "
                         "10x as many execs, cases 3 and 5 half as many cycles")
    ap.add_argument("--sandboxes", type=int, help="idle sandboxes to hold in case 4 "
                    "(default 1000, quick 10)")
    ap.add_argument("--parent-gib", type=float,
                    help="resident memory of the big parent in case 3 (default 4, quick 0.5)")


def _plan(ap: argparse.ArgumentParser, args: argparse.Namespace, log) -> tuple[dict, dict]:
    runs = args.runs or (5 if args.quick else 200)
    if runs < 1:
        ap.error("--runs must be at least 1")
    sandboxes = args.sandboxes or (10 if args.quick else 1000)
    parent = int((args.parent_gib or (0.5 if args.quick else 4.0)) * GiB)
    warmup = 1 if args.quick else 5
    runners = {
        "lifecycle": lambda: case_lifecycle(runs, warmup, log),
        "exec": lambda: case_exec(runs * 10, max(5, runs * 10 // 4), warmup * 4, log),
        "big_parent": lambda: case_big_parent(max(3, runs // 2), max(3, runs // 10), parent,
                                              log),
        "density": lambda: case_density(sandboxes, log),
        "phases": lambda: case_phases(max(3, runs // 2), log),
    }
    return {"runs": runs, "sandboxes": sandboxes, "parent_bytes": parent}, runners


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, doc=__doc__, script=__file__, cases=CASES, add_options=_options,
                      plan=_plan, goals=goals, render=render)


if __name__ == "__main__":
    sys.exit(main())
