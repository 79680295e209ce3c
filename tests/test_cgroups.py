"""karotte.cgroups on the real kernel: one specification, run against each backend.

Every test runs against v1 and v2 where the host has them. On our cgroup v1 machines the
v2 cases skip; the VM lane runs them (`pytest -m cgroup2` in a guest with a unified
hierarchy, KAROTTE_CGROUP_PARENT set to a delegated cgroup with controllers enabled).

Processes start with a pipe between them and their code, so they are inside the cgroup
before they run a line of it. Each test's cgroups are destroyed whatever happens, and the
test fails if a directory is left in any hierarchy.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from karotte import cgroups
from karotte.cgroups import CgroupLimits
from karotte.cgroups._mountinfo import _parse_mountinfo
from karotte.errors import CgroupError, HostUnsupported

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = {1: "cgroup v1 hierarchies memory,pids,cpu,cpuacct,freezer",
         2: "cgroup v2 with memory,pids,cpu controllers; run by the VM lane"}


def _backend_or_skip(version: int) -> cgroups.Backend:
    try:
        return cgroups.backend(version)
    except HostUnsupported as e:
        pytest.skip(f"needs {NEEDS[version]}; here: {str(e).split(';')[0]}")


@pytest.fixture(params=[pytest.param(1, id="v1"),
                        pytest.param(2, id="v2", marks=pytest.mark.cgroup2)])
def backend(request) -> cgroups.Backend:
    return _backend_or_skip(request.param)


# For behaviour only one version has: the same fixture, that version only.
v2_only = pytest.mark.parametrize(
    "backend", [pytest.param(2, id="v2", marks=pytest.mark.cgroup2)], indirect=True)
v1_only = pytest.mark.parametrize("backend", [pytest.param(1, id="v1")], indirect=True)


class Lab:
    """Cgroups and child processes of one test; close() removes all of them."""

    def __init__(self, backend: cgroups.Backend):
        self.backend = backend
        self.cgroups: list[cgroups.Cgroup] = []
        self.procs: list[subprocess.Popen] = []
        self._buffers: dict[int, bytes] = {}

    def cgroup(self, memory: int = 256 * MiB, pids: int = 64, cpus: float = 1.0,
               tag: str = "test") -> cgroups.Cgroup:
        cg = self.backend.create(cgroups.leaf_name(tag), CgroupLimits(memory, pids, cpus))
        self.cgroups.append(cg)
        return cg

    def start(self, cg: cgroups.Cgroup, code: str, prefix: tuple[str, ...] = (),
              args: tuple[str, ...] = ()) -> subprocess.Popen:
        """Run Python `code` in a child that is in `cg` before its first line runs."""
        r, w = os.pipe()
        src = f"import os\nos.read({r}, 1)\nos.close({r})\n" + textwrap.dedent(code)
        try:
            proc = subprocess.Popen([*prefix, sys.executable, "-c", src, *args], pass_fds=(r,),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        finally:
            os.close(r)
        self.procs.append(proc)
        try:
            cg.add(proc.pid)
        except BaseException:
            os.close(w)
            proc.kill()
            raise
        os.write(w, b"x")
        os.close(w)
        return proc

    def line(self, proc: subprocess.Popen, timeout: float = 60.0) -> str:
        """The next line the child prints; fails the test instead of hanging."""
        fd = proc.stdout.fileno()
        buf = self._buffers.get(fd, b"")
        deadline = time.monotonic() + timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                pytest.fail(f"no line from the child within {timeout}s (got {buf!r})")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError(f"child closed stdout (got {buf!r}, exit {proc.wait()})")
            buf += chunk
        line, _, self._buffers[fd] = buf.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        errors: list[BaseException] = []
        for cg in self.cgroups:
            try:
                cg.destroy()
            except Exception as e:
                errors.append(e)
                for path in cg.paths:
                    try:
                        cgroups.remove_stale(path)
                    except Exception as e2:
                        errors.append(e2)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
        left = [p for cg in self.cgroups for p in cg.paths if os.path.exists(p)]
        assert not errors and not left, f"cleanup failed: {errors}; left behind: {left}"


@pytest.fixture
def lab(backend):
    lab = Lab(backend)
    try:
        yield lab
    finally:
        lab.close()


def exited(pidfd: int, timeout: float) -> bool:
    """Whether the process behind a pidfd ended (a pidfd polls readable at exit)."""
    return bool(select.select([pidfd], [], [], timeout)[0])


def proc_state(pid: int) -> str:
    stat = open(f"/proc/{pid}/stat").read()
    return stat[stat.rindex(")") + 2]


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- backend choice

def test_detect_prefers_v2_and_falls_back_to_v1():
    try:
        cgroups.backend(2)
        expected = 2
    except HostUnsupported:
        expected = 1
    assert cgroups.detect().version == expected


def test_limits_are_validated():
    for bad in (dict(memory=0, pids=1, cpus=1.0), dict(memory=MiB, pids=-1, cpus=1.0),
                dict(memory=MiB, pids=1, cpus=0.0), dict(memory=MiB, pids=1, cpus=float("nan"))):
        with pytest.raises(ValueError):
            CgroupLimits(**bad)


def test_mountinfo_co_mounted_cpu_cpuacct_and_escaped_paths_are_understood():
    # Other hosts co-mount cpu and cpuacct; mount points with spaces come octal-escaped.
    text = (
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
        "33 31 0:30 /lxc/c1 /sys/fs/cgroup/my\\040mem rw - cgroup cgroup rw,memory\n"
        "34 31 0:29 / /mnt/again rw - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:31 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n"
        "36 31 0:32 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
        "37 23 0:5 / /dev rw - devtmpfs udev rw\n")
    known = frozenset({"cpu", "cpuacct", "memory", "pids", "freezer"})
    mounts = {m.point: m for m in _parse_mountinfo(text, known)}
    assert set(mounts) == {"/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/my mem",
                           "/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified"}
    assert mounts["/sys/fs/cgroup/cpu,cpuacct"].controllers == {"cpu", "cpuacct"}
    assert mounts["/sys/fs/cgroup/systemd"].controllers == set()
    assert mounts["/sys/fs/cgroup/unified"].fstype == "cgroup2"
    mem = mounts["/sys/fs/cgroup/my mem"]
    assert mem.dir_of("/lxc/c1/job") == "/sys/fs/cgroup/my mem/job"
    with pytest.raises(CgroupError, match="outside"):
        mem.dir_of("/other")


# --------------------------------------------------------------------------- names and errors

@pytest.mark.parametrize("name", ["sandbox-1", "karotte-", "karotte-a/b", "karotte-..",
                                  "karotte-x\n", "", "../karotte-x"])
def test_create_rejects_a_name_gc_could_not_find(backend, name):
    made = None
    try:
        with pytest.raises(ValueError, match="karotte-"):
            made = backend.create(name, CgroupLimits(64 * MiB, 8, 1.0))
    finally:
        if made is not None:
            made.destroy()


def test_leaf_name_names_a_live_creator():
    name = cgroups.leaf_name("grader")
    assert name.startswith(f"karotte-{os.getpid()}.") and name.endswith("-grader")
    assert cgroups.creator_alive(name)
    assert cgroups.leaf_name() != cgroups.leaf_name()
    with pytest.raises(ValueError):
        cgroups.leaf_name("bad/tag")


def test_adding_a_dead_process_names_the_file_and_errno(lab):
    cg = lab.cgroup()
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(CgroupError, match=r"cgroup\.procs.*ESRCH"):
        cg.add(gone.pid)


def test_creating_under_a_missing_parent_names_the_path(backend):
    with pytest.raises(CgroupError, match=r"karotte-no-such-parent.*ENOENT"):
        backend.create(cgroups.leaf_name(), CgroupLimits(64 * MiB, 8, 1.0),
                       parent="/karotte-no-such-parent")


# --------------------------------------------------------------------------- limits

def test_limits_are_written_to_the_kernel(lab):
    cg = lab.cgroup(memory=96 * MiB, pids=17, cpus=0.25)

    def read(name: str) -> str:
        [value] = {open(os.path.join(p, name)).read().strip()
                   for p in cg.paths if os.path.exists(os.path.join(p, name))}
        return value

    if cg.version == 2:
        assert read("memory.max") == str(96 * MiB)
        assert read("memory.oom.group") == "1"
        assert read("cpu.max") == "25000 100000"
        assert cg.swap_enforced == os.path.exists(os.path.join(cg.paths[0], "memory.swap.max"))
        if cg.swap_enforced:
            assert read("memory.swap.max") == "0"
    else:
        assert read("memory.limit_in_bytes") == str(96 * MiB)
        assert read("cpu.cfs_quota_us") == "25000"
        assert read("cpu.cfs_period_us") == "100000"
        assert cg.swap_enforced == any(
            os.path.exists(os.path.join(p, "memory.memsw.limit_in_bytes")) for p in cg.paths)
        if cg.swap_enforced:
            assert read("memory.memsw.limit_in_bytes") == str(96 * MiB)
    assert read("pids.max") == "17"


def test_RES_MEM_01_memory_limit_oom_kills_and_is_counted(lab):
    cg = lab.cgroup(memory=64 * MiB)
    proc = lab.start(cg, "b = b'x' * (256 << 20)\nprint('survived', flush=True)\n")
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert cg.oom_kills() >= 1
    assert cg.memory_peak() is None or cg.memory_peak() <= 64 * MiB


@pytest.mark.cgroup2
def test_a_nested_cgroup_is_bounded_by_its_parents_limit(lab):
    # How a grader's untrusted runs sit beneath the grader: the parent holds no
    # processes (v2's rule), its limit covers every child.
    parent = lab.cgroup(memory=64 * MiB)
    child = lab.backend.create(cgroups.leaf_name("run"), CgroupLimits(1024 * MiB, 64, 1.0),
                               parent=parent)
    try:
        assert all(os.path.dirname(c) in parent.paths for c in child.paths)
        proc = lab.start(child, "b = b'x' * (256 << 20)\nprint('survived', flush=True)\n")
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert parent.oom_kills() + child.oom_kills() >= 1
    finally:
        child.destroy()
    assert not any(os.path.exists(p) for p in child.paths)


@pytest.mark.cgroup2
@v2_only
def test_RES_MEM_01_oom_kills_the_whole_group_on_v2(lab):
    cg = lab.cgroup(memory=64 * MiB)
    bystander = lab.start(cg, "print('up', flush=True)\nimport time\ntime.sleep(600)\n")
    assert lab.line(bystander) == "up"
    hog = lab.start(cg, "b = b'x' * (256 << 20)\n")
    assert hog.wait(timeout=60) == -signal.SIGKILL
    assert bystander.wait(timeout=30) == -signal.SIGKILL  # memory.oom.group=1


# A private mount namespace holds the tmpfs, so nothing is left on the host's mounts.
PRIVATE_TMPFS = ("unshare", "-m", "--propagation", "private")
WRITE_TMPFS = """
import os, subprocess, sys
mnt = sys.argv[1]
subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1g', 'karotte-test', mnt], check=True)
fd = os.open(os.path.join(mnt, 'f'), os.O_WRONLY | os.O_CREAT, 0o600)
chunk = b'x' * (1 << 20)
for mib in range(1, {mib} + 1):
    os.write(fd, chunk)  # 1 MiB at a time: the process itself stays small
    print(mib, flush=True)
