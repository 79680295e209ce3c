"""Sandboxes on an image (SandboxSpec.image="dir:/PATH"): the root is an overlay of the tree,
its upper a tmpfs of the sandbox's own, and nothing of the host is there.

Real trees, made here: a Debian bookworm made by mmdebstrap (built once a day, cached in
/var/tmp: tests/conftest.py), and small trees holding the static busybox, with the setuid file, device node and
world-writable places each test needs, made as root.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from conftest import bookworm_tree, needs_sandbox
from karotte import imageroot, images, mounts, plan
from karotte import protocol as p
from karotte.errors import HostUnsupported
from karotte.sandbox import AGENT_UID, Sandbox
from karotte.spec import MiB, SandboxSpec, SpecError
from karotte.userns import identity

BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "cat", "id", "ls", "stat", "dd", "grep", "rm", "mkdir", "mv", "chmod",
           "test", "echo", "env", "pwd", "touch")
NOBODY = 65534
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# cgroup2: the VM lane runs them too, on Debian's 6.1 and 6.12 (its /tmp is an ext4, where
# a tree can be idmapped; its Debian trees are copies of the host's cached ones).
pytestmark = [needs_sandbox(), pytest.mark.cgroup2,
              pytest.mark.skipif(os.geteuid() != 0, reason="the trees are made as root "
                                 "(setuid files, device nodes, root-owned directories)")]


def _busybox_tree(owner: int = 0) -> str:
    """bin/busybox and its applets, a root-owned /etc, a world-writable /var/tmp, a
    world-writable file in a world-writable directory, and a directory of the agent's."""
    if not os.path.exists(BUSYBOX):
        pytest.skip(f"{BUSYBOX} is missing (apt-get install busybox-static)")
    tree = tempfile.mkdtemp(prefix="karotte-test-image-")
    os.chmod(tree, 0o755)
    for d, mode in (("bin", 0o755), ("etc", 0o755), ("var/tmp", 0o1777), ("srv/shared", 0o777),
                    ("srv/agent", 0o755)):
        os.makedirs(os.path.join(tree, d), exist_ok=True)
        os.chmod(os.path.join(tree, d), mode)
    shutil.copy(BUSYBOX, os.path.join(tree, "bin/busybox"))
    for applet in APPLETS:
        os.symlink("busybox", os.path.join(tree, "bin", applet))
    for name, text in (("etc/hostname", "busybox-image\n"),
                       ("etc/os-release", "ID=karotte-test-busybox\n"),
                       ("srv/shared/notes", "first line\n"), ("srv/agent/mine", "agent's\n")):
        with open(os.path.join(tree, name), "w") as f:
            f.write(text)
    os.chmod(os.path.join(tree, "srv/shared/notes"), 0o666)
    os.chown(os.path.join(tree, "srv/agent"), AGENT_UID, AGENT_UID)
    os.chown(os.path.join(tree, "srv/agent/mine"), AGENT_UID, AGENT_UID)
    if owner:
        for d, dirs, files in os.walk(tree):
            for n in [d] + [os.path.join(d, x) for x in dirs + files]:
                os.lchown(n, owner, owner)
    return tree


@pytest.fixture
def tree():
    path = _busybox_tree()
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="session")
def debian_tree() -> str:
    """Bookworm's essential set, made by mmdebstrap (conftest.py: cached, once a day)."""
    return bookworm_tree("essential")


def _digest(tree: str) -> dict[str, tuple]:
    """Every entry of tree: type, mode, owner, size, mtime, xattr names, content hash."""
    out = {}
    for d, dirs, files in os.walk(tree):
        for name in [""] + dirs + files:
            path = os.path.join(d, name) if name else d
            st = os.lstat(path)
            content = None
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    content = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            out[os.path.relpath(path, tree)] = (
                st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                tuple(sorted(os.listxattr(path, follow_symlinks=False))), content)
    return out


