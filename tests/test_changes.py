"""Custody of an image sandbox's filesystem diff: the overlay's upper reaches the host
(Sandbox.upper_fd), karotte.changes.scan_changes scans it with the workspace's rules and
the upper's own (whiteouts, opaque directories, overlayfs' xattrs), and a vetted diff is
laid over the image in a new sandbox (SandboxSpec.changes).

Real sandboxes on a Debian bookworm made by mmdebstrap (tests/conftest.py, cached), run as
root: the image's files belong to root, and the root agent (agent_user="root") changes them
as a package manager does. The hand-made uppers of the last tests plant what the agent
cannot (overlayfs' own xattrs), as the scan's tests plant devices.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sysconfig
import tempfile

import pytest

from conftest import needs_sandbox
from karotte.changes import OPAQUE, scan_changes
from karotte.sandbox import AGENT_UID, AsyncSandbox, Sandbox
from karotte.scan import COPY_TIME, VIOLATIONS_KEPT, ScanLimits, relation
from karotte.spec import Bind, SandboxSpec, SpecError
from karotte.userns import uid_base

pytestmark = [needs_sandbox(), pytest.mark.cgroup2,
              pytest.mark.skipif(os.geteuid() != 0, reason="the image is root-owned "
                                 "(mmdebstrap's), which an unprivileged caller cannot run on")]

# tmpfs holds user xattrs from Linux 6.6: before it, overlayfs cannot mark a directory of
# the upper opaque, nor rename one through its work directory.
KERNEL = tuple(int(x) for x in os.uname().release.split(".")[:2])
TMPFS_USER_XATTRS = KERNEL >= (6, 6)


@pytest.fixture(scope="module")
def image(attack_tree) -> str:
    return f"dir:{attack_tree}"


def agent_diff(image: str, script: str, dest: str, *, limits: ScanLimits = ScanLimits(),
               deliverables=(), agent_user: str = "root"):
    """Run script as the agent on the image, kill, and scan its upper into dest: the
    script's result and the ScanResult."""
    with Sandbox(SandboxSpec(image=image, agent_user=agent_user)) as sb:
        r = sb.exec(["/bin/sh", "-c", script])
        sb.kill_all()
        return r, scan_changes(sb.upper_fd, dest, limits, deliverables=deliverables)


@pytest.fixture
def dest(tmp_path) -> str:
    path = tmp_path / "diff"
    path.mkdir()
    return str(path)


def kinds(result) -> dict[str, str]:
    return {v.path: v.kind for v in result.violations}


def tree_of(dest: str) -> dict[str, tuple]:
    """Every entry of a diff: its type letter, mode, owner, and opaque mark."""
    out = {}
    for d, dirs, files in os.walk(dest):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            kind = ("c" if stat.S_ISCHR(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode)
                    else "l" if stat.S_ISLNK(st.st_mode) else "f")
            opaque = kind == "d" and OPAQUE in os.listxattr(path)
            out["/" + os.path.relpath(path, dest)] = (kind, stat.S_IMODE(st.st_mode),
                                                      st.st_uid, st.st_gid, opaque)
    return out


# --------------------------------------------------------------------------- the upper fd


def test_the_upper_fd_is_an_images_and_outlives_the_kill_until_close(image, no_leaks):
    with Sandbox(SandboxSpec()) as sb:
        assert sb.upper_fd is None  # the host's userland has no upper
    with Sandbox(SandboxSpec(image=image)) as sb:
        # no program the trainer starts gets either
        assert not os.get_inheritable(sb.upper_fd) and not os.get_inheritable(sb.workspace_fd)
        assert sh_ok(sb, "echo new > /var/tmp/new")
        sb.kill_all()
        fd = sb.upper_fd
        assert os.listdir(f"/proc/self/fd/{fd}") == ["var"]
    assert sb.upper_fd is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_async_sandbox_has_the_upper_fd_too(image, no_leaks):
    async def main():
        async with AsyncSandbox(SandboxSpec(image=image)) as sb:
            assert (await sb.exec(["/bin/sh", "-c", "echo x > /etc/async"])).exit_code != 0
            assert (await sb.exec(["/bin/sh", "-c", "echo x > /var/tmp/async"])).ok
            await sb.kill_all()
            assert os.listdir(f"/proc/self/fd/{sb.upper_fd}/var/tmp") == ["async"]
        return sb

    assert asyncio.run(main()).upper_fd is None


