"""What the benchmarks in scripts/ share: sample records, the machine description, the
phase timer and the table of Karotte's names it wraps, report helpers and the common
main(). Importing it puts this checkout's karotte first on sys.path.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, REPO)

from karotte import cgroups  # noqa: E402
from karotte.spec import GiB  # noqa: E402

# --------------------------------------------------------------------------- names timed

# Every name of Karotte's that a phase timer wraps: label -> (module, attribute), where
# "Class.attribute" is what that class itself defines. A name that Karotte moves must
# move here too: PhaseTimer raises when one is gone or no call reached it.
SANDBOX_PHASES: dict[str, tuple[str, str]] = {
    "create: cgroup name (leaf_name)": ("karotte.cgroups", "leaf_name"),
    "create: cgroup backend probe (detect)": ("karotte.cgroups", "detect"),
    "create: cgroup from the pool or new, limits written (acquire)":
        ("karotte.cgroups", "acquire"),
    "create: clone3 of init, from a thread in the sandbox's cgroup (spawn_init)":
        ("karotte.native", "spawn_init"),
    "create: uid/gid maps (_write_proc)": ("karotte.sandbox_core", "_write_proc"),
    "create: config message build": ("karotte.plan", "config_message"),
    "channel send": ("karotte.sandbox_core", "_Core.send"),
    "create: whole start() before waiting": ("karotte.sandbox_core", "_Core.start"),
    "create: READY receive": ("karotte.sandbox_core", "_Core.recv_with_fds"),
    "create: finish_start": ("karotte.sandbox_core", "_Core.finish_start"),
    "exec: begin_exec (cgroup peak reset, oom count, pipes, send)":
        ("karotte.sandbox_core", "_Core.begin_exec"),
    "exec: wait for exit (drive_sync)": ("karotte.sandbox", "drive_sync"),
    "exec: end_exec (cgroup peak and oom reads)": ("karotte.sandbox_core", "_Core.end_exec"),
    "destroy: whole": ("karotte.sandbox_core", "_Core.destroy"),
    "destroy: kill_all (cgroup kill + reap init)": ("karotte.sandbox_core", "_Core.kill_all"),
    "destroy: cgroup back to the pool or rmdir (Cgroup.release)":
        ("karotte.cgroups", "Cgroup.release"),
    "destroy: cgroup rmdir (Cgroup.destroy, when not pooled)":
        ("karotte.cgroups", "Cgroup.destroy"),
}
# The cgroup steps of the running backend (by cgroup version) that case_phases times.
SANDBOX_CGROUP_PHASES: dict[int, dict[str, tuple[str, str]]] = {
    1: {"create: cgroup mkdir + limits (create, when the pool is empty)":
            ("karotte.cgroups", "V1Backend.create"),
        "cgroup: kill_all (freeze, SIGKILL, thaw, wait empty)":
            ("karotte.cgroups.v1", "_V1Cgroup.kill_all"),
        "cgroup: freeze and wait FROZEN": ("karotte.cgroups.v1", "_V1Cgroup._freeze_until"),
        "cgroup: SIGKILL of listed tasks (_sigkill_members)":
            ("karotte.cgroups._base", "_sigkill_members"),
        "cgroup: thaw": ("karotte.cgroups.v1", "_V1Cgroup._thaw"),
        "cgroup: wait until empty": ("karotte.cgroups.v1", "_V1Cgroup._empty_within"),
        "cgroup: list tasks (cgroup.procs of each hierarchy)":
            ("karotte.cgroups", "Cgroup.pids")},
    2: {"create: cgroup mkdir + limits (create, when the pool is empty)":
            ("karotte.cgroups", "V2Backend.create"),
        "cgroup: kill_all (freeze, SIGKILL, thaw, wait empty)":
            ("karotte.cgroups.v2", "_V2Cgroup.kill_all")},
}
# The steps a sandbox on an image takes that one on the host's userland does not (the
# overlay itself init lays, inside "wait for READY"). scripts/bench_image_sandbox.py times
# them with SANDBOX_PHASES, on an image named by its source reference and by a name.
IMAGE_SANDBOX_PHASES: dict[str, tuple[str, str]] = {
    "create: image: resolve_root (the tree, its config and the lease)":
        ("karotte.imageroot", "resolve_root"),
    "create: image: the store's record of it (Store.open_image)":
        ("karotte.images.store", "Store.open_image"),
    "create: image: of which the config (parsed once per process, Store._image)":
        ("karotte.images.store", "Store._image"),
    "create: image: the tree's shared lock, the lease (Store._hold)":
        ("karotte.images.store", "Store._hold"),
    "create: plan, idmapped tree and CONFIG sent (_send_config)":
        ("karotte.sandbox_core", "_Core._send_config"),
    "create: image: idmapped tree (open_tree + mount_setattr, idmapped_tree)":
        ("karotte.imageroot", "idmapped_tree"),
    "create: image: of which each syscall through ctypes (_syscall)":
        ("karotte.imageroot", "_syscall"),
}
EPISODE_PHASES: dict[str, tuple[str, str]] = {
    "sandbox create": ("karotte.sandbox", "Sandbox.__init__"),
    "sandbox exec": ("karotte.sandbox", "Sandbox.exec"),
    "sandbox kill_all": ("karotte.sandbox", "Sandbox.kill_all"),
    "sandbox close": ("karotte.sandbox", "Sandbox.close"),
    "take_custody": ("karotte.episode", "take_custody"),
    "run_grader": ("karotte.episode", "run_grader"),
    "submission dir": ("karotte.custody", "private_dir"),
    "scan_and_copy": ("karotte.custody", "scan_and_copy"),
    "discard": ("karotte.custody", "Custody.discard"),
    "grader library": ("karotte.grading", "grader_library"),
    "hidden dir": ("karotte.grading", "private_dir"),
    "hidden files": ("karotte.grading", "write_files"),
    "serve": ("karotte.grading", "_serve"),
    "cgroup create": ("karotte.cgroups", "create"),
    "cgroup destroy": ("karotte.cgroups", "Cgroup.destroy"),
    "cgroup attach": ("karotte.native", "spawn_init"),
}


class PhaseTimer:
    """Wraps the functions and methods of a table (label -> (module, attribute)) with
    perf_counter_ns timers, restoring them on exit. A name that does not exist raises on
    entry, and a phase that no call reached raises on a clean exit: a name that moved
    must not leave its phase silently timing nothing."""

    def __init__(self, table: dict[str, tuple[str, str]]):
        self.table = table
        self.events: list[tuple[str, int, int]] = []
        self.calls = dict.fromkeys(table, 0)
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "PhaseTimer":
        try:
            for label, (module, attr) in self.table.items():
                owner, name = _owner(label, module, attr)
                original = owner.__dict__[name]
                self._saved.append((owner, name, original))
                setattr(owner, name, self._wrap(label, original))
        except BaseException:
            self._restore()
            raise
        return self

    def _wrap(self, label: str, fn):
        events, calls = self.events, self.calls
        func = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn

        def timed(*args, **kwargs):
            calls[label] += 1
            t0 = time.perf_counter_ns()
            try:
                return func(*args, **kwargs)
            finally:
                events.append((label, t0, time.perf_counter_ns()))
        return staticmethod(timed) if isinstance(fn, staticmethod) else timed

    def _restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def __exit__(self, exc_type, *exc) -> None:
        self._restore()
        never = [label for label, n in self.calls.items() if n == 0]
        if exc_type is None and never:
            raise RuntimeError(
                "no call reached these phases: " + "; ".join(
                    f"{label!r} ({'.'.join(self.table[label])})" for label in never)
                + ". Karotte no longer calls them there: update the table in "
                "scripts/benchlib.py")

    def take(self) -> list[tuple[str, int, int]]:
        out = list(self.events)
        self.events.clear()
        return out


def _owner(label: str, module: str, attr: str) -> tuple[object, str]:
    """The object whose __dict__ holds attr (a module, or a class for "Class.name")."""
    owner: object = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = vars(owner).get(part)
    if owner is None or name not in vars(owner):
        raise LookupError(f"phase {label!r}: {module}.{attr} does not exist; update the "
                          f"table in scripts/benchlib.py")
    return owner, name


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Stats:
    """Summary of one series of wall-clock samples, in milliseconds."""

    n: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, samples_ns: list[int]) -> "Stats":
        if not samples_ns:
            raise ValueError("no samples")
        ms = sorted(s / 1e6 for s in samples_ns)
        return cls(len(ms), statistics.median(ms), _quantile(ms, 0.10), _quantile(ms, 0.90),
                   ms[0], ms[-1])


def _quantile(sorted_ms: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_ms) == 1:
        return sorted_ms[0]
    pos = q * (len(sorted_ms) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


@dataclass
class Series:
    """One competitor or variant: its samples, or why it has none."""

    name: str
    what: str  # what exactly one sample times
    samples_ns: list[int] = field(default_factory=list)
    skipped: str | None = None  # the reason there are no numbers

    def to_json(self) -> dict:
        if self.skipped is not None or not self.samples_ns:
            return {"name": self.name, "what": self.what, "status": "skipped",
                    "reason": self.skipped or "nothing was measured"}
        return {"name": self.name, "what": self.what, "status": "ok",
                "stats": asdict(Stats.of(self.samples_ns)), "samples_ns": self.samples_ns}

    @property
    def median_ms(self) -> float | None:
        return None if self.skipped or not self.samples_ns else Stats.of(self.samples_ns).median_ms


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    value: str
    met: bool | None  # None: could not be measured here


# --------------------------------------------------------------------------- machine

def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def host_busy_seconds() -> float:
    """CPU seconds the whole host has been busy (all cores; guest time is in user)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class HostLoad:
    """CPU the whole host used while a case ran, and how much of it was not this
    benchmark's (its process and the children it reaped: sandboxes' inits and their
    commands, peers): other users of the machine, and kernel workers."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.busy0, self.own0 = host_busy_seconds(), self._own()
        self.load0 = os.getloadavg()[0]

    @staticmethod
    def _own() -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def done(self) -> dict:
        wall = time.monotonic() - self.t0
        busy, own = host_busy_seconds() - self.busy0, self._own() - self.own0
        return {"wall_seconds": round(wall, 3), "host_busy_cpu_seconds": round(busy, 3),
                "benchmark_cpu_seconds": round(own, 3),
                "other_cpu_share": round(max(0.0, busy - own) / (wall * os.cpu_count()), 3)
                if wall > 0 else None,
                "loadavg_1min_before": self.load0, "loadavg_1min_after": os.getloadavg()[0]}


def machine() -> dict:
    model = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "kernel": os.uname().release,
        "cpu_model": model,
        "cores": len(os.sched_getaffinity(0)),
        "mem_total_bytes": meminfo()["MemTotal"],
        "python": platform.python_version(),
        "cgroup_backend": repr(cgroups.detect()),
        "transparent_hugepage": thp,
        "euid": os.geteuid(),
        "peers": {name: _version(name) for name in ("bwrap", "runc", "unshare")},
        "karotte": _checkout(),
    }


def _checkout() -> dict:
    """The commit measured, and whether the code under test differs from it."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None
    changed = git("status", "--porcelain", "--", "karotte", "csrc", "rootfs")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "subject": git("log", "-1", "--format=%s"),
            "uncommitted_changes": changed.splitlines() if changed else []}


