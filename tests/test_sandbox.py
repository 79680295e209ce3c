"""The sandbox's behaviour: identity, isolation, exec results, state, cleanup."""
from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib
import json
import os
import resource
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path


import psutil
import pytest

from conftest import child_inits, karotte_cgroups, only_fds_to_spare, py, sandbox_processes
import karotte
from karotte.errors import HostUnsupported, SandboxClosed, SandboxError
from karotte.exec_io import drive_sync
from karotte.sandbox import DEFAULT_UID_BASE, AGENT_UID, AsyncSandbox, Sandbox, ns_owner_ids
from karotte.protections import PROTECTIONS
from karotte.spec import Bind, MiB, SandboxSpec, SpecError

NAMESPACES = ("user", "pid", "mnt", "net", "ipc", "uts", "cgroup")


def status_fields(sb: Sandbox) -> dict[str, str]:
    out = sb.exec(["cat", "/proc/self/status"]).stdout.decode()
    return dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)


@pytest.mark.cgroup2
def test_agent_runs_as_uid_1000_without_capabilities_with_no_new_privs_and_seccomp(sandbox):
    r = sandbox.exec(["id"])
    assert r.stdout == b"uid=1000(agent) gid=1000(agent) groups=1000(agent)\n"
    st = status_fields(sandbox)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[cap], 16) == 0, f"{cap} is {st[cap]}"
    assert st["NoNewPrivs"].strip() == "1"
    assert st["Seccomp"].strip() == "2"  # filter mode
    # exactly the policy: init loads it once and every command inherits it
    assert st["Seccomp_filters"].strip() == "1"
    assert status_fields(sandbox)["Seccomp_filters"].strip() == "1"  # and the next one too


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid range is mapped only for root callers")
def test_agent_is_an_unprivileged_host_uid_never_root_or_the_caller(sandbox):
    r = sandbox.exec("sleep 30 & echo started")
    assert r.stdout == b"started\n"
    host_pids = [pid for pid in sandbox.cgroup.pids() if pid != sandbox.init_pid]
    assert host_pids, "the background sleep is not in the sandbox's cgroup"
    for pid in host_pids:
        proc = psutil.Process(pid)
        uids, gids = set(proc.uids()), set(proc.gids())
        assert len(uids) == 1 and uids.pop() in ns_owner_ids()  # one of its own, reserved
        assert gids == {DEFAULT_UID_BASE + AGENT_UID}
    init_uids = psutil.Process(sandbox.init_pid).uids()
    assert set(init_uids) == {DEFAULT_UID_BASE}, "init must not be host root either"


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid range is mapped only for root callers")
def test_each_sandbox_s_agent_has_a_host_uid_of_its_own(no_leaks):
    # The kernel counts epoll watches, pipe buffers, fds in flight and keys per host
    # uid, namespaces or not: one agent uid for all sandboxes let one agent use them up
    # for every other sandbox (ENOSPC from epoll_ctl, 8 KiB pipes).
    sandboxes = [Sandbox() for _ in range(3)]
    try:
        host_uids = set()
        for sb in sandboxes:
            r = sb.exec("sleep 30 & echo started")
            assert r.stdout == b"started\n"
            agents = [pid for pid in sb.cgroup.pids() if pid != sb.init_pid]
            host_uids |= {psutil.Process(pid).uids().real for pid in agents}
            assert sb.exec("id -u").stdout == b"1000\n"
        assert len(host_uids) == 3
    finally:
        for sb in sandboxes:
            sb.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid range is mapped only for root callers")