print('done', flush=True)
sys.stdin.read()
"""


def _needs_root_for_mounts():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs in a private mount namespace needs root")


def test_RES_MEM_01_tmpfs_file_pages_count_toward_the_cgroup(lab, tmp_path):
    _needs_root_for_mounts()
    cg = lab.cgroup(memory=256 * MiB)
    proc = lab.start(cg, WRITE_TMPFS.format(mib=64), prefix=PRIVATE_TMPFS,
                     args=(str(tmp_path),))
    while lab.line(proc) != "done":
        pass
    peak = cg.memory_peak()
    if peak is None:  # v2 before Linux 5.19: no memory.peak; memory.current says the same
        peak = int(open(os.path.join(cg.paths[0], "memory.current")).read())
    assert peak >= 64 * MiB


def test_RES_MEM_01_tmpfs_cannot_hold_more_than_the_memory_limit(lab, tmp_path):
    _needs_root_for_mounts()
    cg = lab.cgroup(memory=64 * MiB)
    proc = lab.start(cg, WRITE_TMPFS.format(mib=256), prefix=PRIVATE_TMPFS,
                     args=(str(tmp_path),))
    written = 0
    try:
        while (line := lab.line(proc)) != "done":
            written = int(line)
    except EOFError:
        pass
    assert written < 64
    assert proc.wait(timeout=30) != 0


def test_RES_FORK_01_pids_max_makes_fork_fail_with_eagain(lab):
    cg = lab.cgroup(pids=16)
    proc = lab.start(cg, """
        import errno, os, time
        children = 0
        while children < 1000:
            try:
                pid = os.fork()
            except OSError as e:
                print(errno.errorcode[e.errno], children, flush=True)
                break
            if pid == 0:
                time.sleep(600)
                os._exit(0)
            children += 1
        time.sleep(600)
        """)
    err, children = lab.line(proc).split()
    assert err == "EAGAIN"
    assert int(children) == 15  # 16 tasks: the parent and 15 children
    assert len(cg.pids()) == 16


def test_cpu_max_throttles_a_busy_loop(lab):
    # Two spinning processes could use both cores of a small host; the limit is half a CPU.
    cg = lab.cgroup(cpus=0.5)
    proc = lab.start(cg, """
        import os
        print('spinning', flush=True)
        os.fork()
        while True:
            pass
        """)
    assert lab.line(proc) == "spinning"
    time.sleep(0.3)
    cpu0, t0 = cg.cpu_seconds(), time.monotonic()
    time.sleep(1.0)
    rate = (cg.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    assert 0.05 < rate < 0.5 * 1.4, f"{rate:.2f} CPUs used under a 0.5 CPU limit"


def test_memory_peak_and_its_reset(lab):
    cg = lab.cgroup()
    proc = lab.start(cg, "b = b'x' * (48 << 20)\nprint('held', flush=True)\nimport time\n"
                         "time.sleep(600)\n")
    assert lab.line(proc) == "held"
    peak = cg.memory_peak()
    assert peak is None or peak >= 48 * MiB
    cg.kill_all()
    cg.reset_memory_peak()
    after = cg.memory_peak()
    if cg.peak_resettable:
        assert after is not None and after < 48 * MiB
    else:
        assert after is None  # v2 before Linux 6.12 cannot reset: unknown, not stale


def test_freeze_stops_cpu_use_and_thaw_resumes_it(lab):
    cg = lab.cgroup(cpus=0.5)
    proc = lab.start(cg, "print('spinning', flush=True)\nwhile True:\n    pass\n")
    assert lab.line(proc) == "spinning"
    cg.freeze()
    frozen_at = cg.cpu_seconds()
    time.sleep(0.5)
    assert cg.cpu_seconds() - frozen_at < 0.02
    cg.thaw()
    wait_for(lambda: cg.cpu_seconds() - frozen_at > 0.05, what="the thawed loop to use CPU")


# --------------------------------------------------------------------------- kill_all

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def test_RES_FORK_01_kill_all_ends_a_fork_bomb(lab):
    cg = lab.cgroup(pids=64, cpus=0.5)
    lab.start(cg, FORK_BOMB)
    wait_for(lambda: len(cg.pids()) >= 48, what="the fork bomb to fill pids.max")
    cg.kill_all(timeout=20)
    assert not cg.populated() and cg.pids() == []


@pytest.mark.cgroup2
@v2_only
def test_RES_FORK_01_v2_kill_without_cgroup_kill_ends_a_fork_bomb(lab):
    """Kernels 5.2-5.13 have cgroup.freeze but no cgroup.kill: freeze, SIGKILL, thaw."""
    cg = lab.cgroup(pids=64, cpus=0.5)
    lab.start(cg, FORK_BOMB)
    wait_for(lambda: len(cg.pids()) >= 48, what="the fork bomb to fill pids.max")
    cg._kill_by_freezing(timeout=20)
    assert not cg.populated() and cg.pids() == []


def test_PROC_DAEMON_01_kill_all_ends_a_setsid_double_fork_daemon(lab):
    cg = lab.cgroup()
    proc = lab.start(cg, """
        import os, time
        if os.fork():
            os._exit(0)
        os.setsid()
        if os.fork():
            os._exit(0)
        print(os.getpid(), flush=True)
        time.sleep(600)
        """)
    daemon = int(lab.line(proc))
    assert proc.wait(timeout=30) == 0  # the process we started is gone; the daemon is not
    pidfd = os.pidfd_open(daemon)
    try:
        assert os.getsid(daemon) != os.getsid(0) and daemon in cg.pids()
        cg.kill_all()
        assert exited(pidfd, 10)
        assert not cg.populated()
    finally:
        os.close(pidfd)


def test_kill_all_ends_a_process_that_ignores_sigterm(lab):
    cg = lab.cgroup()
    proc = lab.start(cg, """
        import signal, time
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN)
        print('ignoring', flush=True)
        time.sleep(600)
        """)
    assert lab.line(proc) == "ignoring"
    os.kill(proc.pid, signal.SIGTERM)
    cg.kill_all()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not cg.populated()


def test_kill_all_ends_a_stopped_process(lab):
    cg = lab.cgroup()
    proc = lab.start(cg, "print('up', flush=True)\nimport time\ntime.sleep(600)\n")
    assert lab.line(proc) == "up"
    os.kill(proc.pid, signal.SIGSTOP)
    wait_for(lambda: proc_state(proc.pid) == "T", what="the child to stop")
    cg.kill_all()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not cg.populated()


def test_kill_all_of_a_frozen_cgroup_still_empties_it(lab):
    cg = lab.cgroup()
    proc = lab.start(cg, "print('up', flush=True)\nimport time\ntime.sleep(600)\n")
    assert lab.line(proc) == "up"
    cg.freeze()
    cg.kill_all()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not cg.populated()


# --------------------------------------------------------------------------- destroy

def test_destroy_kills_and_leaves_no_directory_in_any_hierarchy(lab):
    cg = lab.cgroup()
    proc = lab.start(cg, "print('up', flush=True)\nimport time\ntime.sleep(600)\n")
    assert lab.line(proc) == "up"
    assert cg.populated() and all(os.path.isdir(p) for p in cg.paths)
    cg.destroy()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert [p for p in cg.paths if os.path.exists(p)] == []
    cg.destroy()  # idempotent


def test_context_exit_destroys_even_when_the_body_fails(lab):
    cg = lab.cgroup()
    with pytest.raises(RuntimeError):
        with cg:
            lab.start(cg, "import time\ntime.sleep(600)\n")
            raise RuntimeError("body failed")
    assert [p for p in cg.paths if os.path.exists(p)] == []


# --------------------------------------------------------------------------- reuse

@pytest.fixture
def pool(lab, monkeypatch):
    """acquire()/release() on the lab's backend with a pool of 2, empty at the start
    and drained at the end (its cgroups are checked gone by the lab)."""
    monkeypatch.setenv(cgroups.ENV_POOL, "2")
    cgroups.drain_pool()
    taken: list[cgroups.Cgroup] = []

    def acquire(memory: int = 256 * MiB, pids: int = 64, cpus: float = 1.0):
        cg = cgroups.acquire(CgroupLimits(memory, pids, cpus), backend=lab.backend)
        taken.append(cg)
        return cg
    try:
        yield acquire
    finally:
        cgroups.drain_pool()
        lab.cgroups.extend(taken)  # the lab asserts every directory is gone


def _limit_files(cg: cgroups.Cgroup) -> dict[str, str]:
    names = (("memory.max", "pids.max", "cpu.max") if cg.version == 2 else
             ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max",
              "cpu.cfs_quota_us"))
    return {n: open(os.path.join(p, n)).read().strip() for n in names for p in cg.paths
            if os.path.exists(os.path.join(p, n))}


def test_a_released_cgroup_is_reused_with_new_limits_and_nothing_of_its_last_user(lab, pool):
    cg = pool(memory=64 * MiB)
    proc = lab.start(cg, "b = b'x' * (256 << 20)\nprint('survived', flush=True)\n")
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert cg.oom_kills() >= 1
    cg.kill_all()
    cg.release()
    if not cg.peak_resettable:  # v2 before Linux 6.12: a reused cgroup would show old peaks
        assert not cgroups.pooled_paths() and not any(os.path.exists(p) for p in cg.paths)
        return
    assert set(cg.paths) <= cgroups.pooled_paths()
    # Larger, then smaller again: on v1 memsw must never be below the memory limit.
    for memory, pids, cpus in ((192 * MiB, 17, 0.25), (48 * MiB, 9, 2.0)):
        again = pool(memory=memory, pids=pids, cpus=cpus)
        assert again.paths == cg.paths and not cgroups.pooled_paths()  # a new handle
        limits = _limit_files(again)
        assert limits["pids.max"] == str(pids)
        if again.version == 2:
            assert limits["memory.max"] == str(memory)
            assert limits["cpu.max"] == f"{round(cpus * 100_000)} 100000"
        else:
            assert limits["memory.limit_in_bytes"] == str(memory)
            assert limits.get("memory.memsw.limit_in_bytes", str(memory)) == str(memory)
            assert limits["cpu.cfs_quota_us"] == str(round(cpus * 100_000))
        assert again.oom_kills() == 0  # the last user's OOM kill is not this one's
        peak = again.memory_peak()
        assert peak is None or peak < 32 * MiB  # nor is its peak
        # and the new limit holds
        hog = lab.start(again, f"b = b'x' * ({memory} + (64 << 20))\n")
        # (v2 with memory.oom.group counts the victim once more as a member of its group)
        assert hog.wait(timeout=60) == -signal.SIGKILL and again.oom_kills() >= 1
        again.kill_all()
        again.release()


def test_a_cgroup_with_a_task_a_child_cgroup_or_frozen_is_not_kept(lab, pool):
    busy = pool()
    sleeper = lab.start(busy, "print('up', flush=True)\nimport time\ntime.sleep(600)\n")
    assert lab.line(sleeper) == "up"
    busy.release()  # not emptied by its user: release kills and removes it
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert [p for p in busy.paths if os.path.exists(p)] == []

    parent = pool()
    os.mkdir(os.path.join(parent.paths[0], "karotte-child"))
    parent.release()
    assert [p for p in parent.paths if os.path.exists(p)] == []

    frozen = pool()
    frozen.freeze()
    frozen.release()
    assert [p for p in frozen.paths if os.path.exists(p)] == []
    assert cgroups.pooled_paths() == set()


def test_the_pool_is_bounded_off_at_zero_and_checked(lab, pool, monkeypatch):
    made = [pool() for _ in range(3)]
    if not made[0].peak_resettable:
        pytest.skip("v2 before Linux 6.12 keeps no cgroup (memory.peak cannot be reset): "
                    "the test above checks that")
    for cg in made:
        cg.release()
    assert len({cg.name for cg in made if set(cg.paths) <= cgroups.pooled_paths()}) == 2
    assert [p for p in made[2].paths if os.path.exists(p)] == []
    cgroups.drain_pool()
    assert [p for cg in made for p in cg.paths if os.path.exists(p)] == []

    monkeypatch.setenv(cgroups.ENV_POOL, "0")
    off = pool()
    off.release()
    assert [p for p in off.paths if os.path.exists(p)] == [] and not cgroups.pooled_paths()

    monkeypatch.setenv(cgroups.ENV_POOL, "many")
    with pytest.raises(ValueError, match=cgroups.ENV_POOL):
        pool()


def test_a_released_handle_is_dead_so_it_cannot_touch_the_next_user(lab, pool):
    first = pool()
    first.release()
    first.release()  # a second release does nothing: the pool holds it once
    if not first.peak_resettable:
        pytest.skip("v2 before Linux 6.12 keeps no cgroup (memory.peak cannot be reset)")
    second, third = pool(), pool()
    assert set(second.paths) == set(first.paths) and set(third.paths) != set(first.paths)
    sleeper = lab.start(second, "print('up', flush=True)\nimport time\ntime.sleep(600)\n")
    assert lab.line(sleeper) == "up"
    for act in (first.kill_all, first.freeze, first.thaw, first.pids, first.memory_peak,
                first.reset_memory_peak, first.oom_kills, first.cpu_seconds,
                lambda: first.add(os.getpid()),
                lambda: first.set_limits(CgroupLimits(16 * MiB, 1, 0.1))):
        with pytest.raises(CgroupError, match="was released"):
            act()
    first.destroy()  # already released: nothing to do, and the new user's cgroup stays
    assert sleeper.poll() is None and second.pids() == [sleeper.pid]


def test_the_cpu_time_of_a_user_is_not_handed_on(lab, pool):
    cg = pool()
    busy = lab.start(cg, "import time\nt = time.process_time()\n"
                         "while time.process_time() - t < 0.3: pass\n")
    assert busy.wait(timeout=120) == 0
    assert cg.cpu_seconds() >= 0.3
    paths, reusable = cg.paths, cg.peak_resettable
    cg.kill_all()
    cg.release()
    again = pool()
    assert (again.paths == paths) == reusable  # v2 before 6.12: never reused
    assert again.cpu_seconds() < 0.05


def test_what_a_user_left_is_not_handed_on(lab, pool, tmp_path):
    # Memory still charged after the tasks are gone (here: negative dentries, made until
    # the cgroup holds three times POOL_MAX_LEFTOVER, however slow the machine: the VM
    # lane's is emulated) must not reach the next user of the cgroup: reused with at most
    # POOL_MAX_LEFTOVER of it, or not reused. The names are looked up in a directory of
    # the test's (ext4 here and in the VM lane), not /usr: the VM lane's /usr is 9p,
    # which keeps no negative dentries, and nothing would be charged.
    cg = pool()
    busy = lab.start(cg, "import itertools, os, sys\n"
                         "tag = os.urandom(8).hex()  # new names: new dentries\n"
                         "for i in itertools.count():\n"
                         "    try: os.stat(f'{sys.argv[1]}/no-such-file-{tag}-{i}')\n"
                         "    except OSError: pass\n", args=(str(tmp_path),))
    deadline = time.monotonic() + 120
    while cg._memory_usage() < 3 * cgroups.POOL_MAX_LEFTOVER:
        assert busy.poll() is None, "the child making dentries ended"
        assert time.monotonic() < deadline, cg._memory_usage()
        time.sleep(0.05)
    cg.kill_all()
    assert busy.wait(timeout=30) != 0
    left = cg._memory_usage()
    assert left > cgroups.POOL_MAX_LEFTOVER, left  # the dentries outlived their task
    cg.release()
    again = pool()
    usage = again._memory_usage()
    assert usage <= cgroups.POOL_MAX_LEFTOVER, usage
    peak = again.memory_peak()
    assert peak is None or peak <= cgroups.POOL_MAX_LEFTOVER


@v1_only  # on v2 the spawn clones into the cgroup: no thread of ours visits it
def test_kill_all_never_signals_the_calling_process(lab):
    # On v1, while a thread of the trainer spawns a sandbox, cgroup.procs of the sandbox's
    # cgroup and of every cgroup above lists the trainer's pid. A kill_all of a parent at
    # that moment must wait for the thread to leave, not kill the trainer.
    import threading
    cg = lab.cgroup()
    origin = {path: os.path.join(os.path.dirname(path), "tasks") for path in cg.paths}
    inside, leave = threading.Event(), threading.Event()

    def visit():
        for path in cg.paths:
            with open(os.path.join(path, "tasks"), "w") as f:
                f.write("0")
        inside.set()
        leave.wait(10)
        for back in origin.values():  # the creator's own cgroups: the parents here
            with open(back, "w") as f:
                f.write("0")

    visitor = threading.Thread(target=visit)
    visitor.start()
    try:
        assert inside.wait(10) and os.getpid() in cg.pids()
        threading.Timer(0.3, leave.set).start()
        cg.kill_all(timeout=5)  # returns once the thread has left; we are still alive
        assert os.getpid() not in cg.pids()
    finally:
        leave.set()
        visitor.join()


def test_place_moves_a_process_in_where_it_is_not(lab):
    cg = lab.cgroup()
    proc = subprocess.Popen(["sleep", "600"], stdout=subprocess.PIPE)  # the lab closes it
    lab.procs.append(proc)
    assert cg._misplaced(proc.pid)
    cg.place(proc.pid)
    assert cg._misplaced(proc.pid) == [] and proc.pid in cg.pids()
    cg.place(proc.pid)  # already there: nothing to do


POOL_AT_EXIT = """
import os
from karotte import cgroups
b = cgroups.backend({version})
made = [cgroups.acquire(cgroups.CgroupLimits(64 << 20, 16, 0.5), backend=b) for _ in range(2)]
for cg in made:
    cg.release()
