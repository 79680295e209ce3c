"""A private userland: nested runs on a copy of the image's tree made for each run alone
(karotte/private_tree.py, ctx.run's and compare_speed's private_userland).

Every sandbox on one image reads the same inodes, and the page cache, futex keys and
inotify marks are the kernel's per inode. The agent's program here
(tests/helpers/cache_link.c) marks its answer in the page cache of a file of its image in
the grader's check run, and reads it back in the timed run through /proc/self/pagemap
after fault-around (LINK-CACHE-02); or a graded program signals a sandbox alive beside it,
through the page cache or an inotify watch (LINK-SIBLING-02). Without the private copy
each link carries; with it, nothing. No test depends on timing except through a speedup
whose margins are fourfold and more.

The image is a tree made here on disk (tmpfs pages are never cold): /data/blob, 256
pages dropped from the host's cache before each test, and /opt/cache_link.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import pytest

from envs.private_userland import BLOB, PROGRAM, SECRET, CheckThenTimed, CheckThenTimedPrivately
from karotte import gc, hostdirs
from karotte.grading import grader_library, private_dir, run_grader
from karotte.private_tree import HOST_REFUSED, PrivateTreeError, can_reflink, private_tree
from karotte.sandbox import Sandbox
from karotte.spec import MiB, SandboxSpec
from karotte.userns import sandbox_owner

from conftest import (NOBODY, delegated_v1_cgroup, drop_pages, load_script, make_cold,
                      needs_sandbox)

pytestmark = [needs_sandbox(),
              pytest.mark.skipif(os.geteuid() != 0, reason="the image is a root-owned tree, "
                                 "made as root (the unprivileged test switches to uid 65534)")]

HELPERS = Path(__file__).resolve().parent / "helpers"
PROJECT = Path(__file__).resolve().parent.parent
bench = load_script("bench_side_channels")
userland = bench.userland  # the graded program's image: the shared tree or a private copy

PAGES = 256
MIN_LINKED_SPEEDUP = 20.0  # the timed run answered at once: 335x here
MAX_UNLINKED_SPEEDUP = 5.0  # it computed, as the baseline does: 1.0x here, 2.7x under load


def _tag(s: int) -> int:
    return (s * 2654435761 & 0xFFFFFFFF) >> 16 & 0xFFFF


# A private copy on a tmpfs shows every page cached: the tags the program then reads are
# all ones, which must not be SECRET's.
assert _tag(SECRET) != 0xFFFF


@pytest.fixture(scope="session")
def cache_link(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (apt-get install gcc libc6-dev): the agent's "
                    "program is tests/helpers/cache_link.c")
    out = tmp_path_factory.mktemp("cache-link") / "cache_link"
    r = subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-static", "-o", str(out),
                        str(HELPERS / "cache_link.c")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"gcc cannot build a static program here (libc6-dev): {r.stderr[-300:]}")
    return out


def _make_tree(top: str, program: Path) -> str:
    os.chmod(top, 0o755)
    for d in ("data", "opt", "etc"):
        os.mkdir(os.path.join(top, d), 0o755)
    Path(top, "etc/os-release").write_text("ID=karotte-test-private\n")
    shutil.copy(program, os.path.join(top, "opt/cache_link"))
    os.chmod(os.path.join(top, "opt/cache_link"), 0o755)
    blob = os.path.join(top, "data/blob")
    with open(blob, "wb") as f:
        f.write(os.urandom(PAGES * 4096))
        f.flush()
        os.fsync(f.fileno())  # clean pages, which the host's DONTNEED drops
    os.chmod(blob, 0o644)  # the agent may read it, not write it
    return blob


@pytest.fixture
def link_tree(cache_link):
    """(the tree, its blob): on disk, the blob cold."""
    top = tempfile.mkdtemp(prefix="karotte-test-private-", dir="/var/tmp")
    try:
        blob = _make_tree(top, cache_link)
        make_cold(blob)
        yield top, blob
    finally:
        shutil.rmtree(top)


@pytest.fixture
def xfs_runtime_dir(monkeypatch):
    """KAROTTE_RUNTIME_DIR on an xfs of its own (a loop device), as a host puts it on the
    image store's xfs for reflinks. Under /var/tmp: the sandboxes' own uid searches it."""
    if shutil.which("mkfs.xfs") is None or shutil.which("losetup") is None:
        pytest.skip("needs mkfs.xfs (apt-get install xfsprogs) and losetup")
    base = tempfile.mkdtemp(prefix="karotte-test-xfs-", dir="/var/tmp")
    os.chmod(base, 0o755)
    image, mnt = os.path.join(base, "xfs.img"), os.path.join(base, "mnt")
    try:
        with open(image, "wb") as f:
            f.truncate(512 * MiB)
        r = subprocess.run(["mkfs.xfs", "-q", image], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"mkfs.xfs failed: {r.stderr[-200:]}")
        os.mkdir(mnt)
        r = subprocess.run(["mount", "-o", "loop", image, mnt], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount an xfs loop device here: {r.stderr[-200:]}")
        try:
            os.chmod(mnt, 0o755)
            runtime = os.path.join(mnt, "runtime")
            os.mkdir(runtime, 0o755)
            grader_library("envs")  # made once per process: in the default runtime dir
            monkeypatch.setenv("KAROTTE_RUNTIME_DIR", runtime)
            yield mnt
        finally:
            subprocess.run(["umount", mnt], check=True)
    finally:
        shutil.rmtree(base)


@pytest.fixture(params=["copy", "reflink"])
def any_link_tree(request, cache_link):
    """link_tree, its copies made into the tmpfs (a copy reads every page of the image,
    which makes them all cached) or, on one xfs with the runtime directory, as reflinks,
    which read none: there only the copy's own inodes keep the runs apart."""
    if request.param == "copy":
        yield request.getfixturevalue("link_tree")
        return
    top = os.path.join(request.getfixturevalue("xfs_runtime_dir"), "tree")
    os.mkdir(top)
    blob = _make_tree(top, cache_link)
    make_cold(blob)
    yield top, blob


