#!/usr/bin/env python3
"""Karotte's episodes end to end: latency by phase, throughput under asyncio, and the
custody scan of a big workspace.

    scripts/bench_episode.py [--quick] [--episodes N] [--files N] [--cases a,b]
                             [--json FILE] [--quiet]

The environment is AnswerFile from scripts/bench_envs.py (one task file, one hidden
file, one deliverable, a grader that reads it). The agent runs one command with the bash
tool, `true`, so it leaves no answer: every episode is graded, and scores 0.0.

Cases (each reports medians with p10/p90):

  latency     N episodes (reset, exec `true`, finish), timed by phase: reset, exec, kill,
              scan + copy, grade, the whole finish() and end to end. Two variants take
              turns: back to back, and with 100 ms of untimed idle before reset and
              before finish (an agent that thinks: the kernel state that back-to-back
              sandbox creation keeps warm has gone cold by then).
  breakdown   where reset, exec and finish go, from timers wrapped around Karotte's
              internal steps (N/2 episodes back to back, N/4 with the idle), and from
              the grader's own time stamps (start-up, grade(), exit). Then single
              commands, round-robin: python3 start-up in the grading sandbox (bare,
              with -S, with the grader's imports), the bash tool's wrapper against
              /bin/true in the agent's sandbox, and python3 on the host as a control.
  throughput  episodes per second from one event loop, AsyncEpisode with
              set_concurrency(1, 8, 32), and a plain sync loop; rounds rotate the order.
              With each: the CPU this process, the sandboxes' processes and everything
              else used, which shows what limits.
  scan        the agent makes F files (default 10,000) in its workspace, flat in one
              directory or nested 3 levels deep; finish() then times kill, scan + copy,
              discarding the copy and grading. The layouts take turns.

The grade-phase timers wrap names inside karotte.grading, karotte.custody and
karotte.sandbox (the table is in scripts/benchlib.py); a name that is gone or never
called stops the benchmark with its name, never a phase that times nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace

from benchlib import (EPISODE_PHASES, Goal, PhaseTimer, Series, Stats, fmt_ms,
                      host_busy_seconds, karotte_line, load_line, machine_line,
                      render_cases_and_goals)
from benchlib import main as bench_main

try:
    import bench_envs
    from karotte import custody, episode, grading
    from karotte.episode import AsyncEpisode, Episode, Outcome, set_concurrency
    from karotte.sandbox import Sandbox
    from karotte.spec import Bind
except ImportError as _exc:  # karotte/scan.py is new: name the module that failed
    sys.exit(f"bench_episode: cannot import Karotte's episode code ({_exc}); "
             "karotte/scan.py and karotte/episode.py must import cleanly")

CASES = ("latency", "breakdown", "throughput", "scan")
COMMAND = "true"  # the agent's one bash-tool call
THINK_SECONDS = 0.1  # idle before reset and before finish in the "agent thinks" variant
CONCURRENCY = (1, 8, 32)
LAYOUTS = ("flat", "nested")

GOAL_EPISODE_MS = 100.0  # a minimal episode end to end
GOAL_SCAN_MS = 1000.0  # custody scan + copy of the F-file workspace

ENV = bench_envs.AnswerFile()
PYTHON = grading.PYTHON


def _now() -> int:
    return time.perf_counter_ns()


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _same_clock() -> str | None:
    """Why the grader's stamps cannot be compared with ours, or None if they can: the
    grader stamps with perf_counter in the sandbox, we time with perf_counter here."""
    ours = time.get_clock_info("perf_counter").implementation
    if "CLOCK_MONOTONIC" not in ours:
        return f"perf_counter is {ours} here, not CLOCK_MONOTONIC"
    return None


def _checked(outcome: Outcome, what: str) -> Outcome:
    if outcome.infra_error or outcome.reason != "graded":
        raise RuntimeError(f"{what}: the episode ended {outcome.reason!r} "
                           f"(infra_error {outcome.infra_error!r}); grader log:\n"
                           f"{outcome.grader_log[-2000:]}")
    return outcome


# --------------------------------------------------------------------------- case 1

PHASES = ("reset", "exec", "kill", "scan + copy", "grade", "finish: rest",
          "finish: whole", "end to end")
PHASE_WHAT = {
    "reset": "Episode.reset(): agent sandbox + task files (tar in the sandbox), perf_counter",
    "exec": f"Episode.exec({COMMAND!r}): one bash-tool call, perf_counter",
    "kill": "Outcome.timings.kill: custody's kill_all and its confirmation",
    "scan + copy": "Outcome.timings.scan: private dir + scan_and_copy of the workspace",
    "grade": "Outcome.timings.grade: run_grader (fresh sandbox, python3 grader, reward)",
    "finish: rest": "finish() minus kill, scan and grade: agent sandbox close, discard of "
                    "the submission copy",
    "finish: whole": "Episode.finish(), perf_counter",
    "end to end": "Episode() to the end of its with-block, idle excluded",
}


def _episode(seed: int, think: float = 0.0, env=ENV) -> tuple[dict[str, int], Outcome, dict]:
    """One sync episode of env (bench_image_sandbox.py passes one on an image): ns per
    phase, its outcome, and the stamps around its calls."""
    if think:
        time.sleep(think)
    t0 = _now()
    with Episode(env, seed=seed) as ep:
        ta = _now()
        ep.reset()
        t1 = _now()
        tool = ep.exec(COMMAND)
        t2 = _now()
        if think:
            time.sleep(think)
        t3 = _now()
        outcome = ep.finish()
        t4 = _now()
    t5 = _now()
    _checked(outcome, f"episode {seed}")
    if tool.exit_code != 0:
        raise RuntimeError(f"episode {seed}: `{COMMAND}` ended with {tool}")
    tm = outcome.timings
    kill, scan, grade = _ns(tm.kill), _ns(tm.scan), _ns(tm.grade)
    phases = {"reset": t1 - ta, "exec": t2 - t1, "kill": kill, "scan + copy": scan,
              "grade": grade, "finish: rest": (t4 - t3) - kill - scan - grade,
              "finish: whole": t4 - t3, "end to end": (t5 - t0) - (t3 - t2)}
    stamps = {"reset": (ta, t1), "exec": (t1, t2), "finish": (t3, t4),
              "tool_wall_ns": _ns(tool.wall_seconds)}
    return phases, outcome, stamps


def case_latency(runs: int, warmup: int, log) -> dict:
    variants = {"back to back": 0.0, f"agent thinks {THINK_SECONDS * 1000:g} ms": THINK_SECONDS}
    samples = {(v, p): [] for v in variants for p in PHASES}
    for i in range(warmup):  # the first grade copies the grader library
        _episode(i)
    names = list(variants)
    for i in range(runs):
        k = i % len(names)
        for v in names[k:] + names[:k]:
            phases, _, _ = _episode(1000 + i, variants[v])
            for p in PHASES:
                samples[v, p].append(phases[p])
        if (i + 1) % max(1, runs // 4) == 0:
            log(f"  latency: {i + 1}/{runs} rounds")
    series = [Series(f"{v}: {p}", PHASE_WHAT[p], samples[v, p]).to_json()
              for v in variants for p in PHASES]
    return {"runs": runs, "warmup": warmup, "variants": names, "phases": list(PHASES),
            "think_seconds": THINK_SECONDS, "series": series}


# --------------------------------------------------------------------------- case 2

def _spans(events, label: str, lo: int, hi: int) -> list[tuple[int, int]]:
    return [(s, e) for name, s, e in events if name == label and lo <= s and e <= hi]


def _total(spans) -> int:
    return sum(e - s for s, e in spans)


def _outside(spans, containers) -> list[tuple[int, int]]:
    return [(s, e) for s, e in spans if not any(a <= s and e <= b for a, b in containers)]


ATTACH = "of which the clone3, from a thread in the sandbox's cgroup (spawn_init)"
# The grader's exec, cut at: exec sent, bench_envs imported, grade() called, grade()
# returned, verdict received by the host, exec returned.
GRADER_SPLIT = (
    "grade: exec sent -> bench_envs imported (fork+exec, python3 -I start-up, imports)",
    "grade: bench_envs imported -> grade() called (load, GradeContext)",
    "grade: grade() itself",
    "grade: grade() returned -> verdict on the host (JSON over fd 3)",
    "grade: verdict -> exec returns (interpreter exit, exit report)",
)
# Labels of the breakdown in table order, with their depth: a line's time includes the
# deeper lines under it.
BREAKDOWN = (
    ("reset: whole", 0), ("reset: agent sandbox create", 1), (f"reset: {ATTACH}", 2),
    ("reset: task files (tar -x in the sandbox)", 1), ("reset: rest (prompt, tarball)", 1),
    ("exec: whole", 0), ("exec: Sandbox.exec of the bash wrapper", 1),
    ("exec: as Karotte reports it (request to exit report)", 2),
    ("finish: whole", 0), ("finish: kill (Sandbox.kill_all)", 1),
    ("finish: submission dir (private_dir)", 1), ("finish: scan_and_copy", 1),
    ("finish: agent sandbox close", 1), ("grade: whole (run_grader)", 1),
    ("grade: grader library lookup (copied once per process)", 2),
    ("grade: hidden files (private_dir + write_files)", 2),
    ("grade: parent cgroup create", 2), ("grade: grading sandbox create", 2),
    (f"grade: {ATTACH}", 3), ("grade: grader exec, whole", 2),
    *((label, 3) for label in GRADER_SPLIT),
    ("grade: grading sandbox close", 2), ("grade: parent cgroup destroy", 2),
    ("grade: rest (hidden dir removal, socketpair, thread, report)", 2),
    ("finish: discard the submission copy", 1), ("finish: rest", 1),
    ("end to end", 0),
)


def _attribute(events, phases: dict, outcome: Outcome, stamps: dict,
               clock_problem: str | None) -> tuple[dict[str, int], bool]:
    """One episode's timer events -> {label: ns}; False if the grader's stamps did not
    fall in order inside its exec (then the exec is not split)."""
    def total(label: str, lo: int, hi: int) -> int:
        return _total(_spans(events, label, lo, hi))

    r0, r1 = stamps["reset"]
    f0, f1 = stamps["finish"]
    out = {"reset: whole": phases["reset"], "exec: whole": phases["exec"],
           "finish: whole": phases["finish: whole"], "end to end": phases["end to end"],
           "exec: as Karotte reports it (request to exit report)": stamps["tool_wall_ns"],
           "exec: Sandbox.exec of the bash wrapper": total("sandbox exec", *stamps["exec"])}
    create, files = total("sandbox create", r0, r1), total("sandbox exec", r0, r1)
    out["reset: agent sandbox create"] = create
    out["reset: task files (tar -x in the sandbox)"] = files
    out["reset: rest (prompt, tarball)"] = phases["reset"] - create - files
    if _spans(events, "cgroup attach", r0, r1):
        out[f"reset: {ATTACH}"] = total("cgroup attach", r0, r1)

    custody_spans = _spans(events, "take_custody", f0, f1)
    grade_spans = _spans(events, "run_grader", f0, f1)
    if not custody_spans or not grade_spans:
        return out, True
    (c0, c1), (g0, g1) = custody_spans[0], grade_spans[0]
    out["finish: kill (Sandbox.kill_all)"] = total("sandbox kill_all", c0, c1)
    out["finish: submission dir (private_dir)"] = total("submission dir", c0, c1)
    out["finish: scan_and_copy"] = total("scan_and_copy", c0, c1)
    out["finish: agent sandbox close"] = total("sandbox close", c1, g0)
    out["finish: discard the submission copy"] = total("discard", g1, f1)
    out["finish: rest"] = (phases["finish: whole"] - (c1 - c0) - (g1 - g0)
                           - out["finish: discard the submission copy"]
                           - out["finish: agent sandbox close"])
    out["grade: whole (run_grader)"] = g1 - g0

    creates = _spans(events, "sandbox create", g0, g1)
    closes = _spans(events, "sandbox close", g0, g1)
    execs = _spans(events, "sandbox exec", g0, g1)
    grade = {
        "grade: grader library lookup (copied once per process)":
            total("grader library", g0, g1),
        "grade: hidden files (private_dir + write_files)":
            total("hidden dir", g0, g1) + total("hidden files", g0, g1),
        # Cgroup create and destroy outside the sandbox's own: the parent cgroup P.
        "grade: parent cgroup create":
            _total(_outside(_spans(events, "cgroup create", g0, g1), creates)),
        "grade: grading sandbox create": _total(creates),
        "grade: grader exec, whole": _total(execs),
        "grade: grading sandbox close": _total(closes),
        "grade: parent cgroup destroy":
            _total(_outside(_spans(events, "cgroup destroy", g0, g1), closes)),
    }
    out.update(grade)
    out["grade: rest (hidden dir removal, socketpair, thread, report)"] = \
        (g1 - g0) - sum(grade.values())
    attaches = [span for a, b in creates for span in _spans(events, "cgroup attach", a, b)]
    if attaches:
        out[f"grade: {ATTACH}"] = _total(attaches)

    serves = _spans(events, "serve", g0, g1)
    d = outcome.details
    if not (execs and serves and clock_problem is None and "grade_start_ns" in d):
        return out, True
    # The verdict's arrival is stamped by the serving thread when it gets the GIL, which
    # can be after the main thread saw the grader exit (os._exit right after the
    # verdict): it came before that exit.
    (x0, x1), verdict = execs[0], min(serves[0][1], execs[0][1])
    cuts = [x0, d["imported_ns"], d["grade_start_ns"], d["grade_end_ns"], verdict, x1]
    if cuts != sorted(cuts):
        return out, False
    for label, a, b in zip(GRADER_SPLIT, cuts, cuts[1:]):
        out[label] = b - a
    return out, True


def _breakdown_episodes(timer: PhaseTimer, runs: int, think: float, seed0: int,
                        clock_problem: str | None) -> tuple[dict[str, list[int]], int]:
    found: dict[str, list[int]] = {}
    disordered = 0
    for i in range(runs):
        timer.take()
        phases, outcome, stamps = _episode(seed0 + i, think)
        labels, in_order = _attribute(timer.take(), phases, outcome, stamps, clock_problem)
        disordered += not in_order
        for label, ns in labels.items():
            found.setdefault(label, []).append(ns)
    return found, disordered


def _command_series(runs: int, log) -> list[dict]:
    """Single commands, round-robin, each timed by perf_counter around Sandbox.exec (or
    subprocess.run on the host); CPU is the command's own (ExecResult.cpu_seconds, or the
    child's rusage)."""
    lib = grading.grader_library(type(ENV).__module__.split(".")[0])
    imports = (f"import sys; sys.path[:0] = [{grading.LIB_MOUNT!r}]; "
               "import karotte.grader_main, bench_envs")
    grader_spec = replace(ENV.grader_limits, binds=ENV.grader_limits.binds
                          + (Bind(lib, grading.LIB_MOUNT),))
    python = [PYTHON, "-I", "-B"]
    grading_cmds = {
        "grading sandbox: /bin/true": ["/bin/true"],
        "grading sandbox: python3 -I -B -c pass": python + ["-c", "pass"],
        "grading sandbox: python3 -I -B -S -c pass (no site)": python + ["-S", "-c", "pass"],
        "grading sandbox: python3 -I -B, the grader's imports": python + ["-c", imports],
        "grading sandbox: the same, then os._exit(0) (no finalization)":
            python + ["-c", imports + "; import os; os._exit(0)"],
    }
    agent_cmds = {
        "agent sandbox: /bin/true": ["/bin/true"],
        "agent sandbox: bash -c true": ["/bin/bash", "--noprofile", "--norc", "-c", "true"],
        f"agent sandbox: the bash tool's wrapper around `{COMMAND}`":
            episode.bash_argv(COMMAND),
    }
    host_cmd = python + ["-c", "pass"]
    host_name = "host, no sandbox: python3 -I -B -c pass"
    series = {name: Series(name, shlex.join(argv)) for name, argv in
              [*grading_cmds.items(), *agent_cmds.items(), (host_name, host_cmd)]}
    cpu: dict[str, list[int]] = {name: [] for name in series}

    with Sandbox(grader_spec) as grader_sb, Sandbox(ENV.limits) as agent_sb:
        def in_sandbox(sb, argv):
            def run() -> tuple[int, int]:
                t0 = _now()
                r = sb.exec(argv)
                t1 = _now()
                if r.exit_code != 0:
                    raise RuntimeError(f"{shlex.join(argv)} ended with {r}")
                return t1 - t0, _ns(r.cpu_seconds)
            return run

        def on_host() -> tuple[int, int]:
            before = CpuSplit._usage(resource.RUSAGE_CHILDREN)
            t0 = _now()
            proc = subprocess.run(host_cmd, stdin=subprocess.DEVNULL)
            t1 = _now()
            if proc.returncode != 0:
                raise RuntimeError(f"{shlex.join(host_cmd)} exited {proc.returncode}")
            return t1 - t0, _ns(CpuSplit._usage(resource.RUSAGE_CHILDREN) - before)

        runners = {name: in_sandbox(grader_sb, argv) for name, argv in grading_cmds.items()}
        runners.update({name: in_sandbox(agent_sb, argv) for name, argv in agent_cmds.items()})
        runners[host_name] = on_host
        order = list(runners)
        for fn in runners.values():  # warm the page cache and the interpreter's files
            fn()
        for i in range(runs):
            k = i % len(order)
            for name in order[k:] + order[:k]:
                wall, used = runners[name]()
                series[name].samples_ns.append(wall)
                cpu[name].append(used)
    log(f"  breakdown: {runs} rounds of {len(order)} single commands done")
    out = []
    for name, s in series.items():
        record = s.to_json()
        record["cpu_median_ms"] = statistics.median(cpu[name]) / 1e6
        out.append(record)
    return out