def sh(sb: Sandbox, script: str, **kw):
    return sb.exec(["/bin/sh", "-c", script], **kw)


def _root_mount(sb: Sandbox) -> tuple[set[str], str, set[str]]:
    """(per-mount options, fs type, superblock options) of / inside."""
    for line in sh(sb, "cat /proc/self/mountinfo").stdout.decode().splitlines():
        head, _, tail = line.partition(" - ")
        if head.split()[4] == "/":
            return set(head.split()[5].split(",")), tail.split()[0], set(tail.split()[2].split(","))
    raise AssertionError("no / in the sandbox's mountinfo")


# --------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("bad", ["dir:relative/tree", "dir:/a/../b", "dir:/", "dir://srv/x",
                                 "dir:/srv/x/"])
def test_a_dir_image_is_an_absolute_normalised_tree_other_than_the_root(bad):
    with pytest.raises(SpecError) as info:
        SandboxSpec(image=bad)
    assert info.value.field == "image" and "dir:/ABSOLUTE/PATH" in str(info.value)


@pytest.mark.parametrize("bad", ["/srv/tree", "", 7, "bogus:x", "debian:"])
def test_an_image_outside_the_grammar_is_refused_showing_it(bad):
    with pytest.raises(SpecError) as info:
        SandboxSpec(image=bad)
    assert info.value.field == "image" and "an image reference is one of" in str(info.value)


@pytest.mark.parametrize("good", ["host", "dir:/srv/tree", "oci:/srv/layout:t", "tb/chess",
                                  "docker-archive:/srv/x.tar", "debian:bookworm+python3"])
def test_every_form_of_the_grammar_is_an_image(good):
    assert SandboxSpec(image=good).image == good


def test_a_missing_tree_is_refused_before_any_sandbox_starts_naming_the_fix(no_leaks):
    with pytest.raises(FileNotFoundError) as info:
        Sandbox(SandboxSpec(image="dir:/nonexistent/karotte-tree"))
    assert "make the tree first" in str(info.value) and "mmdebstrap" in str(info.value)


def test_on_the_host_the_config_message_is_todays_and_on_an_image_it_starts_with_the_overlay(tree):
    ident = identity()
    host = plan.config_message(SandboxSpec(), ident)
    assert host == plan.config_message(SandboxSpec(image="host"), ident, None)

    def mounts_of(message: bytes) -> list[tuple[int, str]]:
        out = []
        for tag, data in p._records(message, p._HEADER.size):
            if tag == p.T_MOUNT:
                op = p._MOUNT.unpack_from(data)[0]
                src, dst = data[p._MOUNT.size:].split(b"\0")[:2]
                out.append((op, dst.decode() if op != p.M_FILE else src.decode()))
        return out

    assert p.M_OVERLAY not in [op for op, _ in mounts_of(host)]
    image = mounts_of(plan.config_message(SandboxSpec(image=f"dir:{tree}"), ident, tree))
    assert image[0][0] == p.M_OVERLAY and p.M_OVERLAY not in [op for op, _ in image[1:]]
    points = [dst for _, dst in image]
    assert "/etc" not in points and "/usr" not in points and "/root" not in points
    assert {"/dev", "/proc", "/tmp", mounts.WORKSPACE, mounts.HOME} <= set(points)


# --------------------------------------------------------------------------- what the agent sees


