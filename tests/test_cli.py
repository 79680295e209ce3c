"""karotte-sandbox exec / shell as a user sees them: exit statuses, --json, streaming, pty."""
from __future__ import annotations

import base64
import importlib.metadata
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

import karotte
from conftest import karotte_cgroups, run_karotte_sandbox
from karotte import cgroups

FIELDS = {"exit_code", "signal", "stdout", "stderr", "stdout_truncated", "stderr_truncated",
          "timed_out", "oom_killed", "wall_seconds", "cpu_seconds", "peak_memory", "error",
          "error_step", "egress", "egress_ip",
          "stdout_base64", "stderr_base64"}


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
    assert r.returncode == 125 and b"--memory lots: must be a size" in r.stderr


@pytest.mark.parametrize("option", ["--cpus", "--pids", "--timeout", "--inodes"])
def test_exec_limit_of_0_is_refused_with_the_specs_reason_not_taken_as_the_default(
        no_leaks, option):
    r = run_karotte_sandbox("exec", option, "0", "--", "true")
    assert r.returncode == 125, r.stderr
    assert f"{option} 0: must be a positive".encode() in r.stderr


@pytest.mark.parametrize("args", [["--memory", "-5M"], ["--memory=-5M"]])
def test_exec_negative_size_is_a_value_refused_with_the_specs_reason(no_leaks, args):
    r = run_karotte_sandbox("exec", *args, "--", "true")
    assert r.returncode == 125, r.stderr
    assert b"--memory -5M: must be a positive number of bytes" in r.stderr


def test_exec_cpus_beyond_the_hosts_are_refused_naming_how_many_it_has(no_leaks):
    host = len(os.sched_getaffinity(0))
    r = run_karotte_sandbox("exec", "--cpus", str(host + 1), "--", "true")
    assert r.returncode == 125
    assert f"run on {host} CPUs, so at most {host} can be given".encode() in r.stderr


def test_cli_errors_name_the_option_not_the_python_field(no_leaks):
    r = run_karotte_sandbox("exec", "--pids", "many", "--", "true")
    assert r.returncode == 125 and b"--pids many: must be a whole number" in r.stderr
    r = run_karotte_sandbox("exec", "--memory", "1M", "--", "true")
    assert b"--memory 1M: must be at least 16 MiB" in r.stderr
    for out in (r.stderr, run_karotte_sandbox("exec", "--cpus", "0", "--", "true").stderr):
        assert b"SandboxSpec" not in out and b"Traceback" not in out and b"Error:" not in out


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


def test_exec_json_with_a_bad_spec_prints_one_object_whose_error_says_why(no_leaks):
    r = run_karotte_sandbox("exec", "--json", "--pids", "0", "--", "true")
    assert r.returncode == 125
    obj = json.loads(r.stdout)
    assert set(obj) == FIELDS and obj["error"].endswith("--pids 0: must be a positive integer")
    assert all(obj[k] is None for k in FIELDS - {"error"})


def test_exec_json_gives_output_that_is_not_utf8_exactly_in_base64(no_leaks):
    data = bytes(range(256))
    r = run_karotte_sandbox("exec", "--json", "--", "cat", input=data)
    obj = json.loads(r.stdout)
    assert obj["stdout"] is None and base64.b64decode(obj["stdout_base64"]) == data
    assert obj["stderr"] == "" and obj["stderr_base64"] is None


def test_exec_streams_binary_output_byte_for_byte(no_leaks):
    data = bytes(range(256)) * 64
    r = run_karotte_sandbox("exec", "--", "cat", input=data)
    assert r.returncode == 0 and r.stdout == data


def test_exec_env_and_cwd_options_reach_the_command(no_leaks):
    r = run_karotte_sandbox("exec", "--env", "GREETING=a=b c", "--env", "LANG=C", "--cwd", "/tmp",
                            "--", "sh", "-c", 'echo "$GREETING|$LANG|$(pwd)"')
    assert r.returncode == 0 and r.stdout == b"a=b c|C|/tmp\n", r.stderr


def test_nproc_shows_the_sandboxs_cpus_rounded_up_and_cpu_count_still_the_hosts(no_leaks):
    host = len(os.sched_getaffinity(0))
    assert run_karotte_sandbox("exec", "--", "nproc").stdout == b"1\n"
    assert run_karotte_sandbox("exec", "--cpus", "0.5", "--", "nproc").stdout == b"1\n"
    if host >= 2:
        assert run_karotte_sandbox("exec", "--cpus", "1.5", "--", "nproc").stdout == b"2\n"
    r = run_karotte_sandbox("exec", "--", "python3", "-c", "import os; print(os.cpu_count())")
    assert r.stdout == f"{os.cpu_count()}\n".encode()