def case_breakdown(runs: int, think_runs: int, command_runs: int, log) -> dict:
    clock_problem = _same_clock()
    timer = PhaseTimer(EPISODE_PHASES)
    with timer:
        for i in range(2):
            _episode(i)
        back, disordered = _breakdown_episodes(timer, runs, 0.0, 2000, clock_problem)
        log(f"  breakdown: {runs} instrumented episodes back to back done")
        think, disordered_think = _breakdown_episodes(timer, think_runs, THINK_SECONDS, 3000,
                                                      clock_problem)
        log(f"  breakdown: {think_runs} instrumented episodes with "
            f"{THINK_SECONDS * 1000:g} ms idle done")
    return {"runs": runs, "think_runs": think_runs, "think_seconds": THINK_SECONDS,
            "grader_stamps": clock_problem or (
                f"grader stamps out of order in {disordered + disordered_think} episodes"
                if disordered + disordered_think else "ok"),
            "order": [label for label, _ in BREAKDOWN],
            "depth": {label: depth for label, depth in BREAKDOWN},
            "phases": {label: asdict(Stats.of(ns)) for label, ns in back.items()},
            "phases_think": {label: asdict(Stats.of(ns)) for label, ns in think.items()},
            "samples_ns": back, "samples_think_ns": think,
            "commands": _command_series(command_runs, log),
            "command_runs": command_runs,
            "note": "phases nest (a line's time includes the lines indented under it); "
                    "the timers add about 1 us each"}