def test_IMG_HOSTUSR_01_the_agent_sees_the_images_files_and_nothing_of_the_hosts(debian_tree,
                                                                                no_leaks):
    assert os.path.exists("/usr/bin/python3"), "the host has a python3 for the image to lack"
    assert not os.path.lexists(os.path.join(debian_tree, "usr/bin/python3"))
    host_only = sorted(set(os.listdir("/usr/lib")) - set(os.listdir(f"{debian_tree}/usr/lib")))
    assert host_only, "the host's /usr/lib holds something the image's lacks"
    with Sandbox(SandboxSpec(image=f"dir:{debian_tree}")) as sb:
        for name in ("etc/os-release", "etc/hostname", "etc/passwd"):
            with open(os.path.join(debian_tree, name), "rb") as f:
                assert sb.exec(["/bin/cat", f"/{name}"]).stdout == f.read(), name
        assert sh(sb, "test -e /usr/bin/python3").exit_code == 1
        r = sb.exec(["/bin/ls", "/usr/lib"])
        assert r.ok and not set(host_only) & set(r.stdout.decode().split())
        assert sb.exec(["/usr/bin/id", "-u"]).stdout.decode().strip() == str(AGENT_UID)
        points = [line.split()[4] for line in
                  sh(sb, "cat /proc/self/mountinfo").stdout.decode().splitlines()]
        assert not [pt for pt in points if pt.startswith(("/usr", "/etc", "/lib", "/bin"))]


def test_IMG_PERM_01_root_owned_paths_stay_closed_to_the_agent_world_writable_ones_open(
        debian_tree, no_leaks):
    with Sandbox(SandboxSpec(image=f"dir:{debian_tree}")) as sb:
        # The tree's root-owned files are root's inside (idmapped), not an unmapped nobody.
        assert sb.exec(["/usr/bin/stat", "-c", "%u:%g %a", "/etc", "/var/tmp"]).stdout.decode() \
            == "0:0 755\n0:0 1777\n"
        r = sh(sb, "echo x > /etc/foo")
        assert r.exit_code != 0 and b"Permission denied" in r.stderr
        r = sh(sb, "echo mine > /var/tmp/x && cat /var/tmp/x && stat -c %u /var/tmp/x")
        assert r.stdout == f"mine\n{AGENT_UID}\n".encode(), r.stderr
    assert not os.path.lexists(os.path.join(debian_tree, "etc/foo"))
    assert not os.path.lexists(os.path.join(debian_tree, "var/tmp/x"))


def test_IMG_LOWER_01_nothing_the_agent_does_reaches_the_tree(tree, no_leaks):
    before = _digest(tree)
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sb:
        r = sh(sb, "set -e; echo new > /var/tmp/new; echo more >> /srv/shared/notes; "
                   "rm /srv/agent/mine; mkdir /srv/shared/d; mv /var/tmp/new /srv/shared/d/n; "
                   "chmod 600 /srv/shared/d/n; touch /srv/shared/notes; "
                   "cat /srv/shared/notes; test ! -e /srv/agent/mine; cat /srv/shared/d/n")
        assert r.ok and r.stdout == b"first line\nmore\nnew\n", r.stderr
    assert _digest(tree) == before


def test_IMG_DISK_01_the_disk_limit_holds_for_writes_anywhere_on_the_overlay(tree, no_leaks):
    with Sandbox(SandboxSpec(image=f"dir:{tree}", disk=8 * MiB, inodes=256)) as sb:
        r = sh(sb, "for i in 1 2 3 4; do dd if=/dev/zero of=/var/tmp/f$i bs=1M count=3 "
                   "2>&1 || exit 9; done")
        assert r.exit_code == 9 and b"No space left on device" in r.stdout, r.stdout
        used = sh(sb, "cat /var/tmp/f* | wc -c").stdout
        assert 5 * MiB <= int(used or 0) <= 8 * MiB
        # and the inodes: the upper's nr_inodes is the spec's
        r = sh(sb, "i=0; while touch /srv/shared/i$i 2>/dev/null; do i=$((i+1)); done; echo $i")
        assert 200 < int(r.stdout) < 256