def sh_ok(sb: Sandbox, script: str) -> bool:
    r = sb.exec(["/bin/sh", "-c", script])
    assert r.ok, r
    return True


def test_DIFF_MOUNTS_01_the_upper_holds_nothing_init_made_only_the_agents_change(
        image, shared_dir, no_leaks):
    """The mount points of the plan (/dev, /proc, /tmp, /workspace, /home/agent and a bind's)
    are in a layer of their own, so the upper is exactly the agent's diff."""
    spec = SandboxSpec(image=image, binds=(Bind(shared_dir, "/srv/data"),))
    with Sandbox(spec) as sb:
        assert sh_ok(sb, "echo w > /workspace/w; echo h > /home/agent/h; echo t > /tmp/t; "
                         "ls /srv/data; stat -c %a /home")
        sb.kill_all()
        assert os.listdir(f"/proc/self/fd/{sb.upper_fd}") == []


# --------------------------------------------------------------------------- the scan


def test_DIFF_FIFO_01_a_fifo_at_etc_x_is_rejected_and_named(image, dest, no_leaks):
    r, result = agent_diff(image, "mkfifo /etc/x && echo ok > /etc/fine", dest,
                           deliverables=("/etc/x",))
    assert r.ok, r
    assert kinds(result) == {"/etc/x": "fifo"}
    assert [f.path for f in result.files] == ["/etc/fine"]
    assert not os.path.lexists(os.path.join(dest, "etc/x"))


def test_DIFF_SYMLINK_01_a_symlink_replacing_python3_is_kept_as_a_symlink(image, dest, no_leaks):
    r, result = agent_diff(image, "ln -sf /bin/sh /usr/bin/python3", dest)
    assert r.ok and not result.violations, (r, result)
    link = os.path.join(dest, "usr/bin/python3")
    st = os.lstat(link)
    assert stat.S_ISLNK(st.st_mode) and os.readlink(link) == "/bin/sh"
    # the ids the root agent saw (0:0), as the diff's files carry them; the copy's times
    assert (st.st_uid, st.st_gid) == ((0, 0) if os.geteuid() == 0 else (os.geteuid(), os.getegid()))
    assert st.st_mtime == COPY_TIME


def test_DIFF_SYMLINK_02_the_host_never_follows_a_link_of_the_diff(image, dest, tmp_path,
                                                                     no_leaks):
    """Links to what the host may read (a file of root's, a directory, a relative way up
    to them): the copy holds the links, not a byte of what they name."""
    secret = tmp_path / "host-secret"
    secret.write_text("HOST SECRET\n")
    script = (f"ln -s {secret} /etc/file && ln -s {tmp_path} /etc/dir && "
              f"ln -s ../../../../../../..{secret} /etc/up && echo mine > /etc/mine")
    r, result = agent_diff(image, script, dest)
    assert r.ok and not result.violations, (r, result)
    assert [f.path for f in result.files] == ["/etc/mine"]
    assert {n: os.readlink(os.path.join(dest, "etc", n)) for n in ("file", "dir", "up")} == {
        "file": str(secret), "dir": str(tmp_path), "up": f"../../../../../../..{secret}"}
    assert tree_of(dest)["/etc/dir"][0] == "l"
    for d, dirs, files in os.walk(dest):
        for name in files:
            path = os.path.join(d, name)
            if not os.path.islink(path):
                with open(path, "rb") as f:
                    assert b"HOST SECRET" not in f.read(), path