# --------------------------------------------------------------------------- case 3

class CpuSplit:
    """CPU time while a run lasts: this process (every thread: event loop, executor,
    grader threads), its reaped children (the sandboxes' inits, and through them the
    agent's commands and the graders), and the rest of the host (kernel workers, other
    users)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.busy0 = host_busy_seconds()
        self.self0 = self._usage(resource.RUSAGE_SELF)
        self.kids0 = self._usage(resource.RUSAGE_CHILDREN)

    @staticmethod
    def _usage(who: int) -> float:
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    def done(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy = host_busy_seconds() - self.busy0
        own = self._usage(resource.RUSAGE_SELF) - self.self0
        kids = self._usage(resource.RUSAGE_CHILDREN) - self.kids0
        return {"wall_seconds": wall, "host_busy_cpu_seconds": busy,
                "driver_cpu_seconds": own, "sandbox_cpu_seconds": kids,
                "other_cpu_seconds": max(0.0, busy - own - kids)}


def _sync_run(n: int, seed0: int) -> tuple[list[int], list[int]]:
    """n episodes one after another: latency and time served are the same."""
    latency = [_episode(seed0 + i)[0]["end to end"] for i in range(n)]
    return latency, latency


async def _async_run(k: int, n: int, seed0: int) -> tuple[list[int], list[int]]:
    """n episodes at once from this loop, at most k past reset's slot. Returns each one's
    latency (from its start, waiting for a slot included) and the time from its slot to
    its outcome."""
    set_concurrency(k)

    async def one(seed: int) -> tuple[int, int]:
        t0 = _now()
        async with AsyncEpisode(ENV, seed=seed) as ep:
            await ep.reset()
            t1 = _now()
            tool = await ep.exec(COMMAND)
            outcome = await ep.finish()
        t2 = _now()
        _checked(outcome, f"async episode {seed}")
        if tool.exit_code != 0:
            raise RuntimeError(f"async episode {seed}: `{COMMAND}` ended with {tool}")
        return t2 - t0, _ns(outcome.timings.reset) + (t2 - t1)

    done = await asyncio.gather(*(one(seed0 + i) for i in range(n)))
    return [d[0] for d in done], [d[1] for d in done]


def _default_executor_workers() -> int:
    """What asyncio's default executor (custody and grading run there) allows at once:
    ThreadPoolExecutor's default, min(32, cpus + 4)."""
    return min(32, (os.cpu_count() or 1) + 4)


