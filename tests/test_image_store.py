"""The image store: cache hits, atomic and concurrent imports, names, verify, uses that
keep gc away, gc, ownership, and debian: images built by mmdebstrap."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

import karotte.images as images_api
from karotte.images import ImageError, ImageNotFound, Store, blobs, default_root
from karotte.images.store import chain_ids
from test_images import images, make_images, tree_manifest  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parent.parent


def ref_of(images) -> str:
    return f"oci:{images['layout']}:t"


def in_child(code: str, *args: str) -> subprocess.Popen:
    """A real second process running code with sys.argv[1:] = args."""
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# -- the read buffers of an import (csrc/chunks.c) ----------------------------------------

def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.mark.skipif(blobs._POOLED is None, reason="karotte._native is not built (pip install -e .)")
def test_read_buffers_are_taken_again_while_an_import_holds_the_pool_and_unmapped_after():
    from karotte._native import ffi, lib
    size = blobs.HEAD + blobs.CHUNK

    def address(buf) -> int:
        return int(ffi.cast("uintptr_t", ffi.from_buffer(buf)))

    assert lib.karotte_chunk_kept() == 0
    with blobs.pooled():
        first = blobs.chunk_buffer(size)
        at = address(first)
        del first  # its last reference: kept, not unmapped
        assert lib.karotte_chunk_kept() == 1 and _mapped(at)
        again = blobs.chunk_buffer(size)
        assert address(again) == at and lib.karotte_chunk_kept() == 0
        other = blobs.chunk_buffer(4096)  # another size: a block of its own
        assert address(other) != at
        held = blobs.chunk_buffer(size)
        held[:4] = b"keep"
        view = memoryview(held)[:4]
        held_at = address(held)
        del again, other, held
        assert lib.karotte_chunk_kept() == 2
    assert lib.karotte_chunk_kept() == 0 and not _mapped(at)  # the last holder let go
    assert bytes(view) == b"keep" and _mapped(held_at)  # still viewed: still there
    del view  # freed outside any hold: unmapped at once, not kept
    assert lib.karotte_chunk_kept() == 0 and not _mapped(held_at)
    outside = blobs.chunk_buffer(size)
    del outside
    assert lib.karotte_chunk_kept() == 0


# -- where the store is --------------------------------------------------------------

def test_the_root_is_the_env_var_then_var_lib_for_root_then_the_xdg_cache(monkeypatch):
    monkeypatch.setenv("KAROTTE_IMAGE_DIR", "/srv/images")
    assert default_root() == "/srv/images"
    monkeypatch.delenv("KAROTTE_IMAGE_DIR")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_root() == "/var/lib/karotte/images"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.cache")
    assert default_root() == "/home/u/.cache/karotte/images"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/v")
    assert default_root() == "/home/v/.cache/karotte/images"


def test_the_layout_blobs_verified_and_a_read_only_tree_keyed_by_chain_id(images, tmp_path):
    store = Store(str(tmp_path / "s"))
    image = store.import_image(ref_of(images))
    assert image.chain_id == chain_ids(image.diff_ids)[-1]
    key = f"{image.chain_id[7:]}@{store.ids_key}"
    assert image.tree == str(tmp_path / "s/trees" / key / "rootfs")
    blob = tmp_path / "s/blobs/sha256" / image.config_digest[7:]
    assert blob.stat().st_mode & 0o777 == 0o444
    # The layers were verified as they were read, and are not kept: the source has them.
    assert not any((tmp_path / "s/blobs/sha256" / d[7:]).exists() for d in image.layers)
    assert os.listdir(tmp_path / "s/tmp") == []
    lines = (tmp_path / "s/trees" / key / "manifest.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == tree_manifest(image.tree)
    assert lines == [json.dumps(e, sort_keys=True) for e in tree_manifest(image.tree)]
    assert set(json.loads(lines[0])) == {"path", "type", "mode", "uid", "gid", "size",
                                         "sha256", "target"}


@pytest.mark.skipif(os.geteuid() != 0, reason="the image's own ids need root")
def test_as_root_the_tree_keeps_the_images_ids_and_no_host_user_reaches_it(images, tmp_path):
    # Sandboxes see those ids through an idmapped mount; a host account with one of them
    # must not reach (and so cannot change) a tree that sandboxes run on.
    store = Store(str(tmp_path / "s"))
    image = store.import_image(ref_of(images))
    assert {(e["uid"], e["gid"]) for e in tree_manifest(image.tree)} == {(0, 0)}
    assert image.tree.split("/")[-2].endswith("@root")
    for path in (tmp_path / "s", tmp_path / "s/trees"):
        assert path.stat().st_mode & 0o077 == 0, path


# -- cache hits and atomicity -------------------------------------------------------------

def test_a_second_import_is_a_cache_hit_that_extracts_nothing(images, tmp_path):
    first = Store(str(tmp_path / "s"))
    image = first.import_image(ref_of(images))
    assert first.extractions == 2
    before = os.stat(image.tree)
    again = Store(str(tmp_path / "s"))
    start = time.perf_counter()
    for form in (ref_of(images), f"docker-archive:{images['x']}", f"oci:{images['zstd']}:t"):
        assert again.import_image(form).tree == image.tree
    elapsed = time.perf_counter() - start
    assert again.extractions == 0
    assert os.stat(image.tree).st_ino == before.st_ino
    assert os.stat(image.tree).st_mtime_ns == before.st_mtime_ns
    assert elapsed < 1.0, f"three cache hits took {elapsed:.3f} s"


def test_a_cache_hit_writes_no_record_and_keeps_when_the_image_was_recorded(images, tmp_path):
    # Every sandbox on a source ref leases through import_image: rewriting and syncing its
    # records each time was 1 ms of each start (docs/benchmarks.md).
    store = Store(str(tmp_path / "s"))
    first = store.import_image(ref_of(images), name="t/once")
    records = [os.path.join(d, f) for top in ("sources", "refs")
               for d, _, fs in os.walk(tmp_path / "s" / top) for f in fs]
    assert len(records) == 2
    stamps = [os.stat(r).st_mtime_ns for r in records]
    time.sleep(0.01)
    again = store.import_image(ref_of(images), name="t/once")
    store.open_image(ref_of(images))
    assert [os.stat(r).st_mtime_ns for r in records] == stamps
    assert again.created == first.created and again.tree == first.tree
    other = store.import_image(f"oci:{images['zstd']}:t", name="t/once")  # a new source
    assert other.source != first.source and other.created > first.created


IMPORT_AT_ONCE = """
import json, os, sys
from karotte.images import Store
os.read(int(sys.argv[3]), 1)  # the parent's go: both processes start together
store = Store(sys.argv[1])
image = store.import_image(sys.argv[2])
print(json.dumps({"tree": image.tree, "extractions": store.extractions}))
"""


def test_two_processes_importing_one_image_at_once_both_succeed_with_one_tree(tmp_path):
    # An image of 8 layers, 6 MiB, so that the two imports overlap.
    made = make_images(tmp_path / "img")
    layout = made["layout"]
    bundle = tmp_path / "bundle"
    for i in range(6):
        subprocess.run(["umoci", "unpack", "--rootless", "--image", f"{layout}:t", bundle],
                       check=True, capture_output=True)
        (bundle / "rootfs" / f"file{i}").write_bytes(os.urandom(1 << 20))
        subprocess.run(["umoci", "repack", "--image", f"{layout}:t", bundle], check=True,
                       capture_output=True)
        subprocess.run(["rm", "-rf", bundle], check=True)
    go_read, go_write = os.pipe()
    children = [subprocess.Popen(
        [sys.executable, "-c", IMPORT_AT_ONCE, str(tmp_path / "s"), f"oci:{layout}:t",
         str(go_read)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        pass_fds=(go_read,)) for _ in range(2)]
    time.sleep(0.5)
    os.write(go_write, b"gg")
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out))
    os.close(go_read)
    os.close(go_write)
    assert results[0]["tree"] == results[1]["tree"]
    assert sorted(r["extractions"] for r in results) == [0, 8]  # one built, one waited
    assert len(os.listdir(tmp_path / "s/trees")) == 1
    assert os.listdir(tmp_path / "s/tmp") == []
    assert Store(str(tmp_path / "s")).verify(f"oci:{layout}:t").ok


def test_a_failed_import_leaves_no_tree_no_name_and_nothing_in_tmp(images, tmp_path):
    bad = tmp_path / "x.tar"
    data = bytearray(images["x"].read_bytes())
    data[data.index(b"hello\n")] ^= 1
    bad.write_bytes(bytes(data))
    store = Store(str(tmp_path / "s"))
    with pytest.raises(ImageError):
        store.import_image(f"docker-archive:{bad}", name="bad")
    assert os.listdir(tmp_path / "s/trees") == [] and os.listdir(tmp_path / "s/tmp") == []
    assert store.ls() == ()
    with pytest.raises(ImageNotFound, match="no image named 'bad'"):
        store.open_image("bad")


# -- names, ls, inspect, rm ------------------------------------------------------------

def test_a_name_refers_to_the_image_later_and_records_its_source(images, tmp_path):
    store = Store(str(tmp_path / "s"))
    imported = store.import_image(f"docker-archive:{images['x']}:repo/x:t", name="tb/chess")
    assert (tmp_path / "s/refs/tb/chess").is_file()
    opened = store.open_image("tb/chess")
    assert opened.tree == imported.tree and opened.name == "tb/chess"
    assert opened.source == f"docker-archive:{images['x']}:repo/x:t"
    listed = store.ls()
    assert [i.name for i in listed] == ["tb/chess"]
    info = store.inspect("tb/chess")
    assert info.config.env == ("A=1",) and info.config.working_dir == "/app"
    assert info.config.cmd == ("/bin/sh",) and info.config.user is None
    assert info.chain_id == imported.chain_id and len(info.layers) == 2
    assert info.size == 300_000 + len("hello\n") * 2 + len("two\n")  # hard link counted twice
    store.rm("tb/chess")
    assert store.ls() == () and not (tmp_path / "s/refs/tb").exists()
    with pytest.raises(ImageNotFound, match="no image named 'tb/chess'"):
        store.rm("tb/chess")
    with pytest.raises(ImageNotFound, match="import one with --name tb/chess"):
        store.open_image("tb/chess")


def test_open_image_of_a_source_imports_it_once_and_host_is_no_image(images, tmp_path):
    store = Store(str(tmp_path / "s"))
    first = store.open_image(ref_of(images))
    assert store.extractions == 2
    assert store.open_image(ref_of(images)).tree == first.tree and store.extractions == 2
    assert store.inspect(ref_of(images)).chain_id == first.chain_id
    with pytest.raises(ImageError, match="'host' is the host's own userland"):
        store.open_image("host")


def test_the_public_functions_use_the_default_store(images, tmp_path, monkeypatch):
    monkeypatch.setenv("KAROTTE_IMAGE_DIR", str(tmp_path / "s"))
    image = images_api.import_image(ref_of(images), name="x")
    assert images_api.open_image("x").tree == image.tree
    with images_api.lease("x") as held:
        assert held.tree == image.tree and held.config.working_dir == "/app"
        assert images_api.default_store().gc().trees_removed == ()


# -- verify ------------------------------------------------------------------------------

def test_verify_finds_a_changed_an_added_and_a_removed_path(images, tmp_path):
    store = Store(str(tmp_path / "s"))
    image = store.import_image(ref_of(images), name="v")
    assert store.verify("v").ok and store.verify("v").entries > 5
    tree = Path(image.tree)
    (tree / "etc/hello").write_text("jello\n")
    (tree / "etc/planted").write_text("x")
    (tree / "etc/two").unlink()
    os.chmod(tree / "usr/bin/tool", 0o4755)
    problems = store.verify("v").problems
    assert "etc/two: missing" in problems
    assert "etc/planted: not in the manifest" in problems
    assert any(p.startswith("etc/hello: ") and "sha256" in p for p in problems)
    assert f"usr/bin/tool: mode {0o755!r} -> {0o4755!r}" in problems
    assert not store.verify("v").ok


# -- gc, and uses that keep it away ---------------------------------------------------------

def test_gc_removes_what_no_name_refers_to_and_keeps_what_names_do(images, tmp_path):
    store = Store(str(tmp_path / "s"))
    named = store.import_image(ref_of(images), name="keep")
    unnamed = store.import_image(f"dir:{images['rootfs']}")
    result = store.gc()
    assert result.trees_removed == (unnamed.tree.split("/")[-2],)
    assert set(result.blobs_removed) == {unnamed.config_digest, *unnamed.layers}
    assert result.bytes_freed > 300_000 and not result.blobs_skipped
    assert os.path.isdir(named.tree) and not os.path.exists(unnamed.tree)
    assert not os.path.exists(tmp_path / "s/locks" / unnamed.tree.split("/")[-2])
    assert store.verify("keep").ok
    store.rm("keep")
    second = store.gc()
    assert second.trees_removed == (named.tree.split("/")[-2],)
    assert os.listdir(tmp_path / "s/blobs/sha256") == []
    assert os.listdir(tmp_path / "s/trees") == [] and os.listdir(tmp_path / "s/tmp") == []


def test_a_dir_image_is_hashed_and_unpacked_like_any_other(images, tmp_path):
    image = Store(str(tmp_path / "s")).import_image(f"dir:{images['rootfs']}")
    assert [{k: v for k, v in e.items() if k not in ("uid", "gid")}
            for e in tree_manifest(image.tree)][1:] == \
        [{k: v for k, v in e.items() if k not in ("uid", "gid")}
         for e in tree_manifest(images["rootfs"])][1:]


HOLD = """
import sys
from karotte.images import Store
store = Store(sys.argv[1])
with store.use(store.open_image(sys.argv[2])):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_gc_leaves_a_tree_a_sandbox_uses_and_takes_it_once_released(images, tmp_path):
    store = Store(str(tmp_path / "s"))
    image = store.import_image(ref_of(images), name="used")
    key = image.tree.split("/")[-2]
    store.rm("used")
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "s"), ref_of(images)],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\n"
    try:
        result = store.gc()
        assert result.trees_in_use == (key,) and result.trees_removed == ()
        assert os.path.isdir(image.tree)
        with store.use(image):  # in this process too: a second holder
            child.stdin.close()
            child.wait(timeout=30)
            assert store.gc().trees_in_use == (key,)
    finally:
        child.kill()
        child.wait()
    assert store.gc().trees_removed == (key,)
    with pytest.raises(ImageNotFound, match="gone from"):
        with store.use(image):
            pass


