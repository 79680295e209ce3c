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
              and after idle, from timers wrapped around Karotte's internal steps (names
              that may change: if one is gone the case says so instead of guessing).

A peer that is missing or fails on this host is reported as skipped with the reason,
never with a number. The benchmark needs what Karotte needs (root, or unprivileged
user namespaces with a delegated cgroup).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import mmap
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, REPO)

from karotte import cgroups, mounts  # noqa: E402
from karotte import sandbox as ksandbox  # noqa: E402
from karotte.sandbox import AsyncSandbox, Sandbox  # noqa: E402
from karotte.seccomp import compile_policy  # noqa: E402
from karotte.spec import GiB, MiB, SandboxSpec  # noqa: E402

TRUE = "/bin/true"
CASES = ("lifecycle", "exec", "big_parent", "density", "phases")

# The goals this benchmark reports on (ratios are Karotte / other).
GOAL_VS_BWRAP = 1.0  # lifecycle: faster than bwrap
GOAL_VS_FLOOR = 1.5  # lifecycle: within 1.5x of unshare
GOAL_EXEC_MS = 2.0  # exec: median under 2 ms
GOAL_BIG_PARENT = 1.2  # big_parent: within 1.2x of the small parent
GOAL_DENSITY = 500  # density: idle sandboxes held at once


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


class PeerFailed(Exception):
    """A peer sandbox tool ran but did not succeed; the message is its own words."""


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


# --------------------------------------------------------------------------- machine

def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


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