if made[0].peak_resettable:  # else (v2 before Linux 6.12) nothing is kept
    assert cgroups.pooled_paths() == {{p for cg in made for p in cg.paths}}
pid = os.fork()
if pid == 0:  # the child has its own, empty pool and leaves the parent's alone
    ok = cgroups.pooled_paths() == set()
    child = cgroups.acquire(cgroups.CgroupLimits(64 << 20, 16, 0.5), backend=b)
    ok = ok and not set(child.paths) & {{p for cg in made for p in cg.paths}}
    child.destroy()
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert all(os.path.isdir(p) for p in cgroups.pooled_paths())
print(os.getpid())
"""


def test_pooled_cgroups_are_removed_at_exit_and_not_shared_with_a_fork(lab):
    ran = subprocess.run([sys.executable, "-c", POOL_AT_EXIT.format(version=lab.backend.version)],
                         env={**os.environ, "PYTHONPATH": REPO, cgroups.ENV_POOL: "4"},
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert cgroups.find_created_by(int(ran.stdout)) == []


# --------------------------------------------------------------------------- gc

ORPHAN = """
import os, subprocess, sys
from karotte import cgroups
cg = cgroups.create(cgroups.leaf_name('orphan'), cgroups.CgroupLimits(64 << 20, 16, 0.5),
                    backend=cgroups.backend({version}))