class Gauge:
    """How many calls of a function run at once, at most (calls from any thread)."""

    def __init__(self):
        self.now = self.peak = 0
        self._lock = threading.Lock()

    def counting(self, fn):
        def counted(*args, **kwargs):
            with self._lock:
                self.now += 1
                self.peak = max(self.peak, self.now)
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.now -= 1
        return counted


def case_throughput(rounds: int, per_run: int, log) -> dict:
    levels = ["sync loop"] + [f"async, concurrency {k}" for k in CONCURRENCY]
    runs = {name: [] for name in levels}
    latency = {name: [] for name in levels}
    service = {name: [] for name in levels}
    for i in range(2):
        _episode(i)
    seed = 5000
    real_grader = episode.run_grader
    try:
        for r in range(rounds):
            k = r % len(levels)
            for name in levels[k:] + levels[:k]:
                gauge = Gauge()
                episode.run_grader = gauge.counting(real_grader)
                cpu = CpuSplit()
                if name == "sync loop":
                    lat, svc = _sync_run(per_run, seed)
                else:
                    lat, svc = asyncio.run(_async_run(int(name.rsplit(" ", 1)[1]), per_run,
                                                      seed))
                split = cpu.done()
                episode.run_grader = real_grader
                split["gradings_at_once_peak"] = gauge.peak
                seed += per_run
                split["episodes"] = per_run
                split["episodes_per_second"] = per_run / split["wall_seconds"]
                runs[name].append(split)
                latency[name] += lat
                service[name] += svc
            log(f"  throughput: round {r + 1}/{rounds} done")
    finally:
        episode.run_grader = real_grader
        set_concurrency(episode.DEFAULT_CONCURRENCY)
    out = []
    cores = len(os.sched_getaffinity(0))
    for name in levels:
        rs = runs[name]
        eps = sorted(x["episodes_per_second"] for x in rs)
        wall = sum(x["wall_seconds"] for x in rs)
        n = sum(x["episodes"] for x in rs)

        def share(key: str) -> float:
            return sum(x[key] for x in rs) / (wall * cores)

        cpu_ms = 1000 * sum(x["host_busy_cpu_seconds"] for x in rs) / n
        out.append({
            "name": name, "runs": rs,
            "episodes_per_second_median": statistics.median(eps),
            "episodes_per_second_min": eps[0], "episodes_per_second_max": eps[-1],
            "gradings_at_once_peak": max(x["gradings_at_once_peak"] for x in rs),
            "host_busy_share": share("host_busy_cpu_seconds"),
            "driver_share": share("driver_cpu_seconds"),
            "driver_cores": sum(x["driver_cpu_seconds"] for x in rs) / wall,
            "sandbox_share": share("sandbox_cpu_seconds"),
            "other_share": share("other_cpu_seconds"),
            "host_cpu_ms_per_episode": cpu_ms,
            "driver_cpu_ms_per_episode": 1000 * sum(x["driver_cpu_seconds"] for x in rs) / n,
            "sandbox_cpu_ms_per_episode": 1000 * sum(x["sandbox_cpu_seconds"] for x in rs) / n,
            "cpu_bound_episodes_per_second": 1000 * cores / cpu_ms if cpu_ms > 0 else None,
            "series": [Series(f"{name}: episode latency", "start to end of one episode, "
                              "waiting for a slot included", latency[name]).to_json(),
                       Series(f"{name}: served", "from the slot acquired in reset to the "
                              "outcome",
                              service[name]).to_json()],
        })
    return {"rounds": rounds, "episodes_per_run": per_run, "cores": cores,
            "default_executor_workers": _default_executor_workers(), "levels": out}