@pytest.mark.parametrize("deliverable, script, path", [
    ("/etc/x", "ln -s /etc/issue /etc/x", "/etc/x"),
    ("/etc/app/conf", "ln -s /root /etc/app", "/etc/app"),
    ("/etc/app", "mkdir /etc/app && ln -s /etc/issue /etc/app/conf", "/etc/app/conf"),
], ids=["at", "on-the-way", "inside"])
def test_DIFF_SYMLINK_04_a_symlink_at_in_or_on_the_way_to_a_deliverable_is_rejected(
        image, dest, no_leaks, deliverable, script, path):
    r, result = agent_diff(image, script, dest, deliverables=(deliverable,))
    assert r.ok and kinds(result) == {path: "symlink"}, (r, result)
    assert not os.path.lexists(os.path.join(dest, path[1:]))


def test_DIFF_FLOOD_01_link_targets_count_against_max_total_size(image, dest, no_leaks):
    script = "python3 -c \"import os; [os.symlink('a' * 4000, f'/etc/l{i:02}') for i in range(50)]\""
    r, result = agent_diff(image, script, dest, limits=ScanLimits(max_total_size=100_000))
    assert r.ok, r
    assert not result.complete and kinds(result) == {"/etc/l25": "total-too-large"}, result
    assert len(os.listdir(os.path.join(dest, "etc"))) == 25


def test_DIFF_SUID_01_a_setuid_file_is_rejected(image, dest, no_leaks):
    r, result = agent_diff(image, "cp /bin/id /usr/local/bin/myid && chmod 4755 "
                                  "/usr/local/bin/myid && cp /bin/id /etc/sg && chmod 2755 /etc/sg",
                           dest)
    assert r.ok, r
    assert kinds(result) == {"/usr/local/bin/myid": "setuid", "/etc/sg": "setgid"}
    assert not os.path.lexists(os.path.join(dest, "usr/local/bin/myid"))


def test_DIFF_DELETE_01_a_deleted_base_file_is_a_whiteout_in_the_diff(image, dest, no_leaks):
    r, result = agent_diff(image, "rm /etc/debian_version /usr/bin/cmp", dest)
    assert r.ok, r
    assert result.deleted == ("/etc/debian_version", "/usr/bin/cmp") and not result.violations
    for path in ("etc/debian_version", "usr/bin/cmp"):
        st = os.lstat(os.path.join(dest, path))
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # a whiteout, as overlayfs reads it
        assert st.st_mtime == COPY_TIME


def test_DIFF_OPAQUE_01_a_directory_removed_and_made_again_replaces_the_images(
        image, dest, no_leaks):
    script = "rm -rf /usr/share/doc/bash && mkdir /usr/share/doc/bash && echo n > /usr/share/doc/bash/new"
    r, result = agent_diff(image, script, dest)
    if not TMPFS_USER_XATTRS:
        # Before 6.6 the upper's tmpfs has no user xattrs: overlayfs cannot make the opaque
        # directory (nor clear one through its work directory) and says EIO. The agent
        # cannot replace a directory of the image at all, so there is no replacement.
        assert r.exit_code != 0 and b"Input/output error" in r.stderr, r
        assert result.replaced == ()
        return
    assert r.ok, r
    assert result.replaced == ("/usr/share/doc/bash",) and not result.violations
    assert [f.path for f in result.files] == ["/usr/share/doc/bash/new"]
    assert tree_of(dest)["/usr/share/doc/bash"][4] is True


def test_DIFF_XATTR_01_the_agent_cannot_set_overlay_xattrs_to_forge_a_deletion(
        image, dest, no_leaks):
    """user.overlay.* set through the overlay would be the upper's own markers (an opaque
    /etc would delete the image's /etc for the grader). From 6.7 overlayfs stores them
    escaped (user.overlay.overlay.*), before it refuses them: either way they mark nothing,
    and the diff carries no xattr of the agent's."""
    code = ("import os, errno\n"
            "os.mkdir('/etc/forged')\n"
            "for path, name in (('/etc', 'opaque'), ('/etc/forged', 'opaque'),"
            " ('/etc/passwd', 'metacopy'), ('/etc/forged', 'redirect')):\n"
            "    try:\n"
            "        os.setxattr(path, 'user.overlay.' + name, b'y')\n"
            "        print('set')\n"
            "    except OSError as e:\n"
            "        print(errno.errorcode[e.errno])\n")
    r, result = agent_diff(image, f"python3 -c \"{code}\"", dest)
    assert r.ok, r
    if KERNEL >= (6, 7):
        assert set(r.stdout.split()) == {b"set"}, r.stdout  # stored escaped
    else:  # refused: 6.1's upper tmpfs holds no user xattrs at all (ENOTSUP)
        assert b"set" not in r.stdout and len(r.stdout.split()) == 4, r.stdout
    assert result.replaced == () and result.deleted == () and not result.violations
    # Set, the xattr copied /etc/passwd up; refused, it did not.
    assert [f.path for f in result.files] == (["/etc/passwd"] if KERNEL >= (6, 7) else [])
    assert os.listxattr(os.path.join(dest, "etc/forged")) == []
    assert os.listxattr(os.path.join(dest, "etc")) == []