@pytest.fixture
def nothing_left():
    """No private copy (a hostdirs directory, "-tree") of this process is left behind."""
    yield
    assert [d for d in hostdirs.find_created_by() if d.endswith("-tree")] == []


def _grade(env, tree: str, cache_link: Path):
    env.image = f"dir:{tree}"
    submission = private_dir("submission")
    try:
        shutil.copy(cache_link, os.path.join(submission, "solve"))
        os.chmod(os.path.join(submission, "solve"), 0o755)
        os.chown(os.path.join(submission, "solve"), *sandbox_owner())
        return run_grader(env, 1, submission)
    finally:
        shutil.rmtree(submission)


def test_LINK_CACHE_02_a_check_run_tells_the_timed_run_its_answer_unless_each_run_has_a_private_userland(
        no_leaks, nothing_left, any_link_tree, cache_link):
    tree, blob = any_link_tree
    # The control: the check run marks its answer in the page cache of the image's blob,
    # and the timed run of the same program on the same input reads it at once.
    shared = _grade(CheckThenTimed(), tree, cache_link)
    assert shared.reason == "graded" and not shared.details["failures"], shared
    assert shared.reward >= MIN_LINKED_SPEEDUP, shared.details
    assert bench.cached_pages(blob) > 0  # the marks are in the host's cache of the image
    # Each run on a copy of its own: the timed run finds no mark and computes.
    drop_pages(blob)
    private = _grade(CheckThenTimedPrivately(), tree, cache_link)
    assert private.reason == "graded" and not private.details["failures"], private
    assert private.reward <= MAX_UNLINKED_SPEEDUP, private.details


def _peek(sandbox: Sandbox) -> str:
    r = sandbox.exec([PROGRAM, BLOB, "peek"])
    assert r.exit_code == 0, r.stderr
    return r.stdout.decode().strip()


@pytest.mark.parametrize("private", [False, True], ids=["shared-control", "private"])
def test_LINK_SIBLING_02_a_graded_program_marks_nothing_that_a_live_sibling_reads_in_the_page_cache(
        no_leaks, nothing_left, any_link_tree, private):
    tree, blob = any_link_tree
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sibling, userland(tree, private) as image:
        # A copy into the tmpfs reads every page of the image's blob: the host drops them,
        # so that the sibling reads no mark before the graded program runs.
        drop_pages(blob)
        before = _peek(sibling)
        assert before == "0 0 0", before
        with Sandbox(SandboxSpec(image=image)) as graded:
            r = graded.exec([PROGRAM, BLOB], stdin=str(SECRET).encode())
            assert r.exit_code == 0, r.stderr
            answer = r.stdout.decode().strip()
            after = _peek(sibling)  # both alive
    if private:
        assert after == before, "the graded program's marks reached the sibling"
    else:
        assert after == f"1 {_tag(SECRET)} {answer}", (before, after)