# --------------------------------------------------------------------------- case 4

def _make_files(layout: str, files: int) -> str:
    """A bash-tool command with which the agent makes `files` files of 64 bytes."""
    if layout == "flat":
        body = ("os.mkdir('flat')\n"
                "for i in range(N):\n"
                "    with open(f'flat/f{i:05d}', 'w') as f:\n"
                "        f.write('%063d\\n' % i)\n")
    else:  # 3 levels of up to 10 directories, files spread over the 1000 leaves
        body = ("per = max(10, -(-N // 1000))\n"
                "for i in range(N):\n"
                "    leaf = i // per\n"
                "    d = f'nested/d{leaf // 100}/d{leaf // 10 % 10}/d{leaf % 10}'\n"
                "    if i % per == 0:\n"
                "        os.makedirs(d)\n"
                "    with open(f'{d}/f{i % per}', 'w') as f:\n"
                "        f.write('%063d\\n' % i)\n")
    return f"python3 -I -c {shlex.quote(f'import os{chr(10)}N = {files}{chr(10)}' + body)}"


SCAN_PHASES = ("agent makes the files (its exec)", "kill", "scan + copy (Timings.scan)",
               "scan_and_copy alone", "discard the copy (rmtree)", "grade", "finish: whole")


def _scan_episode(layout: str, files: int, seed: int) -> tuple[dict[str, int], dict]:
    captured = {}
    real_scan, real_discard = custody.scan_and_copy, custody.Custody.discard

    def scan(*args, **kwargs):
        t0 = _now()
        result = real_scan(*args, **kwargs)
        captured["scan_ns"], captured["result"] = _now() - t0, result
        return result

    def discard(self):
        t0 = _now()
        try:
            return real_discard(self)
        finally:
            captured["discard_ns"] = _now() - t0

    custody.scan_and_copy, custody.Custody.discard = scan, discard
    try:
        with Episode(ENV, seed=seed) as ep:
            ep.reset()
            made = ep.exec(_make_files(layout, files), timeout=300)
            if made.exit_code != 0:
                raise RuntimeError(f"scan {layout}: making the files failed: {made.text[-2000:]}")
            t0 = _now()
            outcome = _checked(ep.finish(), f"scan {layout}")
            t1 = _now()
    finally:
        custody.scan_and_copy, custody.Custody.discard = real_scan, real_discard
    result = captured["result"]
    facts = {"files": len(result.files), "dirs": len(result.dirs),
             "bytes": sum(f.size for f in result.files), "complete": result.complete,
             "violations": [asdict(v) for v in result.violations[:5]],
             "karotte_scan_seconds": result.seconds}
    if len(result.files) != files + len(ENV.workspace_files(seed)) or result.violations \
            or not result.complete:
        raise RuntimeError(f"scan {layout}: expected {files} files and the task's, no "
                           f"violation; got {facts}")
    tm = outcome.timings
    return {"agent makes the files (its exec)": _ns(made.wall_seconds), "kill": _ns(tm.kill),
            "scan + copy (Timings.scan)": _ns(tm.scan), "scan_and_copy alone": captured["scan_ns"],
            "discard the copy (rmtree)": captured["discard_ns"], "grade": _ns(tm.grade),
            "finish: whole": t1 - t0}, facts