def test_DIFF_HARDLINK_01_a_hard_link_in_the_upper_is_rejected(image, dest, no_leaks):
    r, result = agent_diff(image, "ln /etc/passwd /etc/passwd2", dest)
    assert r.ok, r
    # The link copied /etc/passwd up: both names are one inode of the upper.
    assert kinds(result) == {"/etc/passwd": "hardlink", "/etc/passwd2": "hardlink"}
    assert sorted(tree_of(dest)) == ["/etc"]


def test_DIFF_FLOOD_01_a_flood_of_files_in_etc_stays_bounded(image, tmp_path, no_leaks):
    script = ("python3 -c \"import os\nfor i in range(3000): os.mkfifo(f'/etc/f{i}')\"; "
              "mkfifo /etc/zz")
    with Sandbox(SandboxSpec(image=image, agent_user="root")) as sb:
        assert sh_ok(sb, script)
        sb.kill_all()
        whole, cut = tmp_path / "whole", tmp_path / "cut"
        whole.mkdir()
        cut.mkdir()
        result = scan_changes(sb.upper_fd, whole, ScanLimits(), deliverables=("/etc/zz",))
        budget = scan_changes(sb.upper_fd, cut, ScanLimits(max_entries=2000))
    # VIOLATIONS_KEPT FIFOs are held and the rest counted; the deliverable's is held
    # whatever came before it.
    assert result.complete and {v.kind for v in result.violations} == {"fifo"}
    assert len(result.violations) == VIOLATIONS_KEPT + 1 and result.violations_dropped == 2900
    assert "/etc/zz" in kinds(result)
    # a diff's absolute paths meet a deliverable as a workspace's relative ones do
    assert [v.path for v in result.violations if relation(v.path, "/etc/zz")] == ["/etc/zz"]
    assert [v.path for v in result.violations if relation(v.path, "etc/zz")] == ["/etc/zz"]
    assert not budget.complete and kinds(budget)["/etc"] == "too-many-entries"
    assert len(budget.violations) == VIOLATIONS_KEPT  # the budget is one of them


def test_the_diff_keeps_the_modes_and_the_ids_the_agent_saw(image, dest, no_leaks):
    script = ("echo k > /etc/key && chmod 600 /etc/key && echo a > /var/tmp/a && "
              f"chown {AGENT_UID}:{AGENT_UID} /var/tmp/a && mkdir -m 750 /opt/x && "
              "chown 33:33 /opt/x")
    r, result = agent_diff(image, script, dest)
    assert r.ok and not result.violations, (r, result)
    entries = tree_of(dest)
    assert entries["/etc/key"] == ("f", 0o600, 0, 0, False)
    assert entries["/var/tmp"] == ("d", 0o1777, 0, 0, False)  # copied up with its mode
    assert entries["/var/tmp/a"] == ("f", 0o644, AGENT_UID, AGENT_UID, False)
    assert entries["/opt/x"] == ("d", 0o750, 33, 33, False)


# --------------------------------------------------------------------------- hand-made uppers


@pytest.fixture
def upper(tmp_path):
    """A hand-made upper (on a filesystem with user xattrs, as tmp_path's ext4 is here and
    in the VM lane), and a function that gives an entry of it to the sandboxes' root, as a
    real upper's would be."""
    path = tmp_path / "upper"
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    yield str(path), fd, lambda entry: os.chown(entry, uid_base(), uid_base())
    os.close(fd)