def test_an_agent_that_takes_its_pipe_buffer_quota_leaves_other_sandboxes_theirs(no_leaks):
    # pipe-user-pages-soft: past it, a user's new pipes get one page. Hog this sandbox's
    # quota, then a pipe in the next sandbox must still get its 64 KiB.
    soft = int(open("/proc/sys/fs/pipe-user-pages-soft").read())
    if soft == 0:
        pytest.skip("fs.pipe-user-pages-soft is 0 (no per-user pipe quota on this host)")
    hog = py("""
import fcntl, os, time
pipes = []
while True:
    r, w = os.pipe(); pipes += [r, w]
    if fcntl.fcntl(w, 1032) < 65536:  # F_GETPIPE_SZ: the quota is used up
        break
    try:
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: take 256 pages a pipe
    except OSError:
        pass
print(len(pipes) // 2, flush=True)
time.sleep(60)
""")
    victim = py("import fcntl, os; r, w = os.pipe(); print(fcntl.fcntl(w, 1032))")
    with Sandbox(SandboxSpec(nofile=4096)) as a, Sandbox() as b:
        a.exec(f"{shlex.join(hog)} > /tmp/count &")
        deadline = time.monotonic() + 20
        while a.exec("cat /tmp/count").stdout == b"" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert a.exec("cat /tmp/count").stdout.strip(), "the hog never used up its quota"
        assert int(a.exec(victim).stdout) < 65536  # the hog's own sandbox is out of quota
        assert b.exec(victim).stdout == b"65536\n"


@pytest.mark.cgroup2
def test_every_namespace_is_new(sandbox):
    inside = sandbox.exec(["sh", "-c", "for n in " + " ".join(NAMESPACES)
                           + "; do readlink /proc/self/ns/$n; done"]).stdout.decode().split()
    outside = [os.readlink(f"/proc/self/ns/{n}") for n in NAMESPACES]
    assert len(inside) == len(NAMESPACES)
    for name, a, b in zip(NAMESPACES, inside, outside):
        assert a != b, f"{name} namespace is shared with the host"


def test_hostname_is_fixed_and_only_loopback_exists(sandbox):
    assert sandbox.exec(["hostname"]).stdout == b"karotte\n"
    devs = sandbox.exec(["cat", "/proc/net/dev"]).stdout.decode().splitlines()[2:]
    assert [line.split(":")[0].strip() for line in devs] == ["lo"]


def test_host_files_only_root_may_read_stay_invisible(sandbox):
    # /etc is a copy of host files; what a host user could not read must not be in it.
    private = "/etc/ssl/private"
    if os.path.isdir(private) and not os.stat(private).st_mode & 0o005:
        r = sandbox.exec(["ls", "-la", private])
        assert r.exit_code != 0 and b"No such file" in r.stderr
    r = sandbox.exec(["sh", "-c", "cat /etc/shadow /etc/gshadow 2>&1; echo rc=$?"])
    assert b"No such file" in r.stdout and b"root:" not in r.stdout


def test_root_is_read_only_and_only_the_scratch_mounts_are_writable(sandbox):
    script = """
import os, errno
res = {}
for p in ["/usr/karotte-probe", "/etc/karotte-probe", "/karotte-probe", "/dev/karotte-probe",
          "/workspace/f", "/tmp/f", "/home/agent/f", "/dev/shm/f"]:
    try:
        open(p, "w").close(); res[p] = "ok"
    except OSError as e:
        res[p] = errno.errorcode[e.errno]
print(res)
"""
    res = eval(sandbox.exec(py(script)).stdout)
    for p in ("/usr/karotte-probe", "/etc/karotte-probe", "/karotte-probe", "/dev/karotte-probe"):
        assert res[p] in ("EROFS", "EACCES"), (p, res[p])
    for p in ("/workspace/f", "/tmp/f", "/home/agent/f", "/dev/shm/f"):
        assert res[p] == "ok", (p, res[p])


def test_every_mount_is_nosuid_and_nodev_except_the_device_nodes(sandbox):
    lines = sandbox.exec(["cat", "/proc/self/mountinfo"]).stdout.decode().splitlines()
    devices = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"}
    assert lines
    for line in lines:
        fields = line.split()
        point, opts = fields[4], fields[5].split(",")
        assert "nosuid" in opts, line
        if point == "/dev/pts":  # its pty nodes need dev; nothing on it may run
            assert "noexec" in opts, line
        elif point not in devices:
            assert "nodev" in opts, line
    assert any(line.split()[4] == "/dev/pts" for line in lines)


def test_nothing_of_the_host_is_mounted_beyond_the_userland(sandbox):
    points = {line.split()[4] for line in
              sandbox.exec(["cat", "/proc/self/mountinfo"]).stdout.decode().splitlines()}
    allowed_prefixes = ("/usr", "/etc", "/dev", "/proc", "/tmp", "/workspace", "/home/agent")
    for point in points - {"/"}:
        assert point.startswith(allowed_prefixes), f"unexpected mount {point}"