class HostLoad:
    """CPU the whole host used while a case ran, and how much of it was not this
    benchmark's (its process and the children it reaped: sandboxes' inits and their
    commands, peers): other users of the machine, and kernel workers."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.busy0, self.own0 = self._busy(), self._own()
        self.load0 = os.getloadavg()[0]

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest is in user

    @staticmethod
    def _own() -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def done(self) -> dict:
        wall = time.monotonic() - self.t0
        busy, own = self._busy() - self.busy0, self._own() - self.own0
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
        "mem_total_bytes": _meminfo()["MemTotal"],
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


# --------------------------------------------------------------------------- competitors

def _rootfs_layout() -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """What Karotte's default mount plan shows of the host: ([(kind, path)] of the
    userland (symlink target or bind), host /etc entries that exist, generated /etc
    file names). Peers get the same, so they build as many mounts as Karotte does."""
    rootfs = mounts.default_rootfs()
    userland = []
    for path in rootfs.userland:
        if os.path.islink(path):
            userland.append(("symlink", path))
        elif os.path.isdir(path):
            userland.append(("bind", path))
    host_etc = [n for n in rootfs.host_etc if os.path.exists(f"/etc/{n}")]
    generated = [name for name, _ in rootfs.etc_files] + ["hostname", "hosts"]
    return userland, host_etc, generated


class Competitor:
    """One way to create a sandbox, run /bin/true in it and destroy it."""

    name = ""
    describe = ""

    def prepare(self) -> str | None:
        """Set up; the reason it cannot run here, or None."""
        return None

    def run_once(self) -> int:
        """One timed run: wall-clock nanoseconds. PeerFailed if it did not succeed."""
        raise NotImplementedError

    def cleanup(self) -> None:
        pass


class KarotteLifecycle(Competitor):
    name = "karotte"
    describe = "Sandbox(SandboxSpec()) + exec /bin/true + close, in this process"

    def run_once(self) -> int:
        t0 = time.perf_counter_ns()
        with Sandbox(SandboxSpec()) as sb:
            r = sb.exec([TRUE])
        t1 = time.perf_counter_ns()
        if r.exit_code != 0:
            raise RuntimeError(f"karotte: /bin/true ended with {r}")
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


class SubprocessPeer(Competitor):
    """A peer run as `subprocess.run(argv)` from this driver."""

    tool = ""

    def __init__(self):
        self.path: str | None = None
        self.argv: list[str] = []
        self.pass_fds: tuple[int, ...] = ()

    def prepare(self) -> str | None:
        self.path = shutil.which(self.tool)
        if self.path is None:
            return f"{self.tool} not found on PATH"
        return None

    def _run(self, argv: list[str], pass_fds=()) -> int:
        t0 = time.perf_counter_ns()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, pass_fds=pass_fds)
        t1 = time.perf_counter_ns()
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            raise PeerFailed(f"`{shlex.join(argv)}` exited {proc.returncode}: "
                             f"{err or '(no stderr)'}")
        return t1 - t0

    def run_once(self) -> int:
        return self._run(self.argv, self.pass_fds)


class NoSandbox(SubprocessPeer):
    name = "no sandbox (control)"
    describe = "subprocess.run(['/bin/true']): the driver's own fork+exec+wait cost"

    def prepare(self) -> str | None:
        self.path = TRUE
        self.argv = [TRUE]
        return None


class Unshare(SubprocessPeer):
    name = "unshare (floor)"
    tool = "unshare"
    describe = "unshare -Urpfmn --mount-proc /bin/true: namespaces and /proc only"

    def prepare(self) -> str | None:
        why = super().prepare()
        if why:
            return why
        self.argv = [self.path, "-Urpfmn", "--mount-proc", TRUE]
        return None


class Bwrap(SubprocessPeer):
    name = "bwrap"
    tool = "bwrap"
    describe = ("bwrap --unshare-all --unshare-user --die-with-parent, Karotte's mounts "
                "(ro /usr, merged-usr symlinks, host /etc entries ro, --proc, --dev, tmpfs "
                "/tmp /workspace /home/agent), uid 1000, Karotte's seccomp filter")

    def __init__(self):
        super().__init__()
        self._filter_path: str | None = None
        self._seccomp = True

    def prepare(self) -> str | None:
        why = super().prepare()
        if why:
            return why
        userland, host_etc, generated = _rootfs_layout()
        argv = [self.path, "--unshare-all", "--unshare-user", "--die-with-parent",
                "--uid", "1000", "--gid", "1000", "--hostname", "karotte"]
        for kind, path in userland:
            if kind == "symlink":
                argv += ["--symlink", os.readlink(path), path]
            else:
                argv += ["--ro-bind", path, path]
        # Karotte writes passwd, group, nsswitch.conf, resolv.conf, hostname and hosts
        # as files of its own; bwrap binds the host's instead (a mount each, as Karotte).
        for name in sorted(set(host_etc) | set(generated)):
            argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                 "--tmpfs", "/workspace", "--tmpfs", "/home/agent", "--dir", "/root"]
        try:
            filt = compile_policy()
            fd, self._filter_path = tempfile.mkstemp(prefix="karotte-bench-seccomp-")
            os.write(fd, filt)
            os.close(fd)
        except Exception as exc:  # noqa: BLE001 - reported, bwrap runs without it
            self._seccomp = False
            self.describe += f" (without seccomp: {exc})"
        self.argv = argv
        return None

    def run_once(self) -> int:
        if not self._seccomp:
            return self._run(self.argv + [TRUE])
        # bwrap reads the filter to EOF, so each run gets a fresh open file description.
        fd = os.open(self._filter_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return self._run(self.argv + ["--seccomp", str(fd), TRUE], pass_fds=(fd,))
        finally:
            os.close(fd)

    def cleanup(self) -> None:
        if self._filter_path:
            os.unlink(self._filter_path)


class Runc(SubprocessPeer):
    name = "runc"
    tool = "runc"
    describe = ("runc run of an OCI bundle: read-only empty rootfs with Karotte's binds "
                "and tmpfs, user namespace (0 -> 0x70000000, 65536 ids), uid 1000, "
                "Karotte's cgroup limits; no seccomp profile")

    def __init__(self):
        super().__init__()
        self.dir: str | None = None
        self._seq = 0

    def prepare(self) -> str | None:
        why = super().prepare()
        if why:
            return why
        self.dir = tempfile.mkdtemp(prefix="karotte-bench-runc-")
        # The sandbox's root is a mapped uid that owns nothing: it must traverse the bundle.
        os.chmod(self.dir, 0o755)
        rootfs = os.path.join(self.dir, "rootfs")
        os.mkdir(rootfs)
        for mountpoint in ("proc", "dev"):  # the root is read-only: runc cannot make them
            os.mkdir(os.path.join(rootfs, mountpoint))
        userland, host_etc, generated = _rootfs_layout()
        mnts = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "mode=755", "size=1024k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "nodev", "mode=1777", "size=262144k"]},
        ]
        for kind, path in userland:
            if kind == "symlink":
                os.symlink(os.readlink(path), rootfs + path)
            else:
                os.makedirs(rootfs + path)
                mnts.append({"destination": path, "type": "bind", "source": path,
                             "options": ["rbind", "ro", "nosuid", "nodev"]})
        os.makedirs(rootfs + "/etc")
        for name in sorted(set(host_etc) | set(generated)):
            src = f"/etc/{name}"
            if not os.path.exists(src):
                continue
            if os.path.isdir(src):
                os.makedirs(rootfs + src)
            else:
                open(rootfs + src, "w").close()
            mnts.append({"destination": src, "type": "bind", "source": src,
                         "options": ["rbind", "ro", "nosuid", "nodev"]})
        for path, size in (("/tmp", "262144k"), ("/workspace", "1048576k"),
                           ("/home/agent", "65536k")):
            os.makedirs(rootfs + path)
            mnts.append({"destination": path, "type": "tmpfs", "source": "tmpfs",
                         "options": ["nosuid", "nodev", "mode=1777", f"size={size}"]})
        os.makedirs(rootfs + "/root")
        spec = SandboxSpec()
        base = ksandbox.DEFAULT_UID_BASE
        config = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False, "user": {"uid": 1000, "gid": 1000},
                "args": [TRUE], "env": ["PATH=/usr/bin:/bin"], "cwd": "/",
                "capabilities": {"bounding": [], "effective": [], "permitted": [],
                                 "ambient": []},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": spec.nofile, "soft": spec.nofile}],
                "noNewPrivileges": True,
            },
            "root": {"path": "rootfs", "readonly": True},
            "hostname": spec.hostname,
            "mounts": mnts,
            "linux": {
                "uidMappings": [{"containerID": 0, "hostID": base, "size": 65536}],
                "gidMappings": [{"containerID": 0, "hostID": base, "size": 65536}],
                "namespaces": [{"type": t} for t in
                               ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")],
                "resources": {
                    "memory": {"limit": spec.memory, "swap": spec.memory},
                    "pids": {"limit": spec.pids},
                    "cpu": {"quota": round(spec.cpus * 100_000), "period": 100_000},
                },
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list",
                                "/proc/sched_debug"],
                "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                                  "/proc/sysrq-trigger"],
            },
        }
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        os.mkdir(os.path.join(self.dir, "state"))
        return None

    def run_once(self) -> int:
        self._seq += 1
        cid = f"kbench-{os.getpid()}-{self._seq}"
        argv = [self.path, "--root", os.path.join(self.dir, "state"), "run",
                "--bundle", self.dir, cid]
        try:
            return self._run(argv)
        except PeerFailed:
            # A failed run may leave its state and cgroup behind: remove them.
            subprocess.run([self.path, "--root", os.path.join(self.dir, "state"), "delete",
                            "--force", cid], capture_output=True)
            raise

    def cleanup(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _timed_calls(fn: Callable[[], int], n: int) -> list[int]:
    return [fn() for _ in range(n)]


# --------------------------------------------------------------------------- case 1

def case_lifecycle(runs: int, warmup: int, log) -> dict:
    competitors: list[Competitor] = [KarotteLifecycle(), Bwrap(), Unshare(), Runc(),
                                     NoSandbox(), KarotteAfterIdle(), KarotteNoPool()]
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
        for i in range(runs):
            # Round-robin with a rotating start: no competitor always runs first or
            # always follows the same other one.
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
                log(f"  lifecycle: {i + 1}/{runs} rounds")
    finally:
        for c in competitors:
            c.cleanup()
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
    m = _meminfo()
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
    before = _meminfo()
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
        after = _meminfo()
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
    end = _meminfo()
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

class PhaseTimer:
    """Wraps named functions and methods with perf_counter_ns timers, restoring them on
    exit. Names that no longer exist are listed in `missing`, not guessed at."""

    def __init__(self, targets: list[tuple[str, object, str]]):
        self.targets = targets  # (label, owner, attribute)
        self.events: list[tuple[str, int, int]] = []
        self.missing: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> "PhaseTimer":
        for label, owner, attr in self.targets:
            if isinstance(owner, type):  # only what the class defines, not inherited
                original = owner.__dict__.get(attr)
            else:
                original = getattr(owner, attr, None)
            if original is None:
                self.missing.append(label)
                continue
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._wrap(label, original))
        return self

    def _wrap(self, label: str, fn):
        events = self.events
        func = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return func(*args, **kwargs)
            finally:
                events.append((label, t0, time.perf_counter_ns()))
        return staticmethod(timed) if isinstance(fn, staticmethod) else timed

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)

    def take(self) -> list[tuple[str, int, int]]:
        out = list(self.events)
        self.events.clear()
        return out


def _phase_targets() -> list[tuple[str, object, str]]:
    core = ksandbox._Core
    targets = [
        ("create: cgroup name (leaf_name)", cgroups, "leaf_name"),
        ("create: cgroup backend probe (detect)", cgroups, "detect"),
        ("create: cgroup from the pool or new, limits written (acquire)", cgroups, "acquire"),
        ("create: cgroup mkdir + limits (create, when the pool is empty)", cgroups, "create"),
        ("create: clone3 of init, from a thread in the sandbox's cgroup (spawn_init)",
         ksandbox.native, "spawn_init"),
        ("create: uid/gid maps (_write_proc)", ksandbox, "_write_proc"),
        ("create: config message build", ksandbox, "_config_message"),
        ("channel send", core, "send"),
        ("create: whole start() before waiting", core, "start"),
        ("create: READY receive", core, "recv_with_fds"),
        ("create: finish_start", core, "finish_start"),
        ("exec: begin_exec (cgroup peak reset, oom count, pipes, send)", core, "begin_exec"),
        ("exec: wait for exit (_drive_sync)", ksandbox, "_drive_sync"),
        ("exec: end_exec (cgroup peak and oom reads)", core, "end_exec"),
        ("destroy: whole", core, "destroy"),
        ("destroy: kill_all (cgroup kill + reap init)", core, "kill_all"),
        ("destroy: cgroup back to the pool or rmdir (Cgroup.release)", cgroups.Cgroup,
         "release"),
        ("destroy: cgroup rmdir (Cgroup.destroy, when not pooled)", cgroups.Cgroup, "destroy"),
    ]
    targets.append(("cgroup: SIGKILL of listed tasks (_sigkill_members)", cgroups,
                    "_sigkill_members"))
    for cls in (cgroups.Cgroup, *cgroups.Cgroup.__subclasses__()):
        for attr, what in (("kill_all", "kill_all (freeze, SIGKILL, thaw, wait empty)"),
                           ("_freeze_until", "freeze and wait FROZEN"),
                           ("_thaw", "thaw"),
                           ("_empty_within", "wait until empty"),
                           ("pids", "list tasks (cgroup.procs of each hierarchy)")):
            if attr in cls.__dict__ and not (cls is cgroups.Cgroup and attr == "kill_all"):
                targets.append((f"cgroup: {what}", cls, attr))
    return targets


def _phase_run(events: list[tuple[str, int, int]], t0: int, t1: int, t2: int,
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


def _instrumented_cycles(timer: PhaseTimer, runs: int, idle: float) -> dict[str, list[int]]:
    totals: dict[str, list[int]] = {}
    for _ in range(runs):
        time.sleep(idle)
        t0 = time.perf_counter_ns()
        sb = Sandbox(SandboxSpec())
        t1 = time.perf_counter_ns()
        sb.exec([TRUE])
        t2 = time.perf_counter_ns()
        sb.close()
        t3 = time.perf_counter_ns()
        for label, ns in _phase_run(timer.take(), t0, t1, t2, t3).items():
            totals.setdefault(label, []).append(ns)
    return totals


def case_phases(runs: int, log) -> dict:
    """Back-to-back cycles, then a quarter as many after KarotteAfterIdle's pause: the
    two columns show which step the pause makes slow."""
    try:
        targets = _phase_targets()
    except AttributeError as exc:
        return {"skipped": f"Karotte's internals changed, cannot time phases: {exc}"}
    idle_runs = max(3, runs // 4)
    with PhaseTimer(targets) as timer:
        for _ in range(3):
            with Sandbox(SandboxSpec()) as sb:
                sb.exec([TRUE])
        timer.take()
        back_to_back = _instrumented_cycles(timer, runs, 0.0)
        after_idle = _instrumented_cycles(timer, idle_runs, KarotteAfterIdle.IDLE_SECONDS)
    log(f"  phases: {runs} + {idle_runs} instrumented create/exec/destroy cycles done")
    return {"runs": runs, "idle_runs": idle_runs, "idle_seconds": KarotteAfterIdle.IDLE_SECONDS,
            "missing_names": timer.missing,
            "phases": {label: asdict(Stats.of(ns)) for label, ns in sorted(back_to_back.items())},
            "phases_after_idle": {label: asdict(Stats.of(ns))
                                  for label, ns in sorted(after_idle.items())},
            "samples_ns": back_to_back, "samples_after_idle_ns": after_idle,
            "note": "medians of each phase over the runs; phases nest (a step's time "
                    "includes the steps named under it); the timers add about 1 us each"}


# --------------------------------------------------------------------------- report

def _fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


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
        rows.append(f"| {s['name']} | {_fmt_ms(st['median_ms'])} | {_fmt_ms(st['p10_ms'])} | "
                    f"{_fmt_ms(st['p90_ms'])} | {st['n']} | {ratio} |")
    return rows


def select_cases(ap: argparse.ArgumentParser, text: str, cases: tuple[str, ...]) -> list[str]:
    """--cases as a list; a usage error (exit 2) for a name not in cases."""
    selected = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(selected) - set(cases))
    if unknown:
        ap.error(f"unknown case(s) {','.join(unknown)}; choose from {','.join(cases)}")
    return selected


def load_line(case: dict) -> str:
    """The host's other load during a case, as a line of the summary."""
    h = case.get("host_load")
    if not h:
        return ""
    return (f"- host during this case: {h['wall_seconds']:.0f} s; CPU not used by the "
            f"benchmark's processes: {100 * (h['other_cpu_share'] or 0):.0f}% of "
            f"{os.cpu_count()} cores; load average {h['loadavg_1min_before']:.2f} -> "
            f"{h['loadavg_1min_after']:.2f}")


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
    if "skipped" in ph:
        return ["## 5. phases", "", f"skipped: {ph['skipped']}", ""]
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
        lines.append(f"| {label} | {_fmt_ms(st['median_ms'])} | {_fmt_ms(st['p10_ms'])} | "
                     f"{_fmt_ms(st['p90_ms'])} | {_fmt_ms(idle and idle['median_ms'])} |")
    if ph["missing_names"]:
        lines += ["", f"not timed (names gone from Karotte): {', '.join(ph['missing_names'])}"]
    return lines + ["", load_line(ph), ""]