@pytest.fixture
def shm_dest():
    """A diff's directory on another filesystem than tmp_path's (a tmpfs)."""
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="karotte-test-diff-")
    yield path
    shutil.rmtree(path)


@pytest.mark.parametrize("name, value, what", [
    ("metacopy", b"", "file"), ("redirect", b"/elsewhere", "dir"), ("whiteout", b"", "file"),
    ("opaque", b"x", "dir"), ("opaque", b"y", "file"), ("future", b"1", "dir")])
def test_DIFF_METACOPY_01_an_overlay_xattr_other_than_bookkeeping_is_rejected(
        upper, shm_dest, name, value, what):
    """A metacopy file's bytes are in a lower layer; a redirect's contents are another
    path's: accepted, the grader would see what the agent never had."""
    path, fd, own = upper
    entry = os.path.join(path, "etc", "x")
    os.mkdir(os.path.dirname(entry))
    if what == "dir":
        os.mkdir(entry)
    else:
        with open(entry, "w") as f:
            f.write("looks whole\n")
    own(os.path.dirname(entry))
    own(entry)
    os.setxattr(entry, f"user.overlay.{name}", value)
    result = scan_changes(fd, shm_dest, ScanLimits())
    assert kinds(result) == {"/etc/x": "overlay-metadata"}
    assert f"user.overlay.{name}" in result.violations[0].detail
    assert not os.path.lexists(os.path.join(shm_dest, "etc/x"))


def test_overlays_bookkeeping_xattrs_are_dropped(upper, shm_dest):
    path, fd, own = upper
    os.mkdir(os.path.join(path, "usr"))
    os.setxattr(os.path.join(path, "usr"), "user.overlay.impure", b"y")
    with open(os.path.join(path, "usr", "f"), "w") as f:
        f.write("mine\n")
    own(os.path.join(path, "usr"))
    own(os.path.join(path, "usr", "f"))
    os.setxattr(os.path.join(path, "usr", "f"), "user.overlay.origin", b"")
    result = scan_changes(fd, shm_dest, ScanLimits())
    assert not result.violations and [f.path for f in result.files] == ["/usr/f"]
    assert os.listxattr(os.path.join(shm_dest, "usr")) == []
    assert os.listxattr(os.path.join(shm_dest, "usr", "f")) == []


def test_an_id_outside_the_sandboxes_is_rejected(upper, shm_dest):
    path, fd, _ = upper
    with open(os.path.join(path, "f"), "w") as f:
        f.write("the host's\n")
    os.chown(os.path.join(path, "f"), 1234, 1234)  # a host id, no sandbox's
    result = scan_changes(fd, shm_dest, ScanLimits())
    assert kinds(result) == {"/f": "unmapped-owner"}


# --------------------------------------------------------------------------- laid over the image


def test_changes_need_an_image_and_name_the_fix():
    with pytest.raises(SpecError) as info:
        SandboxSpec(changes="/srv/diff")
    assert info.value.field == "changes" and "SandboxSpec(image=..., changes=...)" in str(info.value)
    for bad in ("relative/diff", "/srv/../diff", "/", 7):
        with pytest.raises(SpecError):
            SandboxSpec(image="dir:/srv/tree", changes=bad)
    with pytest.raises(FileNotFoundError, match="scan_changes filled"):
        Sandbox(SandboxSpec(image="dir:/srv/tree-that-is-not-there-either",
                            changes="/nonexistent/karotte-diff"))