@pytest.mark.parametrize("private", [False, True], ids=["shared-control", "private"])
def test_LINK_SIBLING_02_a_graded_program_wakes_no_futex_that_a_live_sibling_waits_on(
        no_leaks, nothing_left, link_tree, private):
    # A futex on a page of a file is keyed by the file's inode: the sibling waits on the
    # first word of the image's blob, the graded program wakes that word of its own blob.
    tree, _ = link_tree
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sibling, userland(tree, private) as image, \
            Sandbox(SandboxSpec(image=image)) as graded:
        heard = {}
        waiter = threading.Thread(target=lambda: heard.update(
            r=sibling.exec([PROGRAM, BLOB, "wait", "5"], timeout=30)))
        waiter.start()
        time.sleep(1.0)  # the sibling waits by now; the graded program wakes for 3 s more
        r = graded.exec([PROGRAM, BLOB, "wake", "3"], timeout=30)
        waiter.join()
    assert r.exit_code == 0, r.stderr
    assert heard["r"].stdout.decode().strip() == ("timeout" if private else "woken"), heard["r"]


def test_LINK_SIBLING_02_an_inotify_watch_on_an_images_file_sees_no_other_sandboxs_open(
        no_leaks, link_tree):
    # Without any copy: a watch on an image's file is on the watcher's own overlay inode,
    # and another sandbox opens the file through its own overlay. The control: an open
    # in the watcher's sandbox, by the watcher's own child (a sandbox runs one exec at a
    # time: a second exec from another thread is no control, it races for the replies).
    tree, _ = link_tree
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sibling, \
            Sandbox(SandboxSpec(image=f"dir:{tree}")) as graded:
        heard = {}
        watcher = threading.Thread(target=lambda: heard.update(
            r=sibling.exec([PROGRAM, BLOB, "watch", "3"], timeout=30)))
        watcher.start()
        time.sleep(1.0)  # the watch is set; the opener opens for 1 s more
        r = graded.exec([PROGRAM, BLOB, "open", "1"], timeout=30)
        watcher.join()
        assert r.exit_code == 0, r.stderr
        own = sibling.exec([PROGRAM, BLOB, "watch-own", "3"], timeout=30)
        counts = {"other": int(heard["r"].stdout.decode()), "own": int(own.stdout.decode())}
    assert counts["own"] > 20 and counts["other"] == 0, counts


def test_a_private_userland_of_the_hosts_is_refused_naming_the_fix(no_leaks, nothing_left,
                                                                   cache_link):
    with pytest.raises(PrivateTreeError, match="needs an image"):
        with private_tree("host"):
            pass
    env = CheckThenTimedPrivately()
    submission = private_dir("submission")
    try:
        report = run_grader(env, 1, submission)
    finally:
        shutil.rmtree(submission)
    assert report.details["error"] == f"run failed: {HOST_REFUSED}"
    assert "Environment.image" in HOST_REFUSED


def test_the_copy_has_inodes_of_its_own_is_closed_to_host_users_and_gone_after(no_leaks,
                                                                           link_tree):
    tree, blob = link_tree
    with private_tree(f"dir:{tree}") as copy:
        root = copy.image.removeprefix("dir:")
        copied = os.path.join(root, "data/blob")
        assert os.stat(copied).st_ino != os.stat(blob).st_ino
        assert Path(copied).read_bytes() == Path(blob).read_bytes()
        assert os.stat(os.path.dirname(root)).st_mode & 0o777 == 0o700  # no host user enters
        assert os.path.dirname(root).startswith(hostdirs.runtime_dir())
        with Sandbox(SandboxSpec(image=copy.image)) as sb:
            r = sb.exec(["/opt/cache_link", "/data/blob", "peek"])
            assert r.exit_code == 0, r.stderr
    assert not os.path.exists(root)


