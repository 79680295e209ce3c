"""karotte-sandbox exec / shell as a user sees them: exit statuses, --json, streaming, pty."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

from conftest import karotte_cgroups, run_karotte_sandbox

FIELDS = {"exit_code", "signal", "stdout", "stderr", "stdout_truncated", "stderr_truncated",
          "timed_out", "oom_killed", "wall_seconds", "cpu_seconds", "peak_memory", "error"}


def test_exec_exit_status_is_the_commands_own(no_leaks):
    assert run_karotte_sandbox("exec", "--", "true").returncode == 0
    assert run_karotte_sandbox("exec", "--", "sh", "-c", "exit 7").returncode == 7


def test_exec_exit_status_is_128_plus_the_signal(no_leaks):
    assert run_karotte_sandbox("exec", "--", "sh", "-c", "kill -KILL $$").returncode == 128 + 9


def test_exec_exit_status_is_124_on_timeout(no_leaks):
    t = time.monotonic()
    r = run_karotte_sandbox("exec", "--timeout", "0.5", "--", "sleep", "30")
    assert r.returncode == 124 and b"timed out" in r.stderr
    assert time.monotonic() - t < 10


def test_exec_exit_status_is_125_with_the_cause_when_the_sandbox_cannot_be_made(no_leaks):
    r = run_karotte_sandbox("exec", "--bind", "/no/such/dir:/data", "--", "true")
    assert r.returncode == 125 and b"/no/such/dir" in r.stderr
    r = run_karotte_sandbox("exec", "--memory", "lots", "--", "true")
    assert r.returncode == 125 and b"not a size" in r.stderr


def test_exec_streams_output_and_passes_stdin(no_leaks):
    r = run_karotte_sandbox("exec", "--", "sh", "-c", "cat; echo err >&2", input=b"piped in\n")
    assert r.returncode == 0 and r.stdout == b"piped in\n" and r.stderr == b"err\n"


def test_exec_json_prints_one_object_with_every_result_field(no_leaks):
    r = run_karotte_sandbox("exec", "--json", "--memory", "256M", "--pids", "32", "--", "sh",
                            "-c", "echo out; echo err >&2; exit 3")
    assert r.returncode == 3
    obj = json.loads(r.stdout)
    assert set(obj) == FIELDS
    assert obj["stdout"] == "out\n" and obj["stderr"] == "err\n" and obj["exit_code"] == 3


def test_exec_limits_from_the_command_line_are_enforced(no_leaks):
    r = run_karotte_sandbox("exec", "--json", "--disk", "8M", "--", "sh", "-c",
                            "head -c 20M /dev/zero > /workspace/f")
    assert json.loads(r.stdout)["exit_code"] != 0
    r = run_karotte_sandbox("exec", "--json", "--memory", "64M", "--", "python3", "-c",
                            "b = bytearray(256 << 20)")
    obj = json.loads(r.stdout)
    assert obj["oom_killed"] and obj["signal"] == 9


def test_shell_gives_an_interactive_shell_on_a_real_pty(no_leaks):
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "karotte.cli.sandbox", "shell", "--",
                                  "/bin/sh", "-i"])
    out = b""
    try:
        os.write(fd, b"tty; echo answer=$((6*7)); exit 5\n")  # typed ahead: must not be lost
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert b"answer=42" in out, out
    assert b"/dev/pts/0" in out  # a terminal of the sandbox's own devpts
    assert os.waitstatus_to_exitcode(status) == 5


def test_help_names_every_subcommand():
    r = subprocess.run([sys.executable, "-m", "karotte.cli.sandbox", "--help"],
                       capture_output=True, text=True)
    for cmd in ("exec", "shell", "check", "gc"):
        assert cmd in r.stdout


def test_sigterm_of_karotte_sandbox_destroys_its_sandbox(no_leaks):
    proc = subprocess.Popen([sys.executable, "-m", "karotte.cli.sandbox", "exec", "--",
                             "sh", "-c", "echo up; sleep 100"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    creator = proc.pid
    assert karotte_cgroups(creator), "the sandbox's cgroup should exist while it runs"
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    proc.stdout.close()
    assert karotte_cgroups(creator) == set()