def test_gc_during_an_import_removes_no_blob(images, tmp_path):
    # An import holds the store lock shared; gc takes no blob while it cannot take it.
    store = Store(str(tmp_path / "s"))
    store.import_image(ref_of(images))
    with store._lock(str(tmp_path / "s/store.lock"), fcntl.LOCK_SH):
        result = store.gc()
    assert result.blobs_skipped and result.blobs_removed == ()
    assert os.listdir(tmp_path / "s/blobs/sha256")
    assert store.gc().blobs_removed


def test_a_lease_of_an_unnamed_source_survives_gc(images, tmp_path):
    store = Store(str(tmp_path / "s"))
    with store.lease(ref_of(images)) as image:
        assert store.gc().trees_in_use == (image.tree.split("/")[-2],)
        assert os.path.isdir(image.tree)
    with store.lease(ref_of(images)) as again:  # gc may take it now; a lease imports again
        assert again.tree == image.tree


# -- debian: images ---------------------------------------------------------------------------

def _debian_reachable() -> str | None:
    if subprocess.run(["which", "mmdebstrap"], capture_output=True).returncode:
        return "needs mmdebstrap (scripts/setup installs it)"
    probe = subprocess.run(["apt-get", "download", "--print-uris", "base-files"],
                           capture_output=True, text=True, timeout=60, cwd="/tmp")
    if probe.returncode:
        return "apt cannot resolve a package (no sources?)"
    try:
        urllib.request.urlopen("http://deb.debian.org/debian/dists/bookworm/Release",
                               timeout=10).close()
    except OSError as exc:
        return f"Debian's archive is unreachable ({exc})"
    return None