SHM = "/dev/shm"


def _copy_targets() -> dict[str, str | None]:
    """Where private dirs (the submission copy among them) may go: the default temp dir,
    and a tmpfs if the host has one, as TMPDIR would put them."""
    default = tempfile.gettempdir()
    targets = {f"{default} ({_filesystem_of(default)})": None}
    if _filesystem_of(SHM) == "tmpfs" and os.access(SHM, os.W_OK):
        targets[f"{SHM} (tmpfs, as with TMPDIR={SHM})"] = SHM
    return targets


def case_scan(runs: int, files: int, log) -> dict:
    targets = _copy_targets()
    variants = [(layout, target) for layout in LAYOUTS for target in targets]
    samples = {(v, p): [] for v in variants for p in SCAN_PHASES}
    facts = {}
    default_tempdir = tempfile.tempdir
    try:
        for i in range(runs):
            k = i % len(variants)
            for layout, target in variants[k:] + variants[:k]:
                tempfile.tempdir = targets[target] or default_tempdir
                phases, facts[layout] = _scan_episode(layout, files, 7000 + i)
                for p in SCAN_PHASES:
                    samples[(layout, target), p].append(phases[p])
            log(f"  scan: {i + 1}/{runs} rounds")
    finally:
        tempfile.tempdir = default_tempdir
    return {"runs": runs, "files": files, "layouts": list(LAYOUTS), "phases": list(SCAN_PHASES),
            "copy_targets": list(targets),
            "variants": [f"{layout}, copy to {target}" for layout, target in variants],
            "facts": facts,
            "series": [Series(f"{layout}, copy to {target}: {p}", p,
                              samples[(layout, target), p]).to_json()
                       for layout, target in variants for p in SCAN_PHASES]}