def render(result: dict) -> str:
    m = result["machine"]
    peers = "; ".join(f"{name}: {v or 'missing'}" for name, v in m["peers"].items())
    k = m["karotte"]
    lines = [f"# Karotte sandbox benchmark, {m['date']}", "",
             f"- machine: {m['cpu_model']}, {m['cores']} cores, "
             f"{m['mem_total_bytes'] / GiB:.1f} GiB, Linux {m['kernel']}, Python {m['python']}",
             f"- cgroups: {m['cgroup_backend']}; transparent hugepages: "
             f"{m['transparent_hugepage']}",
             f"- peers: {peers}",
             f"- karotte: commit {k['commit']} ({k['subject']})"
             + (f", with uncommitted changes: {', '.join(k['uncommitted_changes'])}"
                if k["uncommitted_changes"] else ""),
             f"- command: `{result['command']}`", ""]
    renderers = {"lifecycle": _render_lifecycle, "exec": _render_exec,
                 "big_parent": _render_big_parent, "density": _render_density,
                 "phases": _render_phases}
    return render_cases_and_goals(lines, result, CASES, renderers)


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a few runs of every case (CI smoke), 0.5 GiB resident, 10 sandboxes")
    ap.add_argument("--runs", type=int,
                    help="runs per competitor in case 1 (default 200, quick 5); case 2 runs "
                         "10x as many execs, cases 3 and 5 half as many cycles")
    ap.add_argument("--sandboxes", type=int, help="idle sandboxes to hold in case 4 "
                    "(default 1000, quick 10)")
    ap.add_argument("--parent-gib", type=float,
                    help="resident memory of the big parent in case 3 (default 4, quick 0.5)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--json", metavar="FILE", help="write every raw sample and the summary")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)

    selected = select_cases(ap, args.cases, CASES)
    runs = args.runs or (5 if args.quick else 200)
    if runs < 1:
        ap.error("--runs must be at least 1")
    sandboxes = args.sandboxes or (10 if args.quick else 1000)
    parent = int((args.parent_gib or (0.5 if args.quick else 4.0)) * GiB)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    result = {"schema": 1, "machine": machine(),
              "command": shlex.join([os.path.relpath(__file__, REPO)]
                                    + (argv if argv is not None else sys.argv[1:])),
              "options": {"quick": args.quick, "runs": runs, "sandboxes": sandboxes,
                          "parent_bytes": parent, "cases": selected},
              "cases": {}}
    t0 = time.perf_counter()
    warmup = 1 if args.quick else 5
    runners = {
        "lifecycle": lambda: case_lifecycle(runs, warmup, log),
        "exec": lambda: case_exec(runs * 10, max(5, runs * 10 // 4), warmup * 4, log),
        "big_parent": lambda: case_big_parent(max(3, runs // 2), max(3, runs // 10), parent,
                                              log),
        "density": lambda: case_density(sandboxes, log),
        "phases": lambda: case_phases(max(3, runs // 2), log),
    }
    return run_cases(CASES, selected, runners, result, t0, goals, render, args.json, log)


def render_cases_and_goals(lines: list[str], result: dict, cases, renderers) -> str:
    """The header lines, then each case's section, then the goals table (shared by
    bench_sandbox and bench_episode)."""
    for name in cases:
        if name in result["cases"]:
            lines += renderers[name](result["cases"][name])
    lines += ["## Goals", "", "| goal | target | measured | met |", "|---|---|---|---|"]
    for g in result["goals"]:
        met = "n/a" if g["met"] is None else ("met" if g["met"] else "NOT MET")
        lines.append(f"| {g['name']} | {g['target']} | {g['value']} | {met} |")
    lines.append(f"\n(total {result['seconds']:.0f} s)")
    return "\n".join(lines) + "\n"


def run_cases(cases, selected, runners, result: dict, t0: float, goals, render,
              json_path: str | None, log) -> int:
    """Run the selected cases in order, each with the host's other load measured, then
    print the summary and write the JSON (shared by bench_sandbox and bench_episode)."""
    for number, name in enumerate(cases, 1):
        if name in selected:
            log(f"case {number}: {name}")
            load = HostLoad()
            result["cases"][name] = runners[name]()
            result["cases"][name]["host_load"] = load.done()
    result["seconds"] = time.perf_counter() - t0
    result["goals"] = [asdict(g) for g in goals(result["cases"])]
    text = render(result)
    print(text, end="")
    if json_path:
        result["summary_text"] = text
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
