"""karotte.gc: what a crashed trainer left (its sandbox's cgroup, its private directories)
is found, and removed; a dry run removes nothing; what live processes made is never found.

Each trainer is a real process that makes a sandbox and is SIGKILLed, so that none of
its exit handlers run. gc.find() lists the remains of every dead creator on the host
(other test runs share it): the tests act only on their own trainer's.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from karotte import cgroups, gc, hostdirs
from karotte.sandbox import Sandbox

TRAINER = """
import json, time
from karotte import cgroups, hostdirs
from karotte.grading import private_dir
from karotte.sandbox import Sandbox
sb = Sandbox()
sb.exec("sleep 1000 &")
private_dir("hidden")
print(json.dumps({"cgroup": cgroups.find_created_by(), "dirs": hostdirs.find_created_by()}),
      flush=True)
time.sleep(1000)
"""


def start_trainer() -> tuple[subprocess.Popen, dict]:
    host = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE)
    try:
        made = json.loads(host.stdout.readline())
    except BaseException:
        host.kill()
        host.wait()
        raise
    assert made["cgroup"] and len(made["dirs"]) >= 2, made  # /etc copy and the hidden dir
    return host, made


def stop(host: subprocess.Popen) -> None:
    host.kill()
    host.wait()
    host.stdout.close()


def remove_remains(creator: int) -> None:
    """Whatever a test left of its own trainer (never other runs' leftovers)."""
    for path in cgroups.find_created_by(creator):
        cgroups.remove_stale(path)
    top = hostdirs.runtime_dir()
    for name in os.listdir(top):
        if name.startswith(f"{cgroups.PREFIX}{creator}."):
            shutil.rmtree(os.path.join(top, name), ignore_errors=True)


@pytest.fixture
def killed():
    """A trainer SIGKILLed while it held a sandbox: (its pid, what it had made)."""
    host, made = start_trainer()
    stop(host)
    try:
        yield host.pid, made
    finally:
        remove_remains(host.pid)


def of(creator: int) -> list[gc.Leftover]:
    return [leftover for leftover in gc.find() if leftover.creator == creator]


def test_find_lists_the_cgroup_and_directories_a_killed_trainer_left_and_remove_removes_them(
        killed):
    pid, made = killed
    found = of(pid)
    cgroup = [leftover for leftover in found if leftover.kind == gc.CGROUP]
    dirs = [leftover for leftover in found if leftover.kind == gc.DIRECTORY]
    assert len(cgroup) == 1, found  # one cgroup, whatever the number of hierarchies
    assert set(cgroup[0].paths) == set(made["cgroup"])
    assert cgroup[0].name == os.path.basename(made["cgroup"][0])
    assert sorted(p for leftover in dirs for p in leftover.paths) == sorted(made["dirs"])
    assert found.index(cgroup[0]) < min(found.index(d) for d in dirs)  # cgroups go first
    assert all(f"process {pid}" in leftover.why for leftover in found)

    done = gc.remove(found)
    assert [(r.leftover, r.removed, r.error) for r in done] == [(f, True, None) for f in found]
    assert [p for p in made["cgroup"] + made["dirs"] if os.path.exists(p)] == []
    assert cgroups.processes_of(pid) == [], "gc removed the cgroup but not what ran in it"
    assert of(pid) == []


def test_a_dry_run_removes_nothing(killed):
    pid, made = killed
    found = of(pid)
    assert {p for leftover in found for p in leftover.paths} == set(made["cgroup"] + made["dirs"])
    done = gc.remove(found, dry_run=True)
    assert [(r.leftover, r.removed, r.error) for r in done] == [(f, False, None) for f in found]
    assert all(os.path.exists(p) for p in made["cgroup"] + made["dirs"])
    assert of(pid) == found


def test_a_leftover_that_cannot_be_removed_is_reported_and_the_others_still_go(killed):
    pid, made = killed
    found = of(pid)
    gone = next(leftover for leftover in found if leftover.kind == gc.DIRECTORY)
    shutil.rmtree(gone.paths[0])  # removed by someone else between find() and remove()
    done = {r.leftover: r for r in gc.remove(found)}
    assert not done[gone].removed and isinstance(done[gone].error, FileNotFoundError)
    assert all(r.removed for leftover, r in done.items() if leftover is not gone)
    assert of(pid) == []


def test_what_live_processes_made_is_never_listed_nor_removed(no_leaks):
    host, made = start_trainer()  # alive until the end of the test
    try:
        with Sandbox() as sb:
            sb.exec("true")
            ours = cgroups.find_created_by() + hostdirs.find_created_by()
            pooled = cgroups.pooled_paths()
            live = set(made["cgroup"] + made["dirs"] + ours) | pooled
            found = gc.find()
            assert not live & {p for leftover in found for p in leftover.paths}
            forged = gc.Leftover(gc.DIRECTORY, os.path.basename(made["dirs"][0]),
                                 (made["dirs"][0],), host.pid, "a live process's")
            with pytest.raises(ValueError, match="alive"):
                gc.remove([forged])
            assert all(os.path.exists(p) for p in made["cgroup"] + made["dirs"])
    finally:
        stop(host)
        remove_remains(host.pid)

