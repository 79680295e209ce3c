"""Sandboxes created by an unprivileged caller: the kernel lets them map only their own
uid, so each command gets a nested user namespace in which it is uid 1000."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig

import pytest

from conftest import BPF_JIT_CALLS, NOBODY, SYSCALL_PROBE, delegated_v1_cgroup
from karotte.protections import CGROUP_LINES

SYSTEM_PYTHON = "/usr/bin/python3"
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, os, signal
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec, MiB
from karotte.errors import HostUnsupported
out = {"caller": os.geteuid()}
try:
    spec = SandboxSpec(memory=96 * MiB, allow_degraded=frozenset(os.environ.get("DEGRADE", "").split()))
    with Sandbox(spec) as sb:
        out["id"] = sb.exec(["id", "-u"]).stdout.decode().strip()
        out["caps"] = sb.exec("grep CapEff /proc/self/status").stdout.decode().split()[1]
        out["seccomp"] = sb.exec("grep ^Seccomp: /proc/self/status").stdout.decode().split()[1]
        out["filters"] = sb.exec("grep ^Seccomp_filters: /proc/self/status").stdout.decode().split()[1]
        out["write"] = sb.exec("echo hi > /workspace/f && cat /workspace/f").stdout.decode().strip()
        out["hostname"] = sb.exec(["hostname"]).stdout.decode().strip()
        r = sb.exec(["python3", "-c", "b = bytearray(1 << 30)"])
        out["oom"] = [r.signal == signal.SIGKILL, r.oom_killed]
        out["cgroup"] = sb.cgroup is not None
        r = sb.exec("prlimit --pid 1 --nofile=3:3 2>&1; echo rc=$?")
        out["prlimit_init"] = r.stdout.decode()
        out["after_prlimit"] = sb.exec(["echo", "still-serving"]).stdout.decode().strip()
        r = sb.exec(["python3", "-c", os.environ["PROBE"], os.environ["CALLS"]])
        out["bpfjit"] = json.loads(r.stdout or "null")
except HostUnsupported as e:
    out["unsupported"] = [e.protection, str(e)]
print(json.dumps(out))
"""


def _run_as_nobody(env_extra: dict[str, str]) -> dict:
    site = sysconfig.get_paths()["purelib"]  # the venv's site-packages: cffi backend, psutil
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROJECT}:{site}", "PROBE": SYSCALL_PROBE,
           "CALLS": json.dumps(BPF_JIT_CALLS), **env_extra}
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        SYSTEM_PYTHON, "-c", SCRIPT], env=env, capture_output=True, timeout=120,
                       cwd="/")
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to an unprivileged uid"
    if not (os.path.exists(SYSTEM_PYTHON) and shutil.which("setpriv")):
        return "needs /usr/bin/python3 and setpriv (util-linux)"
    site = sysconfig.get_paths()["purelib"]
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            SYSTEM_PYTHON, "-c", "import karotte.native, psutil"],
                           env={"PYTHONPATH": f"{PROJECT}:{site}"}, capture_output=True, cwd="/")
    if probe.returncode != 0:
        return ("the checkout and its venv must be readable by uid 65534 with the system "
                f"Python: {probe.stderr.decode().strip().splitlines()[-1:]}")
    return None


pytestmark = pytest.mark.skipif(_usable() is not None, reason=str(_usable()))


@pytest.fixture
def delegated_v1_parent():
    with delegated_v1_cgroup("unpriv-test") as parent:
        yield parent


def test_unprivileged_caller_gets_a_working_sandbox_with_agent_uid_1000(delegated_v1_parent):
    out = _run_as_nobody({"KAROTTE_CGROUP_PARENT": delegated_v1_parent})
    assert out["caller"] == NOBODY
    assert out["id"] == "1000" and out["hostname"] == "karotte" and out["write"] == "hi"
    assert int(out["caps"], 16) == 0 and out["seccomp"] == "2" and out["filters"] == "1"
    assert out["oom"] == [True, True] and out["cgroup"]


def test_unprivileged_caller_without_a_cgroup_fails_closed_naming_the_fix():
    out = _run_as_nobody({})
    protection, message = out["unsupported"]
    assert protection == "cgroup-memory"  # the first of the check lines it takes away
    assert message.startswith(", ".join(CGROUP_LINES) + ": ")
    assert "allow_degraded" in message


def test_unprivileged_caller_may_accept_running_without_cgroups():
    out = _run_as_nobody({"DEGRADE": " ".join(CGROUP_LINES)})
    assert out["id"] == "1000" and out["cgroup"] is False
    assert out["oom"][0] is False  # no memory limit: the 1 GiB allocation succeeds


def test_PROC_LIMITS_01_prlimit_on_another_process_is_denied(delegated_v1_parent):
    # The agent shares init's host uid here; only seccomp stops it wedging init.
    out = _run_as_nobody({"KAROTTE_CGROUP_PARENT": delegated_v1_parent})
    assert "Operation not permitted" in out["prlimit_init"] and "rc=0" not in out["prlimit_init"]
    assert out["after_prlimit"] == "still-serving"


def test_RES_BPFJIT_01_the_agent_of_an_unprivileged_caller_cannot_load_filters(delegated_v1_parent):
    # Here each command's own process loads the policy, last before execve; the agent's
    # attempts come after it and are refused.
    out = _run_as_nobody({"KAROTTE_CGROUP_PARENT": delegated_v1_parent})
    assert out["filters"] == "1"
    assert out["bpfjit"] == {name: "EPERM" for name, _, _ in BPF_JIT_CALLS}


HIDE_INIT = r"""
import json
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec, MiB
from karotte.protections import NO_CGROUP
with Sandbox(SandboxSpec(memory=96 * MiB, allow_degraded=NO_CGROUP)) as sb:
    wrote = sb.exec("echo 1000 > /proc/1/oom_score_adj").exit_code
    signals = sb.exec("kill -0 1").exit_code  # init is still there, only hidden
    print(json.dumps([wrote, signals, sb.exec(["echo", "alive"]).stdout.decode()]))
"""


def test_ROOT_OOM_01_an_unprivileged_callers_agent_cannot_raise_inits_oom_score():
    # The agent is the caller's own host uid, as init is: it owned init's /proc/1 files
    # and could make init the OOM killer's first choice, ending its own sandbox mid-run.
    site = sysconfig.get_paths()["purelib"]
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        SYSTEM_PYTHON, "-c", HIDE_INIT], capture_output=True, timeout=120,
                       cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROJECT}:{site}"})
    assert r.returncode == 0, r.stderr.decode()
    wrote, signals, alive = json.loads(r.stdout)
    assert wrote != 0 and signals == 0 and alive == "alive\n"