def test_a_copy_of_a_store_image_keeps_its_ids_and_carries_its_config_env(
        no_leaks, nothing_left, link_tree, tmp_path, monkeypatch):
    # An OCI image with an Env, imported into a store of the test's own by the copy's lease;
    # the copy is a dir: tree, which has no config: its Env comes back in the result, for
    # ctx.run's host side to pass on.
    if shutil.which("umoci") is None:
        pytest.skip("needs umoci to make an OCI image")
    tree, _ = link_tree
    os.chown(os.path.join(tree, "opt/cache_link"), 1000, 1000)  # an id of the image's own
    layout, bundle = tmp_path / "layout", tmp_path / "bundle"
    for argv in (["init", "--layout", layout], ["new", "--image", f"{layout}:t"],
                 ["unpack", "--image", f"{layout}:t", bundle]):
        subprocess.run(["umoci", *map(str, argv)], check=True, capture_output=True)
    subprocess.run(["cp", "-a", f"{tree}/.", str(bundle / "rootfs")], check=True)
    for argv in (["repack", "--image", f"{layout}:t", bundle],
                 ["config", "--image", f"{layout}:t", "--config.env", "KAROTTE_TEST=from-image"]):
        subprocess.run(["umoci", *map(str, argv)], check=True, capture_output=True)
    monkeypatch.setenv("KAROTTE_IMAGE_DIR", str(tmp_path / "store"))
    with private_tree(f"oci:{layout}:t") as copy:
        assert copy.env.get("KAROTTE_TEST") == "from-image", copy.env
        root = copy.image.removeprefix("dir:")
        assert os.stat(os.path.join(root, "opt/cache_link")).st_uid == 1000
        assert copy.source.startswith(str(tmp_path / "store"))
        with Sandbox(SandboxSpec(image=copy.image)) as sb:
            r = sb.exec(["/opt/cache_link", BLOB], stdin=b"7")
            assert r.exit_code == 0 and r.stdout.strip(), r.stderr
    assert not os.path.exists(root)


def test_a_copy_that_fails_or_a_block_that_raises_leaves_nothing(no_leaks, nothing_left,
                                                                 link_tree):
    tree, _ = link_tree
    # 1 MiB of blob into a tmpfs charged to a cgroup of 512 KiB: the copy cannot be made.
    with pytest.raises(PrivateTreeError, match="private copy of dir:"):
        with private_tree(f"dir:{tree}", memory=512 * 1024):
            pass
    with pytest.raises(RuntimeError, match="the run failed"):
        with private_tree(f"dir:{tree}"):
            raise RuntimeError("the run failed")


KILLED_TRAINER = r"""
import sys, time
from karotte.private_tree import private_tree
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec
with private_tree(sys.argv[1]) as copy, Sandbox(SandboxSpec(image=copy.image)) as sb:
    print(copy.image, flush=True)
    time.sleep(600)
"""


def test_a_trainer_killed_while_a_run_is_on_its_copy_leaves_it_to_gc(no_leaks, link_tree):
    tree, _ = link_tree
    trainer = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, f"dir:{tree}"],
                               stdout=subprocess.PIPE, text=True)
    try:
        image = trainer.stdout.readline().strip()
        assert image.startswith("dir:"), image
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    top = os.path.dirname(image.removeprefix("dir:"))
    assert os.path.isdir(top)  # SIGKILL runs no handler
    found = [f for f in gc.find() if f.creator == trainer.pid]
    assert top in {p for f in found for p in f.paths}
    assert any(f.kind == gc.CGROUP and f.name.endswith("-copy") for f in found), found
    removals = gc.remove(found)
    assert all(r.removed for r in removals), removals
    assert not os.path.exists(top)
    assert [f for f in gc.find() if f.creator == trainer.pid] == []


@pytest.mark.parametrize("reflink", [False, True], ids=["copy", "reflink"])
def test_the_bench_measures_the_page_cache_channel_on_an_image_and_none_between_private_copies(
        no_leaks, nothing_left, attack_tree, reflink):
    # scripts/bench_side_channels.py's image channels, through pagemap (no timing): on the
    # image itself every bit comes through; between private copies none does.
    if reflink and shutil.which("mkfs.xfs") is None:
        pytest.skip("needs mkfs.xfs (apt-get install xfsprogs) for an xfs of the bench's own")
    image = bench.BenchImage(attack_tree, reflink=reflink, pages=512)
    try:
        bits = [i * 7 % 3 % 2 for i in range(256)]
        shared = bench.image_run("image-pagemap", bits, image)
        private = bench.image_run("private-pagemap", bits, image)
    finally:
        image.close()
    assert shared.errors == 0 and shared.information > 0.9, shared
    assert private.information == 0.0, private


