"""Shared fixtures: real sandboxes, and a check that a test left nothing on the host."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from karotte import cgroups
from karotte.errors import KarotteError
from karotte.sandbox import DEFAULT_UID_BASE, Sandbox
from karotte.spec import MiB, SandboxSpec

PYTHON_IN_SANDBOX = "/usr/bin/python3"  # the host's system Python, bound read-only


def karotte_cgroups(creator: int | None = None) -> set[str]:
    """karotte-* cgroup directories made by the process `creator` (default: this one;
    other test runs may share the machine), less the empty ones this process keeps for
    reuse (which must hold no task)."""
    found = set(cgroups.find_created_by(creator))
    if creator not in (None, os.getpid()):
        return found
    pooled = cgroups.pooled_paths()
    for path in pooled:
        with open(os.path.join(path, "cgroup.procs")) as f:
            assert f.read() == "", f"a pooled cgroup holds tasks: {path}"
    return found - pooled


def needs_sandbox():
    """A skip mark for tests that need a working sandbox on this host, naming why not."""
    try:
        Sandbox().close()
        why = None
    except KarotteError as exc:
        why = str(exc)
    return pytest.mark.skipif(why is not None,
                              reason=f"Karotte cannot create a sandbox here: {why}")


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def sandbox_processes() -> set[int]:
    """Every process on the host that runs under a sandbox's ids, or is a karotte-init,
    whoever its parent is now. (Counting all host processes would also count the host's
    own churn: kworkers after cgroup work, timers, logins.)"""
    base = int(os.environ.get("KAROTTE_UID_BASE", DEFAULT_UID_BASE))
    found = set()
    for proc in psutil.process_iter(["uids", "name"]):
        uids = proc.info["uids"]
        if proc.info["name"] == "karotte-init" or (uids and max(uids) >= base):
            found.add(proc.pid)
    return found


def child_inits() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True)
            if c.name() == "karotte-init"]


# Mounts that the host makes on its own while tests run: a login's runtime dir, the
# binfmt_misc automount. Karotte mounts nothing there.
HOST_MOUNT_CHURN = ("/run/user/", "/proc/sys/fs/binfmt_misc")


def host_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f
                if not line.split()[4].startswith(HOST_MOUNT_CHURN)]


@pytest.fixture
def no_leaks():
    """Asserts that the test left no sandbox cgroup, fd, init process or mount behind."""
    cgroups_before = karotte_cgroups()
    fds_before = open_fds()
    mounts_before = host_mounts()
    yield
    assert karotte_cgroups() - cgroups_before == set(), "sandbox cgroups left on the host"
    assert child_inits() == [], "karotte-init processes left running"
    leaked = open_fds() - fds_before
    assert leaked == set(), f"fds left open: {[os.readlink(f'/proc/self/fd/{fd}') for fd in leaked if os.path.exists(f'/proc/self/fd/{fd}')]}"
    assert host_mounts() == mounts_before, "the host's mount table changed"


@pytest.fixture
def sandbox(no_leaks):
    with Sandbox(SandboxSpec()) as sb:
        yield sb


@pytest.fixture
def small_sandbox(no_leaks):
    """A sandbox with small limits, for resource attacks."""
    with Sandbox(SandboxSpec(memory=128 * MiB, pids=64, disk=64 * MiB, inodes=4096,
                             tmp_size=32 * MiB, timeout=20)) as sb:
        yield sb


def py(code: str) -> list[str]:
    """argv running a Python snippet inside the sandbox."""
    return [PYTHON_IN_SANDBOX, "-I", "-c", code]


def run_karotte_sandbox(*args: str, input: bytes | None = None,
                        timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "karotte.cli.sandbox", *args], input=input,
                          capture_output=True, timeout=timeout)