def test_a_command_that_cannot_be_executed_is_named_in_the_error(no_leaks):
    r = run_karotte_sandbox("exec", "--", "/etc/passwd")
    assert r.returncode == 127 and b"execvp /etc/passwd: Permission denied" in r.stderr
    r = run_karotte_sandbox("exec", "--", "no-such-program")
    assert r.returncode == 127 and b"execvp no-such-program: No such file" in r.stderr
    r = run_karotte_sandbox("exec", "--cwd", "/no/such/dir", "--", "true")
    assert r.returncode == 127 and b"chdir /no/such/dir: No such file" in r.stderr


def test_exec_binds_a_path_that_holds_a_colon_with_ro_bind(no_leaks):
    top = tempfile.mkdtemp(prefix="karotte-test-bind-")
    try:
        os.chmod(top, 0o755)
        odd = os.path.join(top, "a:b")
        os.mkdir(odd)
        with open(os.path.join(odd, "f"), "w") as f:
            f.write("colon")
        os.chmod(os.path.join(odd, "f"), 0o644)
        r = run_karotte_sandbox("exec", "--bind", f"{odd}:/data", "--", "true")
        assert r.returncode == 125 and b"use --ro-bind SRC DST" in r.stderr
        r = run_karotte_sandbox("exec", "--ro-bind", odd, "/data:x", "--", "cat", "/data:x/f")
        assert r.returncode == 0 and r.stdout == b"colon", r.stderr
    finally:
        shutil.rmtree(top)