@pytest.fixture(scope="session")
def debian_store(tmp_path_factory):
    why = _debian_reachable()
    if why:
        pytest.skip(why)
    store = Store(str(tmp_path_factory.mktemp("debian") / "s"))
    start = time.perf_counter()
    image = store.import_image("debian:bookworm+python3", name="deb/py")
    return store, image, time.perf_counter() - start


@pytest.mark.slow
def test_debian_bookworm_with_python3_is_built_once_by_mmdebstrap(debian_store):
    store, image, took = debian_store
    tree = Path(image.tree)
    assert (tree / "usr/bin/python3").is_symlink() or (tree / "usr/bin/python3").is_file()
    assert (tree / "etc/debian_version").read_text().startswith("12.")
    assert not (tree / "dev/null").exists()  # mmdebstrap --skip=output/dev: no device nodes
    assert image.config.env[0].startswith("PATH=")
    assert store.verify("deb/py").ok
    start = time.perf_counter()
    again = store.import_image("debian:bookworm+python3")  # cached by (suite, packages)
    assert again.tree == image.tree and store.extractions == 1
    assert time.perf_counter() - start < took / 5


BUILD_AT_ONCE = """
import json, os, sys
from karotte.images import Store
os.read(int(sys.argv[3]), 1)  # the parent's go: both processes start together
store = Store(sys.argv[1])
image = store.import_image(sys.argv[2])
print(json.dumps({"tree": image.tree, "extractions": store.extractions}))
"""


