"""What the cgroup v2 backend relies on from the kernel, checked on a real v2 hierarchy.

These run where /sys/fs/cgroup is a unified cgroup2 mount: inside the VM lane
(scripts/cgroup2-vm, which exports KAROTTE_CGROUP_PARENT) or on a v2 host that sets
KAROTTE_CGROUP_PARENT to a cgroup delegated to the test user. Each test works in its own
child cgroup, karotte-smoke-<pid>, and removes it whatever happens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

CGROUP_ROOT = Path("/sys/fs/cgroup")
REQUIRED_CONTROLLERS = {"memory", "pids", "cpu"}


def unified_hierarchy_with_controllers() -> bool:
    """True when /sys/fs/cgroup is cgroup2 and offers memory, pids and cpu."""
    with open("/proc/self/mounts") as mounts:
        fstypes = [line.split()[2] for line in mounts if line.split()[1] == str(CGROUP_ROOT)]
    if not fstypes or fstypes[-1] != "cgroup2":
        return False
    available = set((CGROUP_ROOT / "cgroup.controllers").read_text().split())
    return REQUIRED_CONTROLLERS <= available


pytestmark = [
    pytest.mark.cgroup2,
    pytest.mark.skipif(not unified_hierarchy_with_controllers(),
                       reason="needs /sys/fs/cgroup to be cgroup2 with memory, pids and cpu; "
                              "on a cgroup v1 host run it with scripts/cgroup2-vm"),
]

SETTLE_S = 10.0


@pytest.fixture
def parent() -> Path:
    value = os.environ.get("KAROTTE_CGROUP_PARENT")
    if not value:
        pytest.skip("KAROTTE_CGROUP_PARENT is not set; the VM lane sets it, on a v2 host "
                    "point it at a cgroup delegated to you")
    return Path(value)


def wait_until_empty(cgroup: Path) -> bool:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if "populated 0" in (cgroup / "cgroup.events").read_text().splitlines():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def cgroup(parent: Path):
    """A fresh child of KAROTTE_CGROUP_PARENT with memory, pids and cpu available."""
    child = parent / f"karotte-smoke-{os.getpid()}"
    child.mkdir()
    try:
        yield child
    finally:
        # Kill what a failed test left behind, or rmdir fails with EBUSY.
        if (child / "cgroup.kill").exists():
            (child / "cgroup.kill").write_text("1")
        else:
            for pid in (child / "cgroup.procs").read_text().split():
                os.kill(int(pid), 9)
        wait_until_empty(child)
        child.rmdir()


def start_in(cgroup: Path, code: str) -> subprocess.Popen:
    """Run `code` in a Python child that is inside `cgroup` before its first line runs.

    The child waits for a go byte on a pipe that is sent only once its pid is in
    cgroup.procs, so nothing it allocates or forks is charged elsewhere; if the move
    fails, the pipe closes without the byte and the child exits without running `code`.
    """
    gate, go = os.pipe()
    gated = f"import os, sys\nif os.read({gate}, 1) != b'g':\n    sys.exit(99)\n{code}"
    child = subprocess.Popen([sys.executable, "-c", gated], pass_fds=(gate,),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(gate)
    try:
        (cgroup / "cgroup.procs").write_text(str(child.pid))
        os.write(go, b"g")
    finally:
        os.close(go)
    return child


def events(cgroup: Path, name: str) -> dict[str, int]:
    lines = (cgroup / name).read_text().splitlines()
    return {key: int(value) for key, value in (line.split() for line in lines)}


def test_lane_parent_has_memory_pids_cpu_enabled_for_children(parent: Path):
    assert parent.is_dir()
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    assert REQUIRED_CONTROLLERS <= enabled


def test_allocation_beyond_memory_max_is_oom_killed(cgroup: Path):
    (cgroup / "memory.max").write_text(str(64 << 20))
    if (cgroup / "memory.swap.max").exists():
        (cgroup / "memory.swap.max").write_text("0")
    before = events(cgroup, "memory.events")["oom_kill"]

    # The child resets the oom_score_adj it inherits from this test process: at -1000
    # (left by code that ran earlier in the same pytest) nothing in the cgroup can be
    # killed, and the allocation spins at memory.max instead. bytes * n writes every
    # page, so the whole 256 MiB is charged.
    child = start_in(cgroup, "with open('/proc/self/oom_score_adj', 'w') as adj:\n"
                             "    adj.write('0')\n"
                             "block = b'x' * (256 << 20)\n"
                             "print('survived')")
    out, _ = child.communicate(timeout=60)

    assert child.returncode == -9
    assert "survived" not in out
    assert events(cgroup, "memory.events")["oom_kill"] > before


def test_fork_beyond_pids_max_fails_with_eagain(cgroup: Path):
    (cgroup / "pids.max").write_text("1")
    code = (
        "import errno, os\n"
        "try:\n"
        "    pid = os.fork()\n"
        "except OSError as error:\n"
        "    print(errno.errorcode[error.errno])\n"
        "else:\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    print('forked')\n"
    )
    child = start_in(cgroup, code)
    out, err = child.communicate(timeout=60)

    assert child.returncode == 0, err
    assert out.split() == ["EAGAIN"]
    assert events(cgroup, "pids.events")["max"] >= 1


def test_cgroup_kill_empties_the_cgroup(cgroup: Path):
    if not (cgroup / "cgroup.kill").exists():
        pytest.skip("cgroup.kill needs Linux 5.14 or later")
    # A child with a grandchild of its own: cgroup.kill must reach both.
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(600)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    child = start_in(cgroup, code)
    assert child.stdout.readline().strip() == "ready"
    assert len((cgroup / "cgroup.procs").read_text().split()) == 2

    (cgroup / "cgroup.kill").write_text("1")

    assert wait_until_empty(cgroup)
    assert child.wait(timeout=SETTLE_S) == -9
    child.stdout.close()
    child.stderr.close()


def test_unprivileged_user_can_create_a_user_namespace():
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    nobody = 65534
    # As an unprivileged uid, with no capabilities: the case of a sandbox started by a
    # non-root supervisor. Fails with EPERM in a chroot or when the sysctls forbid it.
    drop_root = (dict(user=nobody, group=nobody, extra_groups=[]) if os.geteuid() == 0
                 else {})
    done = subprocess.run([unshare, "--user", "--map-root-user", "id", "-u"],
                          capture_output=True, text=True, timeout=60, **drop_root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
