"""How a process that holds sandboxes ends: SIGKILL in the middle of spawning, SIGINT,
SIGTERM and SIGHUP, exit with sandboxes never closed, running out of fds.

Each trainer here is a subprocess of its own; after it ends, nothing of it may be left:
no process in a cgroup it made (zombies included: /proc lists their cgroups until they
are reaped), and, unless it was SIGKILLed, no cgroup and no private directory either.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from karotte import cgroups, hostdirs
from karotte.errors import SandboxError
from karotte.sandbox import AsyncSandbox, Sandbox

from conftest import only_fds_to_spare

TESTS = Path(__file__).resolve().parent
KILLS = 20  # trainers killed in a row by each kill test
GONE_WITHIN = 10.0  # seconds for inits to see EOF and their PID namespaces to die

SPAWN_FROM_THREADS = """
import threading, time
from karotte.sandbox import Sandbox

def spawn():  # many sandboxes live, one spawn after another
    live = []
    while True:
        live.append(Sandbox())
        live[-1].exec("sleep 1000 &")
        if len(live) > 3:
            live.pop(0).close()

for _ in range(6):
    threading.Thread(target=spawn, daemon=True).start()
print("spawning", flush=True)
time.sleep(1000)
"""

SPAWN_FROM_ASYNCIO = """
import asyncio
from karotte.sandbox import AsyncSandbox

async def spawn():
    live = []
    while True:
        live.append(await AsyncSandbox().start())
        if len(live) > 3:
            await live.pop(0).close()

async def main():
    tasks = [asyncio.create_task(spawn()) for _ in range(6)]
    print("spawning", flush=True)
    await asyncio.gather(*tasks)

asyncio.run(main())
"""

# A library trainer on the documented path: the handlers, and episodes in `async with`.
TRAINER_WITH_HANDLERS = """
import asyncio, sys
from karotte import lifecycle
from karotte.episode import AsyncEpisode
from karotte.errors import KarotteError
sys.path.insert(0, sys.argv[1])
from envs.basic import Addition

lifecycle.install_signal_handlers()

async def episode(seed):
    try:
        async with AsyncEpisode(Addition(), seed=seed) as ep:
            await ep.reset()
            for command in ep.reference_solution():
                await ep.exec(command)
            outcome = await ep.finish()
            print(outcome.reason, flush=True)
    except KarotteError:
        pass  # stopped by the signal

async def main():
    await asyncio.gather(*(episode(seed) for seed in range(400)))

asyncio.run(main())
"""


def dirs_of(creator: int) -> list[str]:
    top = hostdirs.runtime_dir()
    return [os.path.join(top, n) for n in os.listdir(top)
            if n.startswith(f"{cgroups.PREFIX}{creator}.")]


def wait_gone(creator: int) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN
    while (left := cgroups.processes_of(creator)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def remove_remains(creator: int) -> None:
    """What a SIGKILLed trainer leaves by design, for gc: removed here for this one only
    (gc would also take other test runs' dead trainers' remains)."""
    for path in cgroups.find_created_by(creator):
        cgroups.remove_stale(path)
    for path in dirs_of(creator):
        shutil.rmtree(path, ignore_errors=True)


def assert_nothing_left(creator: int) -> None:
    assert wait_gone(creator) == [], "sandbox processes outlived their trainer"
    assert cgroups.find_created_by(creator) == [], "cgroups left on the host"
    assert dirs_of(creator) == [], "private directories left on the host"


# --------------------------------------------------------------------------- SIGKILL


@pytest.mark.parametrize("trainer", [SPAWN_FROM_THREADS, SPAWN_FROM_ASYNCIO],
                         ids=["threads", "asyncio"])
def test_sigkill_of_a_trainer_in_the_middle_of_spawning_leaves_no_sandbox_process(trainer):
    # A spawn child waiting for its go held a copy of the trainer's fd table: every
    # init's control socket stayed open, and every sandbox outlived the trainer.
    rng = random.Random(11)
    for kill in range(KILLS):
        host = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE)
        try:
            assert host.stdout.readline() == b"spawning\n"
            time.sleep(rng.uniform(0.05, 0.5))
        finally:
            host.kill()
            host.wait()
            host.stdout.close()
        try:
            left = wait_gone(host.pid)
            assert left == [], f"kill {kill + 1} of {KILLS}: {len(left)} sandbox processes " \
                               "outlived their trainer"
        finally:
            remove_remains(host.pid)


def test_gc_removes_the_private_directories_a_killed_trainer_left(no_leaks):
    code = """