def test_only_fds_0_to_2_are_open_in_the_agent(sandbox):
    r = sandbox.exec(py("import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"))
    fds = json.loads(r.stdout)
    # listdir holds one fd of its own while it reads the directory
    assert fds[:3] == [0, 1, 2] and len(fds) <= 4, fds


def test_command_runs_in_its_own_session_without_a_terminal(sandbox):
    r = sandbox.exec(py("import os; print(os.getsid(0) == os.getpid(), os.isatty(0))"))
    assert r.stdout == b"True False\n"
    assert sandbox.exec(["tty"]).stdout == b"not a tty\n"


@pytest.mark.cgroup2
def test_files_cwd_env_and_background_processes_persist_between_execs(sandbox):
    assert sandbox.exec("echo hello > note.txt; sleep 60 & echo $! > pid").exit_code == 0
    r = sandbox.exec("cat note.txt; kill -0 $(cat pid) && echo running")
    assert r.stdout == b"hello\nrunning\n"
    assert sandbox.exec(["pwd"]).stdout == b"/workspace\n"
    assert sandbox.exec(["pwd"], cwd="/tmp").stdout == b"/tmp\n"
    r = sandbox.exec(["sh", "-c", "echo $FOO $HOME $PATH"], env={"FOO": "bar"})
    assert r.stdout.split()[:2] == [b"bar", b"/home/agent"]


def test_exit_code_signal_and_command_not_found_are_reported(sandbox):
    assert sandbox.exec("exit 3").exit_code == 3
    r = sandbox.exec("kill -SEGV $$")
    assert r.exit_code is None and r.signal == signal.SIGSEGV
    r = sandbox.exec(["no-such-command-anywhere"])
    assert r.exit_code == 127 and r.error and "No such file" in r.error
    assert b"no-such-command-anywhere" not in r.stdout
    # A script without #!: glibc's execvp runs it with /bin/sh, musl's (karotte-init's
    # libc where musl-gcc is installed) does not, and then the error says what is missing.
    assert sandbox.exec("printf 'echo ran\\n' > s && chmod +x s").exit_code == 0
    r = sandbox.exec(["./s"])
    if r.exit_code == 127:
        assert "a script needs a #! line" in r.error and r.stdout == b""
    else:
        assert r.exit_code == 0 and r.stdout == b"ran\n"


def test_stdin_is_delivered_in_full(sandbox):
    data = os.urandom(3 * MiB)
    r = sandbox.exec(["sha256sum"], stdin=data)
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


@pytest.mark.cgroup2
def test_timeout_kills_the_command_and_the_sandbox_stays_usable(sandbox):
    t = time.monotonic()
    r = sandbox.exec(["sleep", "30"], timeout=0.5)
    assert time.monotonic() - t < 5
    assert r.timed_out and r.signal == signal.SIGKILL
    assert sandbox.exec(["echo", "after"]).stdout == b"after\n"


def test_timeout_also_ends_a_command_whose_children_hold_the_output_pipe(sandbox):
    t = time.monotonic()
    r = sandbox.exec("sleep 30 | cat", timeout=0.5)
    assert r.timed_out and time.monotonic() - t < 5


def test_exec_returns_promptly_when_a_background_job_keeps_stdout_open(sandbox):
    t = time.monotonic()
    r = sandbox.exec("sleep 300 & echo started", timeout=600)
    assert r.exit_code == 0 and r.stdout == b"started\n"
    assert time.monotonic() - t < 30  # it returns when the shell exits, not the job


@pytest.mark.cgroup2
def test_result_has_wall_cpu_and_peak_memory_measured_from_outside(sandbox):
    r = sandbox.exec(py("x = bytearray(64 << 20)\nfor i in range(3000000): pass"))
    assert r.exit_code == 0
    assert r.cpu_seconds > 0.05
    assert r.wall_seconds >= r.cpu_seconds * 0.5
    if sandbox.cgroup.peak_resettable:
        assert r.peak_memory >= 64 * MiB
    else:  # cgroup v2 before Linux 6.12 cannot reset memory.peak: unknown, never stale
        assert r.peak_memory is None