def test_IMG_MEM_01_the_uppers_pages_count_against_the_memory_cgroup(tree, no_leaks):
    with Sandbox(SandboxSpec(image=f"dir:{tree}", memory=256 * MiB, disk=512 * MiB)) as sb:
        if sb.cgroup is None:
            pytest.skip("the sandbox has no cgroup here")
        r = sh(sb, "dd if=/dev/zero of=/var/tmp/big bs=1M count=64 2>/dev/null")
        assert r.ok
        if sb.cgroup.peak_resettable:  # cgroup v2 before 6.12: the peak is unknown (None)
            assert r.peak_memory >= 64 * MiB, r.peak_memory
        # Past the memory limit the tmpfs cannot grow, though the disk limit is far off.
        r = sh(sb, "dd if=/dev/zero of=/var/tmp/more bs=1M count=300")
        assert r.oom_killed or b"Cannot allocate memory" in r.stderr, r


def test_IMG_CROSS_01_two_sandboxes_on_one_tree_do_not_see_each_others_writes(tree, no_leaks):
    spec = SandboxSpec(image=f"dir:{tree}")
    with Sandbox(spec) as a, Sandbox(spec) as b:
        assert sh(a, "echo a > /var/tmp/a; echo a >> /srv/shared/notes").ok
        assert sh(b, "echo b > /var/tmp/b").ok
        assert sh(b, "ls /var/tmp; cat /srv/shared/notes").stdout == b"b\nfirst line\n"
        assert sh(a, "ls /var/tmp").stdout == b"a\n"


def test_IMG_SUID_01_a_setuid_file_of_the_tree_gives_no_privilege(tree, no_leaks):
    os.mkdir(os.path.join(tree, "suid"))
    suid = os.path.join(tree, "suid/id")  # busybox runs the applet its name says
    shutil.copy(BUSYBOX, suid)
    os.chmod(suid, 0o4755)
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sb:
        assert sh(sb, "stat -c '%a %u' /suid/id").stdout == b"4755 0\n"
        r = sb.exec(["/suid/id", "-u"])
        assert r.stdout == f"{AGENT_UID}\n".encode(), r
        assert {"nosuid", "nodev"} <= _root_mount(sb)[0]