def test_DIFF_READBACK_01_a_vetted_diff_reads_back_over_the_image_in_a_new_sandbox(
        image, dest, attack_tree, no_leaks):
    script = ("set -e; echo conf > /etc/app.conf; chmod 640 /etc/app.conf; chown 0:33 /etc/app.conf; "
              f"echo mine > /var/tmp/a; chown {AGENT_UID}:{AGENT_UID} /var/tmp/a; "
              "rm /etc/debian_version; mkfifo /etc/x; echo more >> /etc/issue")
    r, result = agent_diff(image, script, dest)
    assert r.ok and kinds(result) == {"/etc/x": "fifo"}, (r, result)
    with Sandbox(SandboxSpec(image=image, changes=dest)) as sb:
        r = sb.exec(["/bin/sh", "-c", "stat -c '%a %u:%g' /etc/app.conf /var/tmp/a /var/tmp; "
                                      "cat /var/tmp/a; tail -1 /etc/issue; "
                                      "test -e /etc/debian_version || echo deleted; "
                                      "test -e /etc/x || echo no-fifo; cat /etc/app.conf"])
        assert r.stdout.decode().splitlines() == [
            "640 0:33", f"644 {AGENT_UID}:{AGENT_UID}", "1777 0:0", "mine", "more", "deleted",
            "no-fifo"], r  # 0640 root:www-data: the agent (uid 1000) may not read it
        # The sandbox's own upper starts fresh on top, and writes over the diff copy it up.
        assert sb.exec(["/bin/sh", "-c", "echo again >> /var/tmp/a && cat /var/tmp/a"]).stdout \
            == b"mine\nagain\n"
        sb.kill_all()
        assert os.listdir(f"/proc/self/fd/{sb.upper_fd}") == ["var"]
    assert os.path.exists(os.path.join(attack_tree, "etc/debian_version"))
    with open(os.path.join(dest, "var/tmp/a")) as f:
        assert f.read() == "mine\n"  # the diff is a lower: never written


def test_DIFF_SYMLINK_01_a_sandbox_on_the_diff_runs_the_agents_python3(image, dest, no_leaks):
    # The link resolves in the sandbox's own root: the image, the diff and what the new
    # sandbox is given. Its python3 is the agent's /bin/sh, the agent's own system.
    r, result = agent_diff(image, "ln -sf /bin/sh /usr/bin/python3 && rm /usr/bin/python3.11", dest)
    assert r.ok and not result.violations and result.deleted == ("/usr/bin/python3.11",), result
    with Sandbox(SandboxSpec(image=image, changes=dest)) as sb:
        r = sb.exec(["/bin/sh", "-c", "readlink /usr/bin/python3; python3 -c 'echo the agents'"])
        assert r.stdout == b"/bin/sh\nthe agents\n", r


def test_DIFF_OPAQUE_01_a_replaced_directory_shows_only_the_new_contents(image, dest, no_leaks):
    if not TMPFS_USER_XATTRS:
        pytest.skip("before Linux 6.6 the upper cannot hold an opaque directory "
                    "(test_DIFF_OPAQUE_01_a_directory_removed_and_made_again_...)")
    script = "rm -rf /usr/share/doc/bash && mkdir /usr/share/doc/bash && echo n > /usr/share/doc/bash/new"
    r, result = agent_diff(image, script, dest)
    assert r.ok and result.replaced == ("/usr/share/doc/bash",), (r, result)
    with Sandbox(SandboxSpec(image=image, changes=dest)) as sb:
        assert sb.exec(["ls", "/usr/share/doc/bash"]).stdout == b"new\n"
        assert sb.exec(["ls", "/usr/share/doc/dash"]).stdout != b""  # its sibling stays


DEB_SCRIPT = """set -e
mkdir -p /var/tmp/pkg/DEBIAN /var/tmp/pkg/usr/share/karotte-test
cat > /var/tmp/pkg/DEBIAN/control <<EOF
Package: karotte-test-pkg
Version: 1.0
Architecture: all
Maintainer: Karotte <karotte@example.invalid>
Description: a package the agent built
EOF
echo installed > /var/tmp/pkg/usr/share/karotte-test/marker
dpkg-deb --build --root-owner-group /var/tmp/pkg /var/tmp/karotte-test.deb >/dev/null
rm -rf /var/tmp/pkg
dpkg -i /var/tmp/karotte-test.deb >/dev/null
dpkg -s karotte-test-pkg | grep -q 'Status: install ok installed'
"""