def test_OUT_FLOOD_01_output_is_capped_and_host_memory_stays_bounded(no_leaks):
    spec = SandboxSpec(output_limit=1 * MiB)
    rss_before = psutil.Process().memory_info().rss
    with Sandbox(spec) as sb:
        r = sb.exec("head -c 300M /dev/zero; head -c 300M /dev/zero >&2; echo done >&2",
                    timeout=60)
    assert r.exit_code == 0
    assert len(r.stdout) == 1 * MiB and r.stdout_truncated
    assert len(r.stderr) == 1 * MiB and r.stderr_truncated
    assert psutil.Process().memory_info().rss - rss_before < 64 * MiB


def test_OUT_FLOOD_01_a_flood_past_the_limit_costs_the_trainer_almost_no_cpu(no_leaks):
    # Drained as fast as the agent writes, a flood took a core of the trainer for as
    # long as it lasted, outside every limit of the sandbox. Past its output_limit a
    # stream is drained at a paced rate (and the agent waits on its full pipe).
    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    with Sandbox(SandboxSpec(output_limit=64 * 1024)) as sb:
        before = cpu()
        r = sb.exec(["sh", "-c", "yes & yes >&2"], timeout=3)
        spent = cpu() - before
        assert r.timed_out and r.stdout_truncated and r.stderr_truncated
        assert len(r.stdout) == len(r.stderr) == 64 * 1024
        assert spent < 0.6, f"the trainer spent {spent:.2f} s of CPU on a 3 s flood"
        # Output past the limit still flows: a command that writes a lot and exits
        # gets its exit status, and what it wrote last to the other stream.
        r = sb.exec("head -c 200M /dev/zero; echo tail >&2; exit 3", timeout=60)
        assert r.exit_code == 3 and r.stderr == b"tail\n" and r.stdout_truncated
    # Below the limit too: a byte at a time to both streams woke the trainer for every
    # byte (half a core); bursts of small reads are paced and read in batches.
    with Sandbox() as sb:  # the default limit, 1 MiB: a long way to go in single bytes
        before = cpu()
        r = sb.exec(["sh", "-c", "while :; do printf x; printf y >&2; done"], timeout=3)
        spent = cpu() - before
        assert r.timed_out and r.stdout.startswith(b"xxxx") and r.stderr.startswith(b"yyyy")
        assert spent < 0.6, f"the trainer spent {spent:.2f} s of CPU on 3 s of single bytes"