import json, time
from karotte.grading import grader_library, private_dir
print(json.dumps([private_dir("hidden"), private_dir("submission"), grader_library("karotte")]),
      flush=True)
time.sleep(1000)
"""
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        paths = json.loads(host.stdout.readline())
    finally:
        host.kill()
        host.wait()
        host.stdout.close()
    assert all(os.path.isdir(p) for p in paths)
    r = subprocess.run([sys.executable, "-m", "karotte.cli.sandbox", "gc"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for path in paths:
        assert f"removed directory {path}" in r.stdout
        assert not os.path.exists(path)


@pytest.mark.parametrize("make", ["from karotte import mounts; print(mounts.etc_dir('x'))",
                                  "from karotte import hostdirs; print(hostdirs.new_dir('t', 0o700))"])
def test_a_process_that_made_only_host_directories_removes_them_at_exit(make):
    # No sandbox, so nothing imported lifecycle: the directories still go with the process.
    r = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert os.path.basename(path).startswith("karotte-") and not os.path.exists(path)


# --------------------------------------------------------------------------- signals


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} records in {path} (exit status {proc.poll()})")


def end_by_signal(proc: subprocess.Popen, sig: int, ready) -> tuple[str, str]:
    """Once ready() has returned, send sig and wait for proc's end (stdout, stderr)."""
    try:
        ready()
        proc.send_signal(sig)
        return proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()


each_signal = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                                      ids=["SIGTERM", "SIGINT", "SIGHUP"])