def test_IMG_DEV_01_a_device_node_in_the_tree_cannot_be_opened(tree, no_leaks):
    os.mknod(os.path.join(tree, "srv/shared/null"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sb:
        assert sh(sb, "stat -c '%F %t,%T' /srv/shared/null").stdout == \
            b"character special file 1,3\n"
        r = sh(sb, "echo x > /srv/shared/null")
        assert r.exit_code != 0 and b"Permission denied" in r.stderr, r
        assert "nodev" in _root_mount(sb)[0]


def test_IMG_GONE_01_the_overlay_leaves_nothing_behind_on_the_host(tree, no_leaks):
    before = sorted(os.listdir(tree))
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sb:
        opts, fstype, fs_opts = _root_mount(sb)
        assert fstype == "overlay" and "userxattr" in fs_opts and "ro" not in opts
        assert sh(sb, "echo x > /var/tmp/x").ok
        with open("/proc/self/mountinfo") as f:
            assert tree not in f.read()  # never in the host's mount table, even now
    with open("/proc/self/mountinfo") as f:
        assert tree not in f.read() and " overlay " not in f.read()
    assert sorted(os.listdir(tree)) == before
    assert not [d for d, dirs, _ in os.walk(tree) for n in dirs if n in ("upper", "work")]


def _oci_image(tree: str, layout: str) -> str:
    """tree as an OCI image made by umoci, with an Env and a WorkingDir in its config."""
    if shutil.which("umoci") is None:
        pytest.skip("needs umoci (scripts/setup installs it)")
    bundle = layout + ".bundle"
    for argv in (["init", "--layout", layout], ["new", "--image", f"{layout}:t"],
                 ["config", "--image", f"{layout}:t", "--config.env", "PATH=/bin",
                  "--config.env", "FROM_IMAGE=image", "--config.env", "BOTH=image",
                  "--config.workingdir", "/srv"],
                 ["unpack", "--image", f"{layout}:t", bundle]):
        subprocess.run(["umoci", *argv], check=True, capture_output=True)
    shutil.rmtree(os.path.join(bundle, "rootfs"))
    subprocess.run(["cp", "-a", tree, os.path.join(bundle, "rootfs")], check=True)  # owners too
    subprocess.run(["umoci", "repack", "--image", f"{layout}:t", bundle], check=True,
                   capture_output=True)
    shutil.rmtree(bundle)
    return f"oci:{layout}:t"


def test_a_store_image_runs_by_source_and_by_name_with_its_env_and_workdir(
        tree, tmp_path, monkeypatch, no_leaks):
    monkeypatch.setenv("KAROTTE_IMAGE_DIR", str(tmp_path / "store"))
    ref = _oci_image(tree, str(tmp_path / "layout"))
    with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sb:  # dir: has no image config
        assert sb.exec(["/bin/pwd"]).stdout == b"/workspace\n"
    images.import_image(ref, name="test/busybox")
    for image in (ref, "test/busybox"):
        with Sandbox(SandboxSpec(image=image)) as sb:
            r = sb.exec(["env"], env={"BOTH": "caller"})
            env = dict(line.split("=", 1) for line in r.stdout.decode().splitlines())
            assert (env["PATH"], env["FROM_IMAGE"], env["BOTH"]) == ("/bin", "image", "caller")
            assert env["HOME"] == mounts.HOME  # Karotte's defaults stay under both
            assert sb.exec(["pwd"]).stdout == b"/srv\n"
            assert sb.exec(["pwd"], cwd="/var/tmp").stdout == b"/var/tmp\n"
            # the image's ids, seen through the idmapped tree: root's files are root's
            r = sh(sb, "stat -c '%u %g' /etc/hostname /srv/agent/mine; cat /etc/hostname; "
                       "echo hi > /var/tmp/x && cat /var/tmp/x")
            assert r.stdout.decode().split("\n")[:4] == ["0 0", f"{AGENT_UID} {AGENT_UID}",
                                                        "busybox-image", "hi"]


def test_the_store_keeps_an_images_tree_while_a_sandbox_runs_on_it(tree, tmp_path, monkeypatch,
                                                                  no_leaks):
    monkeypatch.setenv("KAROTTE_IMAGE_DIR", str(tmp_path / "store"))
    ref = _oci_image(tree, str(tmp_path / "layout"))
    with Sandbox(SandboxSpec(image=ref)) as sb:  # imported now, unnamed: gc may take it
        store = images.default_store()
        kept = store.gc()
        assert kept.trees_in_use and not kept.trees_removed
        assert sb.exec(["cat", "/etc/hostname"]).stdout == b"busybox-image\n"
    gone = store.gc()
    assert gone.trees_removed == kept.trees_in_use and not gone.trees_in_use


# --------------------------------------------------------------------------- fail closed


@pytest.fixture
def tree_on_an_overlay():
    """A tree inside an overlayfs mount of the host's: a filesystem that cannot be
    idmapped, as a container's own root is one."""
    top = tempfile.mkdtemp(prefix="karotte-test-ovl-")
    os.chmod(top, 0o755)
    for d in ("lower", "upper", "work", "merged"):
        os.mkdir(os.path.join(top, d))
    src = _busybox_tree()
    shutil.move(src, os.path.join(top, "lower", "tree"))
    merged = os.path.join(top, "merged")
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={top}/lower,upperdir={top}/upper,workdir={top}/work", merged],
                   check=True)
    try:
        yield os.path.join(merged, "tree")
    finally:
        subprocess.run(["umount", merged], check=True)
        shutil.rmtree(top)


def test_a_tree_that_cannot_be_idmapped_fails_closed_naming_image_overlay(tree_on_an_overlay):
    with pytest.raises(HostUnsupported) as info:
        Sandbox(SandboxSpec(image=f"dir:{tree_on_an_overlay}"))
    assert info.value.protection == "image-overlay"
    assert "cannot be idmapped" in str(info.value) and "EINVAL" in str(info.value)
    assert "put the tree on ext4" in str(info.value)


def test_the_probe_reports_image_overlay_off_where_its_tree_cannot_be_idmapped(
        tree_on_an_overlay):
    # KAROTTE_CGROUP_PARENT stays: it is where the VM lane delegates cgroups.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KAROTTE_") or k == "KAROTTE_CGROUP_PARENT"}
    r = subprocess.run([sys.executable, "-m", "karotte.cli.sandbox", "check", "--json"],
                       env={**env, "TMPDIR": os.path.dirname(tree_on_an_overlay)},
                       capture_output=True, text=True, timeout=60, cwd="/")
    report = json.loads(r.stdout)
    line = {x["name"]: x for x in report["protections"]}["image-overlay"]
    assert r.returncode == 0 and line["enforced"] is False and line["default"] is False
    assert "cannot be idmapped" in line["why_not"] and "put the tree on ext4" in line["why_not"]
    assert report["missing_defaults"] == []


# --------------------------------------------------------------------------- unprivileged

_AS_NOBODY = r"""
import json, os, sys
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec, MiB
from karotte.protections import NO_CGROUP
tree = sys.argv[1]
with Sandbox(SandboxSpec(image="dir:" + tree, memory=96 * MiB, allow_degraded=NO_CGROUP)) as sb:
    run = lambda s: sb.exec(["/bin/sh", "-c", s]).stdout.decode()
    print(json.dumps({"id": run("id -u"), "hostname": run("cat /etc/hostname"),
                      "write": run("echo w > /var/tmp/w && cat /var/tmp/w"),
                      "owner": run("stat -c %u /etc/hostname"),
                      "root": run("grep ' / / ' /proc/self/mountinfo")}))
"""


def test_an_unprivileged_caller_runs_on_its_own_tree(no_leaks):
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as uid 65534")
    tree = _busybox_tree(owner=NOBODY)
    try:
        before = _digest(tree)
        site = sysconfig.get_paths()["purelib"]
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", "/usr/bin/python3", "-c", _AS_NOBODY, tree],
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROJECT}:{site}"},
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["id"] == f"{AGENT_UID}\n" and out["hostname"] == "busybox-image\n"
        assert out["write"] == "w\n"
        # The caller's files are its init's root's: from the agent's own namespace, which
        # maps only itself, that is the agent (docs/image-sandbox.md, unprivileged).
        assert out["owner"] == f"{AGENT_UID}\n"
        assert " overlay " in out["root"] and "userxattr" in out["root"]
        assert _digest(tree) == before
    finally:
        shutil.rmtree(tree)


def test_an_unprivileged_caller_on_a_tree_it_does_not_own_fails_closed_naming_why(no_leaks):
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as uid 65534")
    tree = _busybox_tree()  # root's, with a /home of root's as Debian's is
    os.mkdir(os.path.join(tree, "home"), 0o755)
    script = ("import sys\nfrom karotte.sandbox import Sandbox\n"
              "from karotte.spec import SandboxSpec, MiB\nfrom karotte.protections import NO_CGROUP\n"
              "try:\n    Sandbox(SandboxSpec(image='dir:' + sys.argv[1], memory=96 * MiB, "
              "allow_degraded=NO_CGROUP))\nexcept Exception as e:\n"
              "    print(type(e).__name__, e)\n")
    try:
        site = sysconfig.get_paths()["purelib"]
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", "/usr/bin/python3", "-c", script, tree],
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROJECT}:{site}"},
                           capture_output=True, text=True, timeout=60, cwd="/")
        assert r.stdout.startswith(f"SandboxError image dir:{tree}: {tree} belongs to uid 0"), \
            r.stdout + r.stderr
        assert "the tree must be the caller's own" in r.stdout
    finally:
        shutil.rmtree(tree)