def test_binds_are_read_only_unless_asked(no_leaks, shared_dir):
    with open(os.path.join(shared_dir, "data.txt"), "w") as f:
        f.write("from the host")
    spec = SandboxSpec(binds=(Bind(shared_dir, "/data"),))
    with Sandbox(spec) as sb:
        assert sb.exec(["cat", "/data/data.txt"]).stdout == b"from the host"
        r = sb.exec(["touch", "/data/new"])
        assert r.exit_code != 0 and b"Read-only" in r.stderr
    assert not os.path.exists(os.path.join(shared_dir, "new"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a root-only directory")
def test_bind_of_a_path_only_root_can_read_fails_with_the_cause(no_leaks, tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(SandboxError, match="Permission denied.*unprivileged host uid"):
        Sandbox(SandboxSpec(binds=(Bind(str(private), "/data"),)))


def test_workspace_fd_reaches_the_agents_files_from_the_host(sandbox):
    sandbox.exec("echo result > answer.txt")
    fd = os.open("answer.txt", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=sandbox.workspace_fd)
    try:
        assert os.read(fd, 100) == b"result\n"
        assert stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


@pytest.mark.cgroup2
def test_creating_a_sandbox_leaves_the_callers_oom_score_alone(no_leaks):
    # init shares our memory until it execs; the kernel applies oom_score_adj to every
    # process sharing it, so an early write to init's would exempt the trainer too.
    with open("/proc/self/oom_score_adj") as f:
        before = f.read()
    with Sandbox() as sb:
        sb.exec(["true"])
    with open("/proc/self/oom_score_adj") as f:
        assert f.read() == before


def test_exec_after_close_raises_a_clear_error(no_leaks):
    sb = Sandbox()
    sb.close()
    with pytest.raises(SandboxClosed, match="closed"):
        sb.exec(["true"])


def test_context_manager_cleans_up_when_the_body_raises(no_leaks):
    with pytest.raises(RuntimeError):
        with Sandbox() as sb:
            sb.exec("sleep 60 &")
            raise RuntimeError("trainer bug")


@pytest.mark.cgroup2
def test_kill_all_ends_every_process_and_confirms_the_cgroup_is_empty(no_leaks):
    with Sandbox() as sb:
        sb.exec("sleep 100 & (setsid sleep 100 &) ; trap '' TERM; sleep 100 &")
        assert len(sb.cgroup.pids()) >= 4
        sb.kill_all()
        assert not sb.cgroup.populated()
        with pytest.raises(SandboxClosed):
            sb.exec(["true"])


def test_async_sandboxes_run_concurrently_from_one_event_loop(no_leaks):
    async def one(i: int) -> bytes:
        async with AsyncSandbox(SandboxSpec(memory=64 * MiB)) as sb:
            await sb.exec(f"echo {i} > n")
            r = await sb.exec("sleep 0.3; cat n")
            return r.stdout

    async def main():
        t = time.monotonic()
        outs = await asyncio.gather(*(one(i) for i in range(40)))
        return outs, time.monotonic() - t

    outs, elapsed = asyncio.run(main())
    assert outs == [f"{i}\n".encode() for i in range(40)]
    assert elapsed < 40 * 0.3, "the sleeps did not overlap"


def test_async_timeout_and_cancellation_leave_the_sandbox_usable(no_leaks):
    async def main():
        async with AsyncSandbox() as sb:
            r = await sb.exec(["sleep", "30"], timeout=0.3)
            assert r.timed_out
            task = asyncio.ensure_future(sb.exec(["sleep", "30"]))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return (await sb.exec(["echo", "ok"])).stdout

    assert asyncio.run(main()) == b"ok\n"


@pytest.mark.slow
def test_1000_create_exec_destroy_cycles_leave_nothing_behind(no_leaks):
    def ours(names):  # other programs may use /tmp meanwhile: look for the sandbox's uids
        found = set()
        for n in names:
            try:
                if os.lstat(os.path.join("/tmp", n)).st_uid >= DEFAULT_UID_BASE:
                    found.add(n)
            except FileNotFoundError:
                continue
        return found
    tmp_before = ours(os.listdir("/tmp"))
    procs_before = sandbox_processes()
    for i in range(1000):
        with Sandbox(SandboxSpec(memory=64 * MiB)) as sb:
            r = sb.exec(["sh", "-c", f"echo {i} > f; sleep 1000 >/dev/null 2>&1 & cat f"])
            assert r.stdout == f"{i}\n".encode()
    assert ours(os.listdir("/tmp")) - tmp_before == set()
    assert sandbox_processes() - procs_before == set()
    assert child_inits() == []
    assert karotte_cgroups() == set()


def test_pass_fds_gives_the_command_a_private_channel_and_nothing_else(sandbox):
    r_fd, w_fd = os.pipe()
    try:
        r = sandbox.exec(py("import os; os.write(3, b'via fd 3'); "
                            "print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"),
                         pass_fds=[w_fd])
        os.close(w_fd)
        w_fd = -1
        assert os.read(r_fd, 100) == b"via fd 3"
        assert json.loads(r.stdout)[:4] == [0, 1, 2, 3] and len(json.loads(r.stdout)) <= 5
        # the next command does not inherit it
        r = sandbox.exec(py("import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"))
        assert json.loads(r.stdout)[:3] == [0, 1, 2] and len(json.loads(r.stdout)) <= 4
    finally:
        os.close(r_fd)
        if w_fd >= 0:
            os.close(w_fd)


def test_sandboxes_work_when_the_caller_holds_fds_above_1024(no_leaks):
    # Trainers hold many fds; nothing on the spawn, exec or kill path may use select().
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"needs a hard RLIMIT_NOFILE of 2048 or more; this process has {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))  # systemd: 1024
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        with Sandbox() as sb:
            assert sb.workspace_fd > 1024
            assert sb.exec(["echo", "ok"]).stdout == b"ok\n"
            sb.exec("sleep 100 &")
            sb.kill_all()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("spare", range(4))  # with 4 a sandbox starts
def test_running_out_of_fds_is_named_as_the_cause(no_leaks, spare):
    # Each count of spare fds runs out at a different step of the start (cgroup files,
    # socketpair, pidfd, the workspace fd); every step must name the cause and leave nothing.
    # The backend is detected again, as in a fresh trainer: probing it needs fds too.
    from karotte import cgroups
    cgroups.detect.cache_clear()
    with only_fds_to_spare(spare):
        with pytest.raises(SandboxError, match="out of file descriptors"):
            with Sandbox():
                pass


@pytest.mark.cgroup2
def test_a_sandbox_on_a_reused_cgroup_gets_its_own_limits_and_none_of_the_last_users_counts(
        no_leaks, monkeypatch):
    # Sandboxes keep released cgroups for the next one (cgroups.acquire): the second
    # sandbox below runs in the first one's cgroup, and must not inherit its OOM kill,
    # its memory peak, or its lower memory limit.
    from karotte import cgroups
    monkeypatch.setenv(cgroups.ENV_POOL, "1")
    cgroups.drain_pool()
    try:
        with Sandbox(SandboxSpec(memory=96 * MiB)) as first:
            hog = first.exec(py("b = bytearray(160 << 20)"))
            assert hog.oom_killed and hog.signal == signal.SIGKILL
            paths = first._core.cgroup.paths
            # v2 before Linux 6.12 cannot reset memory.peak: such a cgroup is not reused
            reusable = first._core.cgroup.peak_resettable
        with Sandbox(SandboxSpec(memory=384 * MiB)) as second:
            assert (second._core.cgroup.paths == paths) == reusable
            quiet = second.exec(["/bin/true"])
            assert quiet.exit_code == 0 and not quiet.oom_killed
            if reusable:
                assert quiet.peak_memory is not None and quiet.peak_memory < 64 * MiB
            held = second.exec(py("b = bytearray(160 << 20); b[::4096] = b'x' * len(b[::4096])"))
            assert held.exit_code == 0 and not held.oom_killed, held
    finally:
        cgroups.drain_pool()


def test_a_forked_copy_of_a_closed_sandbox_cannot_touch_the_sandbox_that_reuses_its_cgroup(
        no_leaks, monkeypatch):
    from karotte import cgroups
    monkeypatch.setenv(cgroups.ENV_POOL, "1")
    cgroups.drain_pool()
    go_r, go_w = os.pipe()
    try:
        first = Sandbox()
        paths, reusable = first._core.cgroup.paths, first._core.cgroup.peak_resettable
        pid = os.fork()
        if pid == 0:  # the trainer forked while `first` was live (multiprocessing, say)
            code = 1
            try:
                os.read(go_r, 1)
                first.close()  # its copy: the cgroup is the parent's, now second's
                code = 0
            finally:
                os._exit(code)
        first.close()
        with Sandbox() as second:
            assert (second._core.cgroup.paths == paths) == reusable
            assert second.exec("sleep 600 & echo started").stdout == b"started\n"
            os.write(go_w, b"x")
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            assert second.exec(["echo", "alive"]).stdout == b"alive\n"
            assert len(second.cgroup.pids()) == 2  # init and the sleep
    finally:
        os.close(go_r)
        os.close(go_w)
        cgroups.drain_pool()


@pytest.mark.cgroup2
def test_init_starts_in_its_cgroup_in_every_hierarchy_and_the_trainer_stays_where_it_was(
        no_leaks):
    # v2: CLONE_INTO_CGROUP. v1: the clone3 runs in a thread of its own that first moves
    # itself into the sandbox's cgroups; the trainer's threads must not move, and none
    # may be left over.
    def where(path: str) -> dict[str, str]:
        return {line.split(":")[1]: line.split(":", 2)[2].strip()
                for line in open(path).read().splitlines()}

    def trainer_threads() -> dict[str, dict[str, str]]:
        return {tid: where(f"/proc/self/task/{tid}/cgroup")
                for tid in os.listdir("/proc/self/task")}

    before = trainer_threads()
    with Sandbox() as sb:
        name = sb.cgroup.name
        inside = where(f"/proc/{sb.init_pid}/cgroup")
        hierarchies = (("",) if sb.cgroup.version == 2 else
                       ("memory", "pids", "cpu", "cpuacct", "cpu,cpuacct", "freezer"))
        ours = {k: v for k, v in inside.items() if k in hierarchies}
        assert ours and all(os.path.basename(v) == name for v in ours.values()), inside
        assert sb.exec(["true"]).exit_code == 0
    assert trainer_threads() == before


DUMPABLE_AFTER_SPAWNS = """
import prctl
from karotte.sandbox import Sandbox
before = prctl.get_dumpable()
seen = []
for _ in range(3):
    with Sandbox() as sb:
        seen.append(prctl.get_dumpable())
        sb.exec(["true"])
    seen.append(prctl.get_dumpable())
print(before, *seen)
"""


def test_the_trainer_is_not_dumpable_once_it_has_spawned_a_sandbox(no_leaks):
    # The spawn child shares the trainer's memory until its exec, in a user namespace
    # whose owner uid has every capability over it: the trainer's mm must stay
    # non-dumpable, or that uid could attach to the child (README, Limits).
    r = subprocess.run([sys.executable, "-c", DUMPABLE_AFTER_SPAWNS], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"] + ["False"] * 6


def test_a_kill_sent_right_after_the_exec_request_is_never_lost(sandbox):
    """init kills an exec by its process group, which exists only after the command's
    setsid(): a SIGKILL that arrived first (a timeout of a few microseconds, a cancelled
    exec) was lost, and the command ran on (187 of 200 here before the fix)."""
    core = sandbox._core
    survived = 0
    for _ in range(200):
        op = core.begin_exec(["sleep", "30"], b"", 5.0, None, None)
        core.signal(op.id, signal.SIGKILL)  # before init can have seen the child's setsid
        drive_sync(op)
        r = core.end_exec(op)
        survived += r.signal != signal.SIGKILL or r.timed_out
    assert survived == 0


def test_allow_degraded_takes_only_the_names_of_check_lines():
    # A misspelt name would accept nothing, silently; the old group name says what to use.
    for name in PROTECTIONS:
        assert SandboxSpec(allow_degraded=frozenset({name})).allow_degraded == {name}
    with pytest.raises(SpecError, match="NO_CGROUP"):
        SandboxSpec(allow_degraded=frozenset({"cgroups"}))
    with pytest.raises(SpecError, match="check` lines"):
        SandboxSpec(allow_degraded=frozenset({"swap"}))
    assert SandboxSpec(allow_degraded={"cgroup-swap"}).allow_degraded == frozenset({"cgroup-swap"})


def test_every_host_unsupported_names_lines_of_check():
    # Each raise site names what it takes away as check's lines: read from the code, every
    # first argument is a literal line name or a module constant that holds only lines.
    with pytest.raises(ValueError, match="check"):
        HostUnsupported("cgroups", "a name that is no line")
    root = Path(karotte.__file__).parent
    sites = 0
    for path in sorted(root.rglob("*.py")):
        module = importlib.import_module(
            "karotte." + ".".join(path.relative_to(root).with_suffix("").parts)
            .removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "HostUnsupported"):
                sites += 1
                arg = node.args[0]
                names = (arg.value,) if isinstance(arg, ast.Constant) else getattr(module, arg.id)
                assert names and set(names) <= set(PROTECTIONS), f"{path}:{node.lineno}"
    assert sites >= 10


def test_an_exec_that_cannot_start_names_the_step_that_failed(no_leaks):
    # init reports a step code, not only words: the caller (and check) tells a missing
    # program from a missing directory without reading the message.
    with Sandbox() as sb:
        missing = sb.exec(["/no/such/program"])
        assert missing.exit_code == 127 and missing.error_step == "execve"
        assert "No such file" in missing.error
        elsewhere = sb.exec(["true"], cwd="/no/such/dir")
        assert elsewhere.exit_code == 127 and elsewhere.error_step == "chdir"
        assert sb.exec(["true"]).error_step is None