def test_DIFF_DPKG_01_a_package_the_root_agent_installed_is_seen_over_the_diff(
        image, dest, no_leaks):
    r, result = agent_diff(image, DEB_SCRIPT, dest)
    if not TMPFS_USER_XATTRS:
        # dpkg unpacks a new directory as NAME.dpkg-new and renames it into place; overlayfs
        # marks a directory moved into one of the image's opaque, which an upper without
        # user xattrs cannot hold: EXDEV. Before 6.6 a package that brings a directory
        # cannot be installed on an image.
        assert r.exit_code != 0 and b"Invalid cross-device link" in r.stderr, r
        return
    assert r.ok, r.stderr
    # The directory dpkg renamed into place is opaque: nothing of the image was there.
    assert "/usr/share/karotte-test" in result.replaced
    assert "/var/lib/dpkg/status" in [f.path for f in result.files]
    assert not [v for v in result.violations if v.path.startswith("/var/lib/dpkg/")], \
        result.violations
    with Sandbox(SandboxSpec(image=image, changes=dest)) as sb:
        r = sb.exec(["/bin/sh", "-c", "dpkg -s karotte-test-pkg | grep Status; "
                                      "cat /usr/share/karotte-test/marker; dpkg -L karotte-test-pkg"])
        assert r.stdout.decode().splitlines()[:2] == ["Status: install ok installed", "installed"], r
        assert b"/usr/share/karotte-test/marker" in r.stdout


_DIFF_AS_NOBODY = r"""
import json, os, sys, tempfile
from karotte.changes import scan_changes
from karotte.sandbox import Sandbox
from karotte.scan import ScanLimits
from karotte.spec import SandboxSpec, MiB
from karotte.protections import NO_CGROUP
tree, dest = sys.argv[1], sys.argv[2]
spec = dict(image="dir:" + tree, memory=96 * MiB, allow_degraded=NO_CGROUP)
with Sandbox(SandboxSpec(**spec)) as sb:
    r = sb.exec(["/bin/sh", "-c", "echo new > /srv/agent/new && chmod 600 /srv/agent/new && "
                                  "rm /srv/agent/mine && echo more >> /srv/shared/notes"])
    assert r.ok, r
    sb.kill_all()
    result = scan_changes(sb.upper_fd, dest, ScanLimits())
with Sandbox(SandboxSpec(**spec, changes=dest)) as sb:
    seen = sb.exec(["/bin/sh", "-c", "cat /srv/agent/new /srv/shared/notes; "
                                     "test -e /srv/agent/mine || echo deleted; "
                                     "stat -c '%a %u' /srv/agent/new"]).stdout.decode()
print(json.dumps({"files": [f.path for f in result.files], "deleted": result.deleted,
                  "violations": [v.path for v in result.violations], "seen": seen}))
"""


def test_an_unprivileged_callers_diff_is_its_own_and_reads_back(no_leaks):
    """An unprivileged caller's sandbox maps only the caller: its diff is the caller's, as
    its trees are, and its whiteouts are made without privilege (Linux 5.8+)."""
    from test_image_sandbox import NOBODY, PROJECT, _busybox_tree
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as uid 65534")
    tree = _busybox_tree(owner=NOBODY)
    dest = tempfile.mkdtemp(prefix="karotte-test-diff-")
    os.chown(dest, NOBODY, NOBODY)
    try:
        site = sysconfig.get_paths()["purelib"]
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", "/usr/bin/python3", "-c", _DIFF_AS_NOBODY, tree,
                            dest], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROJECT}:{site}"},
                           capture_output=True, text=True, timeout=120, cwd="/")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["files"] == ["/srv/agent/new", "/srv/shared/notes"] and not out["violations"]
        assert out["deleted"] == ["/srv/agent/mine"]
        assert out["seen"] == f"new\nfirst line\nmore\ndeleted\n600 {AGENT_UID}\n"
        st = os.lstat(os.path.join(dest, "srv/agent/mine"))
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0 and st.st_uid == NOBODY
        assert os.lstat(os.path.join(dest, "srv/agent/new")).st_uid == NOBODY
    finally:
        shutil.rmtree(tree)
        shutil.rmtree(dest)