sleeper = subprocess.Popen(['sleep', '600'], stdout=subprocess.DEVNULL)
cg.add(sleeper.pid)
print('\\n'.join(cg.paths), flush=True)
os._exit(0)  # a crash: no destroy
"""


def test_find_stale_finds_cgroups_of_a_dead_creator_and_remove_stale_removes_them(lab):
    ours = lab.cgroup(tag="alive")
    orphan: list[str] = []
    try:
        made = subprocess.run([sys.executable, "-c", ORPHAN.format(version=lab.backend.version)],
                              env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                              text=True, timeout=120)
        orphan = made.stdout.split()
        assert made.returncode == 0 and orphan
        assert not cgroups.creator_alive(os.path.basename(orphan[0]))
        stale = cgroups.find_stale()
        assert set(orphan) <= set(stale)
        assert not set(ours.paths) & set(stale)
        for path in stale:
            if path in orphan:
                cgroups.remove_stale(path)
        assert [p for p in orphan if os.path.exists(p)] == []
    finally:
        for path in orphan:
            if os.path.isdir(path):
                cgroups.remove_stale(path)


def test_remove_stale_refuses_paths_that_are_not_karotte_cgroups(tmp_path):
    with pytest.raises(ValueError):
        cgroups.remove_stale("/sys/fs/cgroup/memory")
    with pytest.raises(ValueError):
        cgroups.remove_stale(str(tmp_path / "karotte-1.2-3"))


# --------------------------------------------------------------------------- v2 only

@pytest.mark.cgroup2
@v2_only
def test_v2_clone_fd_is_the_cgroup_directory_and_closes_with_destroy(lab):
    cg = lab.cgroup()
    fd = cg.clone_fd()
    st, want = os.fstat(fd), os.stat(cg.paths[0])
    assert (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino)
    assert os.get_inheritable(fd) is False
    cg.destroy()
    assert cg.clone_fd() is None
    with pytest.raises(OSError) as e:
        os.fstat(fd)
    assert e.value.errno == errno.EBADF


@pytest.mark.cgroup2
@v2_only
def test_v2_a_parent_with_its_own_processes_is_refused_with_the_fix(backend):
    own = open("/proc/self/cgroup").read().split("0::", 1)[1].split("\n")[0]
    if own == "/":
        pytest.skip("the root cgroup is exempt from the no-internal-processes rule")
    with pytest.raises(HostUnsupported) as e:
        backend.create(cgroups.leaf_name(), CgroupLimits(64 * MiB, 8, 1.0), parent=own)
    message = str(e.value)
    assert "Delegate=yes" in message and "KAROTTE_CGROUP_PARENT" in message
    offered = set(open(backend.mount.dir_of(own) + "/cgroup.controllers").read().split())
    if {"memory", "pids", "cpu"} <= offered:
        assert "no internal processes" in message