def _version(tool: str) -> str | None:
    path = shutil.which(tool)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{path} (version unknown: {exc})"
    first = (out.stdout or out.stderr or "?").splitlines()[0]
    return f"{path}: {first}"


# --------------------------------------------------------------------------- report

def print_json(result: dict, path: str | None) -> None:
    """result as indented JSON on stdout, and into the file at path where one is given."""
    print(json.dumps(result, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def machine_line(m: dict) -> str:
    return (f"- machine: {m['cpu_model']}, {m['cores']} cores, "
            f"{m['mem_total_bytes'] / GiB:.1f} GiB, Linux {m['kernel']}, Python {m['python']}")


def karotte_line(m: dict) -> str:
    k = m["karotte"]
    return (f"- karotte: commit {k['commit']} ({k['subject']})"
            + (f", with uncommitted changes: {', '.join(k['uncommitted_changes'])}"
               if k["uncommitted_changes"] else ""))


def load_line(case: dict) -> str:
    """The host's other load during a case, as a line of the summary."""
    h = case.get("host_load")
    if not h:
        return ""
    return (f"- host during this case: {h['wall_seconds']:.0f} s; CPU not used by the "
            f"benchmark's processes: {100 * (h['other_cpu_share'] or 0):.0f}% of "
            f"{os.cpu_count()} cores; load average {h['loadavg_1min_before']:.2f} -> "
            f"{h['loadavg_1min_after']:.2f}")


def render_cases_and_goals(lines: list[str], result: dict, cases, renderers) -> str:
    """The header lines, then each case's section, then the goals table."""
    for name in cases:
        if name in result["cases"]:
            lines += renderers[name](result["cases"][name])
    lines += ["## Goals", "", "| goal | target | measured | met |", "|---|---|---|---|"]
    for g in result["goals"]:
        met = "n/a" if g["met"] is None else ("met" if g["met"] else "NOT MET")
        lines.append(f"| {g['name']} | {g['target']} | {g['value']} | {met} |")
    lines.append(f"\n(total {result['seconds']:.0f} s)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main

def select_cases(ap: argparse.ArgumentParser, text: str, cases: tuple[str, ...]) -> list[str]:
    """--cases as a list; a usage error (exit 2) for a name not in cases."""
    selected = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(selected) - set(cases))
    if unknown:
        ap.error(f"unknown case(s) {','.join(unknown)}; choose from {','.join(cases)}")
    return selected


def main(argv: list[str] | None, *, doc: str, script: str, cases: tuple[str, ...],
         add_options: Callable[[argparse.ArgumentParser], None],
         plan: Callable[[argparse.ArgumentParser, argparse.Namespace, Callable],
                        tuple[dict, dict[str, Callable[[], dict]]]],
         goals: Callable[[dict], list[Goal]], render: Callable[[dict], str],
         facts: Callable[[], dict] | None = None) -> int:
    """A benchmark's command line: its own options (add_options), then --cases, --json
    and --quiet. plan(ap, args, log) checks the options and returns those to record and
    a runner per case; the selected cases run in order, each with the host's other load
    measured; facts() (what the cases set up, such as the image they ran on) joins the
    result; then the summary is printed and the JSON written."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(ap)
    ap.add_argument("--cases", default=",".join(cases),
                    help=f"comma-separated subset of {','.join(cases)}")
    ap.add_argument("--json", metavar="FILE", help="write every raw sample and the summary")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    selected = select_cases(ap, args.cases, cases)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    options, runners = plan(ap, args, log)
    result = {"schema": 1, "machine": machine(),
              "command": shlex.join([os.path.relpath(script, REPO)]
                                    + (argv if argv is not None else sys.argv[1:])),
              "options": {"quick": args.quick, **options, "cases": selected},
              "cases": {}}
    t0 = time.perf_counter()
    for number, name in enumerate(cases, 1):
        if name in selected:
            log(f"case {number}: {name}")
            load = HostLoad()
            result["cases"][name] = runners[name]()
            result["cases"][name]["host_load"] = load.done()
    result["seconds"] = time.perf_counter() - t0
    if facts is not None:
        result.update(facts())
    result["goals"] = [asdict(g) for g in goals(result["cases"])]
    text = render(result)
    print(text, end="")
    if args.json:
        result["summary_text"] = text
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