@each_signal
def test_karotte_run_ended_by_a_signal_prints_the_summary_exits_128_plus_it_and_leaves_nothing(
        tmp_path, sig):
    out = tmp_path / "out.jsonl"
    run = subprocess.Popen(
        [sys.executable, "-m", "karotte.cli.main", "run", "envs.basic:Addition", "-n", "400",
         "--concurrency", "16", "--out", str(out)],
        cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = end_by_signal(run, sig, lambda: wait_for_lines(out, 3, run))
    assert run.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr
    assert f"karotte run: stopped by {sig.name}" in stderr
    finished = len(out.read_text().splitlines())
    assert 3 <= finished < 400
    assert f"episodes      {finished}\n" in stdout  # the summary of those finished
    assert_nothing_left(run.pid)


@each_signal
def test_karotte_sandbox_exec_ended_by_a_signal_exits_128_plus_it_and_leaves_nothing(sig):
    run = subprocess.Popen(
        [sys.executable, "-m", "karotte.cli.sandbox", "exec", "--", "sh", "-c",
         "echo started; sleep 1000 & sleep 1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def started() -> None:
        assert run.stdout.readline() == "started\n"

    _, stderr = end_by_signal(run, sig, started)
    assert run.returncode == 128 + sig, stderr
    assert stderr == f"karotte-sandbox: stopped by {sig.name}\n"
    assert_nothing_left(run.pid)


def test_karotte_check_ended_by_sigterm_exits_143_and_leaves_nothing():
    run = subprocess.Popen([sys.executable, "-m", "karotte.cli.main", "check", "envs.basic:Addition"],
                           cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def in_flight() -> None:  # the battery runs far longer: episodes and hidden files live
        time.sleep(3)
        assert run.poll() is None, run.communicate()

    _, stderr = end_by_signal(run, signal.SIGTERM, in_flight)
    assert run.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "karotte check: stopped by SIGTERM" in stderr
    assert_nothing_left(run.pid)


def test_a_trainer_with_the_signal_handlers_installed_leaves_nothing_after_sigterm():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER_WITH_HANDLERS, str(TESTS)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def graded() -> None:
        for _ in range(3):
            assert trainer.stdout.readline() == "graded\n"

    _, stderr = end_by_signal(trainer, signal.SIGTERM, graded)
    assert trainer.returncode == 128 + signal.SIGTERM, stderr
    assert_nothing_left(trainer.pid)


def test_karotte_run_out_file_holds_every_record_printed_before_a_sigkill(tmp_path):
    out = tmp_path / "out.jsonl"
    run = subprocess.Popen(
        [sys.executable, "-m", "karotte.cli.main", "run", "envs.basic:Addition", "-n", "400",
         "--concurrency", "8", "--json", "--out", str(out)],
        cwd=TESTS, stdout=subprocess.PIPE, text=True)
    try:
        printed = [run.stdout.readline() for _ in range(5)]
    finally:
        run.kill()
        run.wait()
        run.stdout.close()
    remove_remains(run.pid)
    written = out.read_text().splitlines(keepends=True)
    assert set(printed) <= set(written)


# --------------------------------------------------------------------------- never closed


def test_a_sandbox_never_closed_is_destroyed_when_it_is_collected(no_leaks):
    sb = Sandbox()
    sb.exec("sleep 1000 &")
    init = sb.init_pid
    del sb
    gc.collect()
    assert not psutil.pid_exists(init), "its init lives on, or is a zombie nobody reaps"


def test_an_async_sandbox_never_closed_is_destroyed_when_it_is_collected(no_leaks):
    async def drop() -> int:
        sb = await AsyncSandbox().start()
        await sb.exec("sleep 1000 &")
        return sb.init_pid

    init = asyncio.run(drop())
    gc.collect()
    assert not psutil.pid_exists(init), "its init lives on, or is a zombie nobody reaps"


def test_sandboxes_never_closed_are_destroyed_when_the_trainer_exits():
    code = """
from karotte.sandbox import Sandbox
kept = [Sandbox() for _ in range(4)]  # still referenced when the interpreter exits
for sb in kept:
    sb.exec("sleep 1000 & (setsid sleep 1000 &)")
"""
    trainer = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    _, stderr = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, stderr
    assert stderr == ""
    assert_nothing_left(trainer.pid)


def test_a_trainer_that_turns_sigterm_into_its_own_exception_leaves_nothing():
    # Not the documented handlers: the atexit net alone removes the sandboxes it holds and
    # the private directory of hidden answers it made.
    code = """
import signal, sys, time
from karotte.grading import private_dir
from karotte.sandbox import Sandbox
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
kept = [Sandbox() for _ in range(4)]
for sb in kept:
    sb.exec("sleep 1000 &")
open(private_dir("hidden") + "/expected.txt", "w").write("42")
print("ready", flush=True)
time.sleep(1000)
"""
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)

    def ready() -> None:
        assert trainer.stdout.readline() == "ready\n"

    _, stderr = end_by_signal(trainer, signal.SIGTERM, ready)
    assert trainer.returncode == 1, stderr
    assert_nothing_left(trainer.pid)


# --------------------------------------------------------------------------- fds


def test_the_soft_fd_limit_is_raised_to_the_hard_one_at_import():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 1024:
        pytest.skip(f"needs a hard RLIMIT_NOFILE above 1024; this process has {hard}")
    r = subprocess.run(
        [sys.executable, "-c", "import resource, karotte.sandbox; "
         "print(*resource.getrlimit(resource.RLIMIT_NOFILE))"],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)),
        capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == [str(hard), str(hard)], r.stderr


@pytest.mark.parametrize("spare", range(6))  # the 3 pipes of an exec take 6
def test_running_out_of_fds_in_exec_is_named_as_the_cause(no_leaks, spare):
    with Sandbox() as sb:
        with only_fds_to_spare(spare):
            with pytest.raises(SandboxError, match="out of file descriptors"):
                sb.exec(["true"])
        assert sb.exec(["echo", "ok"]).stdout == b"ok\n"


def test_a_forked_child_that_exits_leaves_its_parents_private_directories(no_leaks):
    # Exit handlers are inherited by fork: ones that removed a path removed the parent's
    # /etc copy and grader library when a child exited normally. Cleanup at exit removes
    # only what the exiting process itself made.
    code = """
import os, sys
from karotte.grading import grader_library
from karotte.mounts import etc_dir
from karotte.sandbox import Sandbox
with Sandbox() as sb:
    sb.exec(["true"])
paths = [etc_dir("karotte"), grader_library("karotte")]
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: atexit handlers run
os.waitpid(pid, 0)
print(all(os.path.isdir(p) for p in paths))
with Sandbox() as sb:
    print(sb.exec(["cat", "/etc/hostname"]).stdout.decode().strip())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "karotte"]


# A process with the handlers forks a child that runs on without exec (as pyroute2's
# netns helper does): the child must die of SIGTERM as its forker expects, not get
# Terminated raised into its code and run on (CI: a pytest child ran the rest of the
# suite after its SIGTERM).
FORKS_A_CHILD = """
import os, signal, sys, time
from karotte import lifecycle
lifecycle.install_signal_handlers()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, b"x")
    try:
        time.sleep(30)
    except BaseException as exc:
        print("child raised", type(exc).__name__, flush=True)
    os._exit(0)
os.read(r, 1)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status), flush=True)
"""


def test_a_child_forked_without_exec_dies_of_sigterm_not_terminated(no_leaks):
    run = subprocess.run([sys.executable, "-c", FORKS_A_CHILD], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(int(signal.SIGTERM))], run.stdout