def _filesystem_of(path: str) -> str:
    """The filesystem type of the mount that holds path (longest mount-point prefix)."""
    best, kind = "", "unknown"
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            point = fields[1]
            if (path == point or path.startswith(point.rstrip("/") + "/")) \
                    and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


# --------------------------------------------------------------------------- report

def _stats(series: list[dict]) -> dict[str, dict]:
    return {s["name"]: s["stats"] for s in series if s["status"] == "ok"}


def goals(cases: dict) -> list[Goal]:
    out = []
    lat = cases.get("latency")
    if lat:
        st = _stats(lat["series"])
        for v in lat["variants"]:
            m = st[f"{v}: end to end"]["median_ms"]
            out.append(Goal(f"minimal episode end to end, {v}",
                            f"median < {GOAL_EPISODE_MS:g} ms",
                            f"{m:.1f} ms (p90 {st[f'{v}: end to end']['p90_ms']:.1f} ms)",
                            m < GOAL_EPISODE_MS))
    sc = cases.get("scan")
    if sc:
        st = _stats(sc["series"])
        for v in sc["variants"]:
            s = st[f"{v}: scan + copy (Timings.scan)"]
            out.append(Goal(f"custody scan + copy of {sc['files']:,} files, {v}",
                            f"median < {GOAL_SCAN_MS:g} ms",
                            f"{s['median_ms']:.0f} ms (p90 {s['p90_ms']:.0f} ms)",
                            s["median_ms"] < GOAL_SCAN_MS))
    return out


def _render_latency(lat: dict) -> list[str]:
    st = _stats(lat["series"])
    vs = lat["variants"]
    head = "| phase | " + " | ".join(f"{v}: median | p10 | p90" for v in vs) + " |"
    lines = [f"## 1. a minimal episode by phase ({lat['runs']} episodes per variant, "
             "taking turns; ms)", "", head, "|---|" + "---:|---:|---:|" * len(vs)]
    for p in lat["phases"]:
        cells = []
        for v in vs:
            s = st.get(f"{v}: {p}")
            cells += [fmt_ms(s and s["median_ms"]), fmt_ms(s and s["p10_ms"]),
                      fmt_ms(s and s["p90_ms"])]
        bold = p == "end to end"
        name = f"**{p}**" if bold else p
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {p}: {PHASE_WHAT[p]}" for p in lat["phases"]]
    return lines + [load_line(lat), ""]


def _render_breakdown(bd: dict) -> list[str]:
    lines = [f"## 2. where the time goes ({bd['runs']} instrumented episodes back to back, "
             f"{bd['think_runs']} with {bd['think_seconds'] * 1000:g} ms idle; phases nest)",
             "", "| phase | median ms | p10 ms | p90 ms | median ms with idle |",
             "|---|---:|---:|---:|---:|"]
    for label in bd["order"]:
        st = bd["phases"].get(label)
        if st is None:
            continue
        think = bd["phases_think"].get(label)
        indent = "&nbsp;&nbsp;" * bd["depth"][label]
        lines.append(f"| {indent}{label} | {fmt_ms(st['median_ms'])} | {fmt_ms(st['p10_ms'])} | "
                     f"{fmt_ms(st['p90_ms'])} | {fmt_ms(think and think['median_ms'])} |")
    lines += ["", f"- the grader's own time stamps: {bd['grader_stamps']}"]
    lines += ["", f"### single commands ({bd['command_runs']} runs each, round-robin)", "",
              "| command | median ms | p10 ms | p90 ms | n | CPU ms (median) |",
              "|---|---:|---:|---:|---:|---:|"]
    for s in bd["commands"]:
        if s["status"] != "ok":
            lines.append(f"| {s['name']} | skipped: {s['reason']} | | | | |")
            continue
        st = s["stats"]
        lines.append(f"| {s['name']} | {fmt_ms(st['median_ms'])} | {fmt_ms(st['p10_ms'])} | "
                     f"{fmt_ms(st['p90_ms'])} | {st['n']} | {fmt_ms(s['cpu_median_ms'])} |")
    return lines + ["", load_line(bd), ""]