@pytest.mark.slow
def test_two_processes_importing_one_debian_source_at_once_build_it_once(tmp_path):
    # A build is not reproducible: two mmdebstrap runs give two different layers, two
    # trees. The source's build lock makes the second process wait and use the first's.
    why = _debian_reachable()
    if why:
        pytest.skip(why)
    go_read, go_write = os.pipe()
    children = [subprocess.Popen(
        [sys.executable, "-c", BUILD_AT_ONCE, str(tmp_path / "s"), "debian:bookworm",
         str(go_read)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        pass_fds=(go_read,)) for _ in range(2)]
    time.sleep(0.5)
    os.write(go_write, b"gg")
    builders = set()  # the children under which an mmdebstrap ran
    deadline = time.monotonic() + 600
    while any(c.poll() is None for c in children) and time.monotonic() < deadline:
        for child in children:
            with contextlib.suppress(psutil.Error):
                if any("mmdebstrap" in " ".join(p.cmdline()[:2])
                       for p in psutil.Process(child.pid).children(recursive=True)):
                    builders.add(child.pid)
        time.sleep(0.05)
    results = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        results.append(json.loads(out))
    os.close(go_read)
    os.close(go_write)
    assert len(builders) == 1, "both processes ran mmdebstrap"
    assert results[0]["tree"] == results[1]["tree"]
    assert sorted(r["extractions"] for r in results) == [0, 1]  # one built, one waited
    assert len(os.listdir(tmp_path / "s/trees")) == 1
    assert os.listdir(tmp_path / "s/tmp") == []


IMPORT_AS_CALLER = """
import json, os, sys
from karotte.images import Store
image = Store(sys.argv[1]).import_image(sys.argv[2])
print(json.dumps({"tree": image.tree, "ids": sorted({(st.st_uid, st.st_gid) for st in (
    os.lstat(os.path.join(d, n)) for d, ds, fs in os.walk(image.tree) for n in ds + fs)})}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as uid 65534")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs /usr/bin/python3")
def test_unprivileged_the_tree_stays_the_callers_and_is_keyed_by_its_uid(images):
    # The sandbox of an unprivileged caller maps the caller to root inside: the caller's
    # own files are the image's root files there. The system Python runs the checkout's
    # karotte (the package needs no C extension to import), from a directory uid 65534
    # can reach.
    nobody = 65534
    base = tempfile.mkdtemp(prefix="karotte-test-store-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        shared = os.path.join(base, "shared")
        subprocess.run(["cp", "-a", images["layout"], shared], check=True)
        subprocess.run(["chmod", "-R", "a+rX", shared], check=True)
        store = os.path.join(base, "s")
        os.mkdir(store)
        os.chown(store, nobody, nobody)
        def as_nobody(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                ["/usr/bin/python3", *argv], cwd="/", capture_output=True, text=True,
                timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": base, "PYTHONPATH": str(REPO)},
                preexec_fn=lambda: (os.setgroups([]), os.setgid(nobody), os.setuid(nobody)))

        if as_nobody("-c", "import karotte.images").returncode != 0:
            pytest.skip("the checkout must be readable by uid 65534")
        child = as_nobody("-c", IMPORT_AS_CALLER, store, f"oci:{shared}:t")
        assert child.returncode == 0, child.stderr
        found = json.loads(child.stdout)
        assert found["ids"] == [[nobody, nobody]]
        assert found["tree"].split("/")[-2].endswith(f"@uid{nobody}")
    finally:
        shutil.rmtree(base)
