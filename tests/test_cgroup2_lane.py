"""The cgroup v2 VM lane: on a host without a usable unified hierarchy, the tests marked
cgroup2 run inside a VM (scripts/cgroup2-vm, docs/cgroup2-vm-lane.md) and must pass there.

One boot runs the whole cgroup2 subset; this test fails if any of it fails, and also if
none of it passed (a lane that silently skips everything proves nothing). It runs on two
kernels: the release's own (Debian 12: 6.1) and its backports suite's (6.12), because
Karotte behaves differently from 6.12 on (memory.peak can be reset, so released cgroups
are reused).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ATTACK_PACKAGES, build_debian_tree

TESTS = Path(__file__).resolve().parent
LANE = TESTS.parent / "scripts" / "cgroup2-vm"
CGROUP_ROOT = Path("/sys/fs/cgroup")

# scripts/cgroup2-vm exit statuses (see its docstring).
PREPARE_MISSING_TOOL = 3
PREPARE_NO_KERNEL = 4

PREPARE_TIMEOUT_S = 600
# The whole cgroup2 subset under TCG; the run is killed (status 124) past this.
LANE_TIMEOUT_S = 840

# pytest's final line, e.g. "5 passed, 1 skipped in 12.34s".
SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ [a-z].*) in [\d.]+s( \([\d:]+\))?\s*=*$")
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def usable_unified_hierarchy() -> bool:
    """True when the cgroup2 tests can run here directly, without the VM."""
    with open("/proc/self/mounts") as mounts:
        fstypes = [line.split()[2] for line in mounts if line.split()[1] == str(CGROUP_ROOT)]
    if not fstypes or fstypes[-1] != "cgroup2":
        return False
    available = set((CGROUP_ROOT / "cgroup.controllers").read_text().split())
    return {"memory", "pids", "cpu"} <= available


def summary_counts(output: str) -> dict[str, int]:
    for line in reversed(output.splitlines()):
        match = SUMMARY.match(line.strip())
        if match:
            counts = {}
            for number, kind in COUNT.findall(match["counts"]):
                counts["error" if kind.startswith("error") else kind] = int(number)
            return counts
    raise AssertionError(f"no pytest summary line in the lane output:\n{output[-4000:]}")


@pytest.mark.skipif(os.environ.get("KAROTTE_VM_LANE") == "1",
                    reason="already inside the VM lane")
@pytest.mark.skipif(usable_unified_hierarchy(),
                    reason="this host has a usable cgroup v2 hierarchy; "
                           "the cgroup2 tests run on it directly")
@pytest.mark.parametrize("kernel", ["stable", "backports"])
def test_cgroup2_subset_passes_inside_the_vm_lane(kernel):
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 not found; apt-get install --no-install-recommends "
                    "qemu-system-x86 busybox-static kmod xz-utils zstd")
    prepared = subprocess.run([str(LANE), "--kernel", kernel, "prepare"], capture_output=True,
                              text=True, timeout=PREPARE_TIMEOUT_S)
    if prepared.returncode in (PREPARE_MISSING_TOOL, PREPARE_NO_KERNEL):
        pytest.skip(prepared.stderr.strip())
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr

    # The guest has no network: its image tests copy the trees the host has cached (or
    # skip, naming why, where the host could not build them).
    build_debian_tree("essential")
    build_debian_tree("apt", ATTACK_PACKAGES)
    command = [sys.executable, "-m", "pytest", "-m", "cgroup2", "-q",
               "-p", "no:cacheprovider", str(TESTS)]
    lane = subprocess.run([str(LANE), "--kernel", kernel, "run", "--timeout", str(LANE_TIMEOUT_S),
                           "--", *command],
                          capture_output=True, text=True, timeout=LANE_TIMEOUT_S + 60)
    output = lane.stdout + lane.stderr

    assert lane.returncode == 0, f"lane exit status {lane.returncode}:\n{output[-8000:]}"
    counts = summary_counts(lane.stdout)
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0, output[-8000:]
    assert counts.get("passed", 0) >= 1, f"no cgroup2 test passed in the lane:\n{output[-8000:]}"