def test_exec_into_a_closed_pipe_ends_quietly_with_the_status_of_sigpipe(no_leaks):
    proc = subprocess.Popen([sys.executable, "-m", "karotte.cli.sandbox", "exec", "--", "yes"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"y\n"
    proc.stdout.close()
    assert proc.wait(timeout=30) == 128 + signal.SIGPIPE
    assert proc.stderr.read() == b""
    proc.stderr.close()


def test_exec_limits_from_the_command_line_are_enforced(no_leaks):
    r = run_karotte_sandbox("exec", "--json", "--disk", "8M", "--", "sh", "-c",
                            "head -c 20M /dev/zero > /workspace/f")
    assert json.loads(r.stdout)["exit_code"] != 0
    r = run_karotte_sandbox("exec", "--json", "--memory", "64M", "--", "python3", "-c",
                            "b = bytearray(256 << 20)")
    obj = json.loads(r.stdout)
    assert obj["oom_killed"] and obj["signal"] == 9


def _shell_on_a_pty(*args: str) -> tuple[int, int]:
    """`karotte-sandbox shell ARGS` as a terminal window runs it: its session's
    controlling terminal is a pty, whose master (returned with the pid) is the window."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "karotte.cli.sandbox", "shell", *args])
    return pid, fd


def _read(fd: int, until: bytes | None = None, timeout: float = 30) -> bytes:
    """What the window shows, until `until` appears or the pty closes."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (until is None or until not in out):
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
    return out


def test_shell_gives_an_interactive_shell_on_a_real_pty(no_leaks):
    pid, fd = _shell_on_a_pty("--", "/bin/sh", "-i")
    try:
        os.write(fd, b"tty; echo answer=$((6*7)); exit 5\n")  # typed ahead: must not be lost
        out = _read(fd)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert b"answer=42" in out, out
    assert b"/dev/pts/0" in out  # a terminal of the sandbox's own devpts
    assert os.waitstatus_to_exitcode(status) == 5


def test_closing_the_window_of_a_shell_ends_it_and_leaves_no_cgroup_or_process(no_leaks):
    for _ in range(3):  # it was a race, lost 1 time in 3
        pid, fd = _shell_on_a_pty("--", "/bin/sh", "-i")
        try:
            os.write(fd, b"echo $((6*7))up\n")
            assert b"42up" in _read(fd, until=b"42up")
            assert karotte_cgroups(pid), "the shell's sandbox should exist while it runs"
            inits = [c.pid for c in psutil.Process(pid).children() if c.name() == "karotte-init"]
        finally:
            os.close(fd)  # the window closes: the terminal hangs up
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP
        assert karotte_cgroups(pid) == set()
        assert inits and not any(psutil.pid_exists(p) for p in inits)


def _shell(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "karotte.cli.sandbox", "shell", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_shell_into_a_closed_pipe_ends_quietly_with_the_status_of_sigpipe(no_leaks):
    proc = _shell("--", "sh", "-c", "yes")
    assert proc.stdout.readline().rstrip(b"\r\n") == b"y"
    proc.stdout.close()
    assert proc.wait(timeout=30) == 128 + signal.SIGPIPE
    assert proc.stderr.read() == b""  # no traceback, from the relay or its thread
    proc.stderr.close()


def test_shell_says_when_it_timed_out_and_exits_124(no_leaks):
    proc = _shell("--timeout", "1", "--", "sleep", "30")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 124 and err == b"karotte-sandbox: timed out after 1 s\n"


def test_shell_names_a_command_that_cannot_start_and_exits_127(no_leaks):
    proc = _shell("--", "/no/such/program")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 127
    assert err == b"karotte-sandbox: execvp /no/such/program: No such file or directory\n"


CRASHING_HOST = """
from karotte.sandbox import Sandbox
sb = Sandbox()
print(sb.init_pid, flush=True)
import time; time.sleep(1000)
"""


def test_gc_lists_and_removes_each_leftover_cgroup_on_one_line(no_leaks):
    host = subprocess.Popen([sys.executable, "-c", CRASHING_HOST], stdout=subprocess.PIPE)
    try:
        host.stdout.readline()
        dirs = cgroups.find_created_by(host.pid)
    finally:
        host.kill()
        host.wait()
        host.stdout.close()
    names = {os.path.basename(d) for d in dirs}
    assert len(names) == 1 and len(dirs) > 1, dirs  # one cgroup, a directory per hierarchy
    name = names.pop()
    deadline = time.monotonic() + 10
    while cgroups.find_created_by(host.pid) and time.monotonic() < deadline:
        r = run_karotte_sandbox("gc", "--dry-run")
        lines = [line for line in r.stdout.decode().splitlines() if name in line]
        assert lines == [f"would remove cgroup {name} ({len(dirs)} hierarchies)"], r.stdout
        r = run_karotte_sandbox("gc")
        removed = [line for line in r.stdout.decode().splitlines() if name in line]
        if removed:  # else its init was still dying: not stale yet
            assert removed == [f"removed cgroup {name} ({len(dirs)} hierarchies) and killed "
                               f"what was in it"], r.stdout
    assert cgroups.find_created_by(host.pid) == []


def test_both_clis_print_the_packages_version(no_leaks):
    assert importlib.metadata.version("karotte") == karotte.__version__
    for cli, name in (("sandbox", "karotte-sandbox"), ("main", "karotte")):
        r = subprocess.run([sys.executable, "-m", f"karotte.cli.{cli}", "--version"],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (0, f"{name} {karotte.__version__}\n"), r.stderr


def test_the_package_says_it_is_typed():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    assert (Path(karotte.__file__).parent / "py.typed").is_file()
    with open(Path(karotte.__file__).parent.parent / "pyproject.toml", "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["karotte"]
    assert "py.typed" in package_data  # shipped in the wheel, not only in the checkout


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


def test_exec_runs_on_an_image_given_with_image_and_names_the_grammar_when_it_is_bad(
        no_leaks, tmp_path):
    if not os.path.exists("/bin/busybox"):
        pytest.skip("/bin/busybox is missing (apt-get install busybox-static)")
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "etc").mkdir()
    shutil.copy("/bin/busybox", tree / "bin/busybox")
    for applet in ("sh", "cat", "ls"):
        (tree / "bin" / applet).symlink_to("busybox")
    (tree / "etc/os-release").write_text("ID=karotte-cli-test\n")
    tree.chmod(0o755)
    r = run_karotte_sandbox("exec", "--image", f"dir:{tree}", "--",
                            "/bin/sh", "-c", "cat /etc/os-release; ls /usr")
    assert r.stdout == b"ID=karotte-cli-test\n" and b"/usr" in r.stderr  # no host userland
    r = run_karotte_sandbox("exec", "--image", "bogus:x", "--", "true")
    assert r.returncode == 125 and b"--image bogus:x" in r.stderr
    assert b"an image reference is one of" in r.stderr