def _render_throughput(tp: dict) -> list[str]:
    lines = [f"## 3. throughput ({tp['rounds']} rounds of {tp['episodes_per_run']} episodes "
             f"per level, order rotating; {tp['cores']} cores; asyncio's default executor "
             f"runs {tp['default_executor_workers']} custody/grading calls at once)", "",
             "| level | episodes/s (median of rounds) | min - max | latency p50 / p90 ms "
             "| served p50 / p90 ms | gradings at once (peak) | host CPU busy | driver "
             "process | sandboxes | other | CPU ms per episode (driver / sandboxes) | "
             "CPU-bound ceiling eps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in tp["levels"]:
        lat, svc = (s["stats"] for s in lv["series"])
        ceiling = lv["cpu_bound_episodes_per_second"]
        lines.append(
            f"| {lv['name']} | {lv['episodes_per_second_median']:.1f} | "
            f"{lv['episodes_per_second_min']:.1f} - {lv['episodes_per_second_max']:.1f} | "
            f"{fmt_ms(lat['median_ms'])} / {fmt_ms(lat['p90_ms'])} | "
            f"{fmt_ms(svc['median_ms'])} / {fmt_ms(svc['p90_ms'])} | "
            f"{lv['gradings_at_once_peak']} | "
            f"{100 * lv['host_busy_share']:.0f}% | {100 * lv['driver_share']:.0f}% "
            f"({lv['driver_cores']:.2f} cores) | {100 * lv['sandbox_share']:.0f}% | "
            f"{100 * lv['other_share']:.0f}% | {lv['host_cpu_ms_per_episode']:.1f} "
            f"({lv['driver_cpu_ms_per_episode']:.1f} / {lv['sandbox_cpu_ms_per_episode']:.1f}) "
            f"| {fmt_ms(ceiling)} |")
    lines += ["", "- shares are of all cores' time during the runs; the driver is this "
              "process (event loop, executor and grader threads, one GIL); sandboxes are its "
              "reaped children (inits, the agent's commands, the python3 graders); other is "
              "the rest of the host (kernel workers, other users)",
              "- served: from the slot acquired in reset to the outcome; finish() (custody "
              "and grading) runs in asyncio's default executor, so no more gradings run at "
              "once than it has workers, whatever the concurrency",
              "- CPU-bound ceiling: cores / host CPU per episode",
              load_line(tp), ""]
    return lines


def _render_scan(sc: dict) -> list[str]:
    st = _stats(sc["series"])
    lines = [f"## 4. custody of a {sc['files']:,}-file workspace ({sc['runs']} episodes per "
             f"variant, taking turns; medians in ms, p10 - p90 for the scan)", "",
             "| layout, copy to | " + " | ".join(sc["phases"]) + " | scan + copy p10 - p90 |",
             "|---|" + "---:|" * (len(sc["phases"]) + 1)]
    for v in sc["variants"]:
        cells = [fmt_ms(st[f"{v}: {p}"]["median_ms"]) for p in sc["phases"]]
        scan = st[f"{v}: scan + copy (Timings.scan)"]
        lines.append(f"| {v} | " + " | ".join(cells)
                     + f" | {fmt_ms(scan['p10_ms'])} - {fmt_ms(scan['p90_ms'])} |")
    lines.append("")
    for layout in sc["layouts"]:
        f = sc["facts"][layout]
        lines.append(f"- {layout}: {f['files']:,} files ({f['bytes']:,} bytes) and "
                     f"{f['dirs']:,} directories accepted, complete: {f['complete']}, "
                     f"violations: {len(f['violations'])}")
    return lines + [load_line(sc), ""]


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Karotte episode benchmark, {m['date']}", "", machine_line(m),
             f"- cgroups: {m['cgroup_backend']}", karotte_line(m),
             f"- environment: bench_envs.AnswerFile; the agent's one command: `{COMMAND}`",
             f"- command: `{result['command']}`", ""]
    renderers = {"latency": _render_latency, "breakdown": _render_breakdown,
                 "throughput": _render_throughput, "scan": _render_scan}
    return render_cases_and_goals(lines, result, CASES, renderers)


# --------------------------------------------------------------------------- main

def _options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="a few runs of every case (CI smoke); the workspace still has "
                         "--files files")
    ap.add_argument("--episodes", type=int,
                    help="episodes per variant in case 1 (default 200, quick 5); case 2 "
                         "instruments half as many, case 4 runs a twentieth")
    ap.add_argument("--files", type=int, default=10_000,
                    help="files the agent makes in case 4 (default 10000)")


def _plan(ap: argparse.ArgumentParser, args: argparse.Namespace, log) -> tuple[dict, dict]:
    runs = args.episodes or (5 if args.quick else 200)
    if runs < 1 or args.files < 1:
        ap.error("--episodes and --files must be at least 1")
    runners = {
        "latency": lambda: case_latency(runs, 1 if args.quick else 5, log),
        "breakdown": lambda: case_breakdown(max(3, runs // 2), max(2, runs // 4),
                                            max(3, runs // 2), log),
        "throughput": lambda: case_throughput(1 if args.quick else 3,
                                              4 if args.quick else 96, log),
        "scan": lambda: case_scan(max(1, runs // 20), args.files, log),
    }
    return {"episodes": runs, "files": args.files}, runners


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, doc=__doc__, script=__file__, cases=CASES, add_options=_options,
                      plan=_plan, goals=goals, render=render)


if __name__ == "__main__":
    sys.exit(main())