def test_the_cost_of_a_private_copy_of_a_small_image_and_of_the_debian_image(
        no_leaks, nothing_left, link_tree, attack_tree, capsys):
    tree, _ = link_tree
    for name, image in (("small", f"dir:{tree}"), ("debian", f"dir:{attack_tree}")):
        took = []
        for _ in range(3):
            start = time.monotonic()
            with private_tree(image) as copy:
                took.append(time.monotonic() - start)
                method, charged = copy.method, copy.charged
        median = sorted(took)[1]
        with capsys.disabled():
            print(f"\nprivate copy of the {name} image: {method}, median {median * 1000:.0f} ms "
                  f"of {[round(t * 1000) for t in took]}, {(charged or 0) / MiB:.1f} MiB charged")
        assert method == ("reflink" if can_reflink(image[4:], hostdirs.runtime_dir())
                          else "copy")
        if name == "debian" and method == "copy":
            # A copy into the tmpfs is memory, and it is charged to the copy's cgroup.
            assert charged is None or charged > 150 * MiB, charged
        assert median < 30


def test_on_one_xfs_the_copy_is_a_reflink_whose_pages_are_its_own(xfs_runtime_dir, cache_link):
    top = os.path.join(xfs_runtime_dir, "tree")
    os.mkdir(top)
    blob = _make_tree(top, cache_link)
    drop_pages(blob)
    with private_tree(f"dir:{top}") as copy:
        assert copy.method == "reflink", copy
        copied = os.path.join(copy.image.removeprefix("dir:"), "data/blob")
        assert os.stat(copied).st_ino != os.stat(blob).st_ino
        assert bench.cached_pages(blob) == 0  # a reflink reads no data of the image
        with Sandbox(SandboxSpec(image=copy.image)) as sb:
            r = sb.exec([PROGRAM, BLOB], stdin=str(SECRET).encode())
            assert r.exit_code == 0, r.stderr
        # Its marks are in the copy's page cache only, never the image's.
        assert bench.cached_pages(copied) > 0 and bench.cached_pages(blob) == 0
        assert (copy.charged or 0) < 8 * MiB, copy  # inodes only: no data is copied


UNPRIVILEGED = r"""
import json, os, sys
from karotte.private_tree import private_tree
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec
with private_tree(sys.argv[1]) as copy:
    root = copy.image[4:]
    with Sandbox(SandboxSpec(image=copy.image)) as sb:
        r = sb.exec(["/opt/cache_link", "/data/blob"], stdin=b"7")
    print(json.dumps({"root": root, "owner": os.stat(root + "/data/blob").st_uid,
                      "exit": r.exit_code, "out": r.stdout.decode(), "err": r.stderr.decode()}))
print(json.dumps({"gone": not os.path.exists(os.path.dirname(root))}))
"""


@pytest.fixture
def delegated_parent():
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux)")
    with delegated_v1_cgroup("unpriv-private") as parent:
        yield parent


def test_an_unprivileged_caller_runs_on_a_private_copy_of_its_own_tree(no_leaks, link_tree,
                                                                       delegated_parent):
    tree, _ = link_tree
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", tree], check=True)
    site = sysconfig.get_paths()["purelib"]  # the venv's: cffi backend, psutil
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "/usr/bin/python3", "-c", UNPRIVILEGED, f"dir:{tree}"],
                       capture_output=True, timeout=120, cwd="/",
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROJECT}:{site}",
                            "KAROTTE_CGROUP_PARENT": delegated_parent})
    if r.returncode != 0 and b"No module named" in r.stderr:
        pytest.skip("the checkout and its venv must be readable by uid 65534")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    run, end = (json.loads(line) for line in r.stdout.decode().splitlines())
    assert run["exit"] == 0 and run["out"].strip(), run
    assert run["owner"] == NOBODY and end["gone"], (run, end)
