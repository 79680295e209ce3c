"""The custody scan (karotte/scan.py) against the FS-* attacks of docs/attacks.md.

Each test plants the attack in a real sandbox's /workspace as the agent would (uid
1000 inside), kills the sandbox (D1), scans the workspace fd the host holds and checks
the verdict (kind, escaped path, rule) and the copy: only accepted files, byte-exact,
new inodes owned by the host with normalised modes (D2, D3, D4).
"""
from __future__ import annotations

import ctypes
import itertools
import json
import os
import secrets
import shutil
import stat
import struct
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from contextlib import contextmanager

import prctl
import pytest

from conftest import py
from envs.pipeline import file_times
from karotte import scan
from karotte.sandbox import Sandbox
from karotte.scan import (COPY_TIME, VIOLATION_KINDS, ScanError, ScanLimits, ScanResult, escape,
                          Violation, scan_and_copy)
from karotte.spec import GiB, MiB, SandboxSpec

HOST_UID = os.geteuid()
# The copy goes to a tmpfs where the host has one, as custody's grader input tree would:
# creating 10,000 inodes costs what the destination filesystem makes it cost.
COPY_ROOT = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
RULE_TYPES = "D3 file types: only regular files and directories"
COPY_TIME_NS = COPY_TIME * 1_000_000_000


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def dest():
    """A fresh empty host directory for the copy, removed after the test."""
    path = tempfile.mkdtemp(prefix="karotte-scan-test-", dir=COPY_ROOT)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def host_secret():
    """A host file the agent must never get into the copy (the target of its links)."""
    folder = tempfile.mkdtemp(prefix="karotte-scan-secret-")
    path = os.path.join(folder, "secret")
    content = b"HOST-SECRET-" + secrets.token_hex(16).encode()
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, 0o600)
    yield path, content
    shutil.rmtree(folder)


@contextmanager
def planted(command, spec: SandboxSpec | None = None, stdin: bytes = b""):
    """A sandbox in which the agent ran `command` (in /workspace), then was killed."""
    with Sandbox(spec or SandboxSpec()) as sb:
        r = sb.exec(command, stdin=stdin, timeout=120)
        assert r.exit_code == 0, r.stderr
        sb.kill_all()
        yield sb


def copy_tree(dest: str) -> dict[bytes, tuple[str, int, bytes | None]]:
    """The copy as {raw relative path: (type, mode, content)}, checking on the way what
    every copy must be: new inodes owned by the host, modes 0644/0755, no xattrs, mtime
    COPY_TIME (dest itself too)."""
    found = {}
    root = os.fsencode(dest)
    assert os.lstat(root).st_mtime_ns == COPY_TIME_NS
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(top, name)
            rel = os.path.relpath(full, root)
            st = os.lstat(full)
            assert st.st_uid == HOST_UID and st.st_gid == os.getegid(), rel
            assert st.st_mtime_ns == COPY_TIME_NS, rel
            assert os.listxattr(full, follow_symlinks=False) == [], rel
            if stat.S_ISDIR(st.st_mode):
                assert stat.S_IMODE(st.st_mode) == 0o755, rel
                found[rel] = ("dir", 0o755, None)
            else:
                assert stat.S_ISREG(st.st_mode), rel  # no symlink, FIFO or device, ever
                assert stat.S_IMODE(st.st_mode) in (0o644, 0o755), rel
                assert st.st_nlink == 1, rel
                with open(full, "rb") as f:
                    found[rel] = ("file", stat.S_IMODE(st.st_mode), f.read())
    return found


def checked(result: ScanResult, dest: str) -> dict[bytes, tuple[str, int, bytes | None]]:
    """Check that the result and the copy agree and that every path is safe to log."""
    tree = copy_tree(dest)
    files = {f.raw: f for f in result.files}
    assert {p for p, v in tree.items() if v[0] == "file"} == set(files)
    assert {escape(p) for p, v in tree.items() if v[0] == "dir"} == set(result.dirs)
    for raw, f in files.items():
        assert f.path == escape(raw) and f.size == len(tree[raw][2]) and f.mode == tree[raw][1]
    for v in result.violations:
        assert v.kind in VIOLATION_KINDS, v
        assert v.path.isprintable() and v.rule, v
    return tree


def violations(result: ScanResult) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for v in result.violations:
        out.setdefault(v.path, set()).add(v.kind)
    return out


def only(result: ScanResult, path: str):
    found = [v for v in result.violations if v.path == path]
    assert len(found) == 1, (path, result.violations)
    return found[0]


def scan_within(seconds: float, *args, **kwargs) -> ScanResult:
    """Run the scan in a thread and fail if it does not return in time (a scanner that
    opened a FIFO for reading would block here forever)."""
    box = {}

    def target():
        try:
            box["result"] = scan_and_copy(*args, **kwargs)
        except BaseException as exc:  # handed to the test below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the scan did not return within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


@contextmanager
def recorded_opens(monkeypatch, workspace_fd: int):
    """Record every os.open the scan makes: (name, flags, on the workspace's filesystem)."""
    workspace_dev = os.fstat(workspace_fd).st_dev
    calls = []
    real_open = os.open

    def recorder(path, flags, mode=0o777, *, dir_fd=None):
        on_workspace = dir_fd is not None and os.fstat(dir_fd).st_dev == workspace_dev
        calls.append((path, flags, on_workspace))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    with monkeypatch.context() as m:
        m.setattr(os, "open", recorder)
        yield calls


def as_owner(workspace_fd: int, fn, *args) -> None:
    """Run fn(*args) in a throwaway thread whose fsuid and fsgid are the agent's host ids.

    The workspace tmpfs belongs to the sandbox's user namespace: the kernel refuses
    (EOVERFLOW) to create an inode there for an id that namespace does not map, such as
    host root. fsuid and capabilities are per thread, so the test's own stay as they are.
    """
    owner = os.fstat(workspace_fd)
    libc = ctypes.CDLL(None, use_errno=True)
    errors = []

    def run():
        try:
            libc.setfsgid(owner.st_gid)
            libc.setfsuid(owner.st_uid)
            prctl.cap_effective.mknod = True  # a non-zero fsuid drops it; bring it back
            fn(*args)
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def swap_after_lstat(monkeypatch, target: bytes, swap):
    """Make the scanner's lstat of `target` return what was there, then run swap(dir_fd,
    name) before the scanner opens it: the race of FS-TOCTOU-01, made deterministic."""
    real_lstat = scan._lstat
    done = []

    def racing_lstat(name, dir_fd):
        st = real_lstat(name, dir_fd)
        if name == target and not done:
            done.append(name)
            as_owner(dir_fd, swap, dir_fd, name)
        return st

    monkeypatch.setattr(scan, "_lstat", racing_lstat)
    return done


# --------------------------------------------------------------------------- FS-FIFO-01


def test_FS_FIFO_01_fifo_at_answer_path_is_rejected_without_ever_being_opened(no_leaks, dest):
    with planted("mkfifo answer.txt log.txt && echo partial > notes.txt") as sb:
        result = scan_within(10, sb.workspace_fd, dest)
        assert result.complete
        for name in ("answer.txt", "log.txt"):
            v = only(result, name)
            assert (v.kind, v.rule, v.detail) == ("fifo", RULE_TYPES, "FIFO not allowed")
        assert checked(result, dest) == {b"notes.txt": ("file", 0o644, b"partial\n")}

        # Control: the FIFO is still there and a plain open really blocks on it, so the
        # 10 s bound above is what stands between a naive scanner and a hang.
        opened = []
        reader = threading.Thread(target=lambda: opened.append(
            os.open(b"answer.txt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=sb.workspace_fd)),
            daemon=True)
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not opened
        os.close(os.open(b"answer.txt", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=sb.workspace_fd))  # release it: a writer came and went
        reader.join(5)
        os.close(opened[0])


# --------------------------------------------------------------------------- FS-SPARSE-01


def test_FS_SPARSE_01_terabyte_file_fails_inside_and_a_big_sparse_file_is_rejected_by_size(
        no_leaks, dest):
    with Sandbox(SandboxSpec(disk=1 * GiB)) as sb:
        r = sb.exec("truncate -s 1T model.bin")  # RLIMIT_FSIZE is the workspace size
        assert r.exit_code != 0 and b"File too large" in r.stderr
        r = sb.exec(py("import os\nfd = os.open('/workspace/x', os.O_WRONLY | os.O_CREAT)\n"
                       "try:\n    os.pwrite(fd, b'1', 2**42)\nexcept OSError as e:\n"
                       "    print(e.errno)"))
        assert r.stdout == b"27\n"  # EFBIG
        assert sb.exec("rm x && truncate -s 512M model.bin && echo ok > small.txt").exit_code == 0
        sb.kill_all()
        result = scan_within(10, sb.workspace_fd, dest)
    v = only(result, "model.bin")
    assert v.kind == "file-too-large"
    assert v.rule == "D4 budget: max_file_size=67108864"
    assert v.detail == "file too large: 512.0 MiB > 64.0 MiB"
    assert result.complete and result.seconds < 5  # judged on st_size: nothing was read
    assert checked(result, dest) == {b"small.txt": ("file", 0o644, b"ok\n")}


def test_FS_SPARSE_01_sparse_file_under_the_size_cap_is_rejected_as_sparse(no_leaks, dest):
    plant = py("""
import os
os.chdir('/workspace')
os.truncate(os.open('holes.bin', os.O_WRONLY | os.O_CREAT), 512 * 2**20)  # 0 blocks
with open('mostly-hole.bin', 'wb') as f:  # 1 MiB, one page allocated
    f.seek(2**20 - 1); f.write(b'x')
with open('dense.bin', 'wb') as f:
    f.write(bytes(range(256)) * 4096)
with open('small-hole.bin', 'wb') as f:  # under 64 KiB: never called sparse
    f.seek(32 * 1024 - 1); f.write(b'y')
""")
    limits = ScanLimits(max_file_size=1 * GiB, max_total_size=1 * GiB)
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, limits)
    assert violations(result) == {"holes.bin": {"sparse"}, "mostly-hole.bin": {"sparse"}}
    v = only(result, "holes.bin")
    assert v.rule == "D4 budget: sparse_ratio=0.5"
    assert v.detail == "0 B allocated for a size of 512.0 MiB"
    tree = checked(result, dest)
    assert tree == {b"dense.bin": ("file", 0o644, bytes(range(256)) * 4096),
                    b"small-hole.bin": ("file", 0o644, bytes(32 * 1024 - 1) + b"y")}


# --------------------------------------------------------------------------- FS-SYMLINK-*


def test_FS_SYMLINK_01_links_to_a_host_secret_or_the_grader_answer_are_rejected(
        no_leaks, dest, host_secret):
    secret_path, secret = host_secret
    plant = (f"ln -s {secret_path} answer.txt && "
             "ln -s /grader/expected/output.txt output.txt && "
             f"ln -s ../../../../..{secret_path} key && "
             f"ln -s {os.path.dirname(secret_path)} secrets && "
             "ln -s / rootlink && echo mine > real.txt && ln -s real.txt alias.txt")
    with planted(plant) as sb:
        result = scan_within(10, sb.workspace_fd, dest)
    links = ("answer.txt", "output.txt", "key", "secrets", "rootlink", "alias.txt")
    assert violations(result) == {name: {"symlink"} for name in links}
    for name in links:
        assert only(result, name).rule == RULE_TYPES
    assert only(result, "answer.txt").detail == "symlink not allowed"
    tree = checked(result, dest)
    assert tree == {b"real.txt": ("file", 0o644, b"mine\n")}  # not even the in-tree link
    assert result.dirs == ()  # the walk never went through rootlink or secrets


def test_FS_SYMLINK_02_links_to_dev_and_proc_are_rejected_at_lstat(no_leaks, dest, monkeypatch):
    plant = ("ln -s /dev/zero result.bin && ln -s /dev/urandom preds.npy && "
             "ln -s /proc/self/environ log.txt && ln -s /proc/self/fd/0 input.txt")
    with planted(plant) as sb, recorded_opens(monkeypatch, sb.workspace_fd) as opens:
        result = scan_within(10, sb.workspace_fd, dest)
    assert violations(result) == {name: {"symlink"} for name in
                                  ("result.bin", "preds.npy", "log.txt", "input.txt")}
    opened = {name for name, _flags, on_workspace in opens if on_workspace}
    assert opened == {"."}  # the root only: no link was opened, so nothing was read
    assert checked(result, dest) == {}


# --------------------------------------------------------------------------- FS-TOCTOU-01


def _to_symlink(target: str):
    def swap(dir_fd, name):
        os.unlink(name, dir_fd=dir_fd)
        os.symlink(target, name, dir_fd=dir_fd)
    return swap


def _to_fifo(dir_fd, name):
    os.unlink(name, dir_fd=dir_fd)
    os.mkfifo(name, dir_fd=dir_fd)


def _to_other_file(content: bytes):
    def swap(dir_fd, name):
        fd = os.open(b"swap.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
        os.write(fd, content)
        os.close(fd)
        os.rename(b"swap.tmp", name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return swap


@pytest.mark.parametrize("swap_to", ["symlink", "fifo", "other-file"])
def test_FS_TOCTOU_01_file_swapped_between_lstat_and_open_is_rejected(
        no_leaks, dest, host_secret, monkeypatch, swap_to):
    secret_path, secret = host_secret
    swap = {"symlink": _to_symlink(secret_path), "fifo": _to_fifo,
            "other-file": _to_other_file(secret)}[swap_to]
    with planted("echo honest > a.txt && echo kept > b.txt") as sb:
        done = swap_after_lstat(monkeypatch, b"a.txt", swap)
        result = scan_within(10, sb.workspace_fd, dest)  # a FIFO opened blocking would hang
    assert done
    v = only(result, "a.txt")
    assert v.kind == "changed-during-scan"
    assert v.rule == "D2 fd walk: lstat, the opened fd and the copy must see one unchanged inode"
    tree = checked(result, dest)
    assert tree == {b"b.txt": ("file", 0o644, b"kept\n")}
    assert all(secret not in content for _t, _m, content in tree.values())


def test_FS_TOCTOU_01_directory_swapped_for_a_link_to_a_host_dir_is_not_entered(
        no_leaks, dest, host_secret, monkeypatch):
    secret_path, _ = host_secret
    with planted("mkdir out && echo x > out/x.txt") as sb:
        def swap(dir_fd, name):
            os.unlink(b"out/x.txt", dir_fd=dir_fd)
            os.rmdir(name, dir_fd=dir_fd)
            os.symlink(os.path.dirname(secret_path), name, dir_fd=dir_fd)
        done = swap_after_lstat(monkeypatch, b"out", swap)
        result = scan_and_copy(sb.workspace_fd, dest)
    assert done
    assert only(result, "out").kind == "changed-during-scan"
    assert checked(result, dest) == {}


def test_FS_TOCTOU_01_file_that_grows_while_copied_is_cut_at_the_checked_size_and_rejected(
        no_leaks, dest, monkeypatch):
    real_copy = scan.Walk._copy_range
    copied = []

    def growing_copy(self, src, out, size, raw):
        with open(f"/proc/self/fd/{src}", "ab") as writer:  # the same inode, a second fd
            writer.write(b"MORE" * 1000)
        copied.append(real_copy(self, src, out, size, raw))
        return copied[-1]

    with planted("printf 0123456789 > grows.txt") as sb:
        monkeypatch.setattr(scan.Walk, "_copy_range", growing_copy)
        result = scan_and_copy(sb.workspace_fd, dest)
    assert copied == [10]  # never past the size fstat showed
    v = only(result, "grows.txt")
    assert v.kind == "changed-during-scan" and "size 10 at the check, 4010 after" in v.detail
    assert checked(result, dest) == {}  # no partial copy left


def test_FS_TOCTOU_01_live_swapper_never_gets_a_link_target_into_the_copy(
        no_leaks, host_secret):
    """No kill first: an agent process swaps a.txt between a file and a link to a host
    secret as fast as it can while the host scans again and again."""
    secret_path, secret = host_secret
    swapper = f"""
import os
os.chdir('/workspace')
while True:
    os.symlink({secret_path!r}, 'a.lnk')
    os.replace('a.lnk', 'a.txt')
    with open('a.tmp', 'w') as f:
        f.write('ok\\n')
    os.replace('a.tmp', 'a.txt')
"""
    outcomes = Counter()
    parent = tempfile.mkdtemp(prefix="karotte-scan-test-", dir=COPY_ROOT)
    try:
        with Sandbox() as sb:
            r = sb.exec(["/bin/sh", "-c", "cat > /tmp/swap.py && "
                         "(python3 -I /tmp/swap.py >/dev/null 2>&1 &)"], stdin=swapper)
            assert r.exit_code == 0
            time.sleep(0.2)
            end = time.monotonic() + 3
            n = 0
            while time.monotonic() < end:
                dest = os.path.join(parent, str(n))
                os.mkdir(dest)
                result = scan_and_copy(sb.workspace_fd, dest)
                tree = checked(result, dest)
                assert all(secret not in content for _t, _m, content in tree.values())
                if b"a.txt" in tree:
                    assert tree[b"a.txt"][2] == b"ok\n"
                    outcomes["copied"] += 1
                outcomes.update(v.kind for v in result.violations if v.path == "a.txt")
                shutil.rmtree(dest)
                n += 1
            sb.kill_all()
    finally:
        shutil.rmtree(parent)
    print(f"FS-TOCTOU-01 live race, a.txt over {n} scans: {dict(outcomes)}")
    assert outcomes["symlink"] + outcomes["changed-during-scan"] > 0, outcomes  # the race was live
    assert set(outcomes) <= {"copied", "symlink", "changed-during-scan"}, outcomes


# --------------------------------------------------------------------------- FS-HARDLINK-01


def test_FS_HARDLINK_01_links_across_the_boundary_fail_and_links_inside_are_rejected(
        no_leaks, dest):
    with Sandbox() as sb:
        r = sb.exec("echo outside > /tmp/outside && ln /tmp/outside result.bin")
        assert r.exit_code != 0 and b"Invalid cross-device link" in r.stderr  # EXDEV
        assert sb.exec("echo data > result.bin && ln result.bin alias.bin && "
                       "echo one > single.txt").exit_code == 0
        sb.kill_all()
        result = scan_and_copy(sb.workspace_fd, dest)
    assert violations(result) == {"alias.bin": {"hardlink"}, "result.bin": {"hardlink"}}
    v = only(result, "result.bin")
    assert v.rule == "D3 hard links: a regular file must have st_nlink == 1"
    assert v.detail == "hard link count 2"
    assert checked(result, dest) == {b"single.txt": ("file", 0o644, b"one\n")}


# --------------------------------------------------------------------------- FS-DEEP-01

DEEP = py("""
import os
os.chdir('/workspace')
for _ in range(2500):  # 5000 bytes of path: deeper than PATH_MAX
    os.mkdir('d'); os.chdir('d')
open('leaf', 'w').write('deep')
""")


def test_FS_DEEP_01_deep_nesting_stops_at_the_depth_budget(no_leaks, dest):
    with planted(DEEP) as sb:
        result = scan_within(10, sb.workspace_fd, dest)
    assert not result.complete
    v = only(result, "/".join(["d"] * 32))
    assert v.kind == "too-deep" and v.rule == "D4 budget: max_depth=32"
    assert v.detail == "entries below depth 32 were not read"
    tree = checked(result, dest)
    assert len(tree) == 32 and set(tree.values()) == {("dir", 0o755, None)}
    assert result.seconds < 2


def test_FS_DEEP_01_the_walk_is_iterative_up_to_the_largest_depth_budget(no_leaks, dest):
    with planted(DEEP) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, ScanLimits(max_depth=256))
    assert [v.path.count("/") + 1 for v in result.violations] == [256]
    assert len(checked(result, dest)) == 256
    with pytest.raises(ValueError, match="max_depth is at most 256"):
        ScanLimits(max_depth=257)


# --------------------------------------------------------------------------- FS-MODE-01


def test_FS_MODE_01_special_bits_are_rejected_and_modes_of_the_copy_normalised(no_leaks, dest):
    plant = """
set -e
cp /bin/sh helper && chmod 6755 helper
printf '#!/bin/sh\\n' > run.sh && chmod 4777 run.sh
echo g > g.txt && chmod 2644 g.txt
echo t > t.txt && chmod 1644 t.txt
mkdir stickydir && echo in > stickydir/in.txt && chmod 1777 stickydir
mkdir sgid && chmod 2775 sgid && echo k > sgid/k.txt
echo tool > tool.sh && chmod 700 tool.sh
echo private > private.txt && chmod 400 private.txt
echo locked > locked.txt && chmod 000 locked.txt
echo x > xonly && chmod 111 xonly
echo w > open.txt && chmod 666 open.txt
echo attr > attr.txt && python3 -c "import os; os.setxattr('attr.txt', 'user.k', b'v')"
chmod +t .
"""
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest)
    assert violations(result) == {
        "helper": {"setuid", "setgid"}, "run.sh": {"setuid"}, "g.txt": {"setgid"},
        "t.txt": {"sticky"}, "stickydir": {"sticky"}, "sgid": {"setgid"}}
    assert only(result, "run.sh").rule == "D2 modes: no setuid, setgid or sticky bits"
    assert only(result, "run.sh").detail == "mode 4777"
    assert only(result, "stickydir").detail == "directory mode 1777"
    tree = checked(result, dest)  # also: owner is the host, no xattr (user.k is gone)
    assert {p: m for p, (_t, m, _c) in tree.items()} == {
        b"tool.sh": 0o755, b"private.txt": 0o644,
        b"locked.txt": 0o644, b"xonly": 0o755, b"open.txt": 0o644, b"attr.txt": 0o644}
    assert tree[b"locked.txt"][2] == b"locked\n"
    assert result.complete


# --------------------------------------------------------------------------- FS-SPECIAL-01


def test_FS_SPECIAL_01_sockets_and_devices_are_rejected_without_being_opened(
        no_leaks, dest, monkeypatch):
    with Sandbox() as sb:
        r = sb.exec(py("import socket\n"
                       "socket.socket(socket.AF_UNIX).bind('/workspace/answer.txt')"))
        assert r.exit_code == 0, r.stderr
        r = sb.exec("mknod dev c 1 3")
        assert r.exit_code != 0 and b"Operation not permitted" in r.stderr  # no CAP_MKNOD
        assert sb.exec("mkfifo pipe && ln -s /etc/passwd link && mkdir sub && "
                       "echo ok > sub/ok.txt").exit_code == 0
        sb.kill_all()
        # Device nodes as they would be on a filesystem where the agent could make them.
        def make_devices(fd):
            os.mknod(b"null", stat.S_IFCHR | 0o666, os.makedev(1, 3), dir_fd=fd)
            os.mknod(b"disk", stat.S_IFBLK | 0o660, os.makedev(7, 0), dir_fd=fd)
        as_owner(sb.workspace_fd, make_devices, sb.workspace_fd)
        with recorded_opens(monkeypatch, sb.workspace_fd) as opens:
            result = scan_within(10, sb.workspace_fd, dest)
    assert violations(result) == {"answer.txt": {"socket"}, "null": {"char-device"},
                                  "disk": {"block-device"}, "pipe": {"fifo"},
                                  "link": {"symlink"}}
    assert {v.rule for v in result.violations} == {RULE_TYPES}
    agent_opens = [(os.fsencode(name), flags) for name, flags, on_workspace in opens
                   if on_workspace]
    assert sorted(name for name, _ in agent_opens) == [b".", b"ok.txt", b"sub"]
    must = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    assert all(flags & must == must and flags & os.O_ACCMODE == os.O_RDONLY
               for _name, flags in agent_opens)
    copy_opens = [flags for _name, flags, on_workspace in opens if not on_workspace]
    assert copy_opens and all(flags & os.O_NOFOLLOW for flags in copy_opens)
    assert checked(result, dest) == {b"sub": ("dir", 0o755, None),
                                     b"sub/ok.txt": ("file", 0o644, b"ok\n")}


# --------------------------------------------------------------------------- timestamps


@pytest.mark.parametrize("limits", [ScanLimits(), ScanLimits(max_total_size=3000)],
                         ids=["complete", "cut-by-a-budget"])
def test_every_file_and_directory_of_the_copy_has_atime_and_mtime_copy_time(
        no_leaks, dest, limits):
    # PERF-HOLLOW-01, defence in depth: nothing in the copy says when custody made it,
    # so a program cannot tell from its files' age whether grading has only just begun.
    # The agent's own times (past, future, atime apart from mtime) are not kept, and a
    # budget that stops the walk deep in the tree (max_total_size at a/b/c/zbig, with
    # ".", a, b and c still open) leaves the same times as a complete copy.
    plant = """
set -e
mkdir -p a/b/c d
echo one > a/one && echo two > a/b/c/two && echo three > d/three
head -c 4000 /dev/zero > a/b/c/zbig
ln -s one a/link && mkfifo d/fifo
touch -d 2031-05-06 a/one a/b && touch -d 1990-01-01 d a/b/c/two && touch -a -d 2040-01-01 d/three
"""
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, limits)
    times = file_times(dest)
    assert {tuple(t) for t in times.values()} == {(COPY_TIME_NS, COPY_TIME_NS)}
    complete = limits == ScanLimits()
    assert result.complete == complete
    expected = {".", "a", "a/b", "a/b/c", "a/b/c/two"}
    if complete:
        expected |= {"a/b/c/zbig", "a/one", "d", "d/three"}
    else:
        assert result.violations[-1].kind == "total-too-large"
    assert set(times) == expected
    checked(result, dest)


# --------------------------------------------------------------------------- names


WEIRD = {
    b"new\nline": "new\\x0aline",
    b"\x1b[31mred": "\\x1b[31mred",
    b"bad\xff\xfeutf8": "bad\\xff\\xfeutf8",
    b"back\\slash": "back\\x5cslash",
    b"tab\there": "tab\\x09here",
    "café".encode(): "café",
    "\u202eevil".encode(): "\\xe2\\x80\\xaeevil",  # a bidi override is not printable
    b" spaced ": " spaced ",
}


def test_names_are_copied_byte_exact_and_escaped_in_every_reported_path(no_leaks, dest):
    plant = py(f"""
import os
os.chdir(b'/workspace')
for i, name in enumerate({list(WEIRD)!r}):
    with open(name, 'wb') as f:
        f.write(b'content %d' % i)
os.mkdir(b'dir\\x1b]0;title\\x07')
os.mkfifo(b'dir\\x1b]0;title\\x07/fifo\\n\\x9b')
""")
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest)
    tree = checked(result, dest)
    for i, name in enumerate(WEIRD):
        assert tree[name] == ("file", 0o644, b"content %d" % i)
    assert {f.raw: f.path for f in result.files} == WEIRD
    assert result.dirs == ("dir\\x1b]0;title\\x07",)
    assert only(result, "dir\\x1b]0;title\\x07/fifo\\x0a\\x9b").kind == "fifo"


def test_escape_is_printable_and_one_to_one():
    samples = [b"plain/path.txt", b"a\\x41", b"a\x41", b"\x00\x7f\x80", "ü/日本".encode(),
               b"\xed\xa0\x80", b"\xc3\x28", *WEIRD]
    escaped = [escape(s) for s in samples]
    assert all(e.isprintable() for e in escaped)
    assert len(set(escaped)) == len(samples)
    assert escape(b"a\\x41") == "a\\x5cx41" and escape(b"\xed\xa0\x80") == "\\xed\\xa0\\x80"


def test_name_length_budget_rejects_long_names_and_their_subtrees(no_leaks, dest):
    long = "n" * 255
    plant = py(f"""
import os, errno
os.chdir('/workspace')
try:
    open('{'n' * 256}', 'w')
except OSError as e:
    assert e.errno == errno.ENAMETOOLONG
open('{long}', 'w').write('kernel max')
open('{'m' * 100}', 'w').write('fits')
os.mkdir('{'D' * 101}'); open('{'D' * 101}/inner', 'w').write('hidden')
""")
    with planted(plant) as sb:
        default = scan_and_copy(sb.workspace_fd, dest)
        assert default.violations == () and len(default.files) == 3
        shutil.rmtree(dest)
        os.mkdir(dest)
        result = scan_and_copy(sb.workspace_fd, dest, ScanLimits(max_name_length=100))
    assert violations(result) == {long: {"name-too-long"}, "D" * 101: {"name-too-long"}}
    v = only(result, long)
    assert v.rule == "D4 budget: max_name_length=100" and v.detail == "name of 255 bytes"
    assert checked(result, dest) == {b"m" * 100: ("file", 0o644, b"fits")}
    assert result.complete


def test_names_that_are_not_one_component_are_rejected_and_nothing_lands_outside(
        no_leaks, monkeypatch):
    """The kernel never lists such names; if a listing ever did, the copy stays inside."""
    parent = tempfile.mkdtemp(prefix="karotte-scan-test-", dir=COPY_ROOT)
    dest = os.path.join(parent, "dest")
    os.mkdir(dest)
    real_scandir = os.scandir
    extra = ["..", ".", "../escape", "a/b"]

    class Entry:
        def __init__(self, name):
            self.name = name

    class Listing:
        """The root's real listing followed by names no kernel would return."""

        def __init__(self, inner):
            self.inner = inner
            self.items = itertools.chain(inner, map(Entry, extra))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

    try:
        with planted("echo x > ok.txt") as sb:
            root = os.fstat(sb.workspace_fd)

            def scandir(path="."):
                inner = real_scandir(path)
                if isinstance(path, int):
                    st = os.fstat(path)
                    if (st.st_dev, st.st_ino) == (root.st_dev, root.st_ino):
                        return Listing(inner)
                return inner

            with monkeypatch.context() as m:
                m.setattr(os, "scandir", scandir)
                result = scan_and_copy(sb.workspace_fd, dest)
        assert violations(result) == {name: {"invalid-name"} for name in
                                      ("..", ".", "../escape", "a/b")}
        assert sorted(os.listdir(parent)) == ["dest"]
        assert checked(result, dest) == {b"ok.txt": ("file", 0o644, b"x\n")}
    finally:
        shutil.rmtree(parent)


# --------------------------------------------------------------------------- budgets


@pytest.mark.slow
def test_entry_budget_stops_reading_at_max_entries_of_200k(no_leaks, dest, capsys):
    plant = py("""
import os
os.chdir('/workspace')
open('answer.txt', 'w').write('42')
os.mkdir('many')
for i in range(200_000):
    os.close(os.open(f'many/{i}', os.O_CREAT | os.O_WRONLY))
""")
    with planted(plant, SandboxSpec(inodes=300_000)) as sb:
        result = scan_within(30, sb.workspace_fd, dest)
    assert not result.complete
    v = only(result, "many")
    assert v.kind == "too-many-entries" and v.rule == "D4 budget: max_entries=100000"
    assert len(result.files) == 100_000 - 1  # the directory many is an entry too
    assert result.files[0].raw == b"answer.txt"
    with capsys.disabled():
        print(f"\n200k-entry workspace: stopped at 100,000 entries in {result.seconds:.2f} s")
    assert result.seconds < 30


def test_ten_thousand_files_are_scanned_and_copied_quickly(no_leaks, dest, capsys):
    plant = py("""
import os
os.chdir('/workspace')
for d in range(100):
    os.mkdir(f'd{d:02}')
    for i in range(100):
        with open(f'd{d:02}/f{i:02}.txt', 'w') as f:
            f.write(f'{d}/{i}\\n' * 10)
""")
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest)
    with capsys.disabled():
        print(f"\nscan and copy of 10,000 files: {result.seconds:.3f} s (goal: < 1 s)")
    assert result.complete and result.violations == ()
    assert len(result.files) == 10_000 and len(result.dirs) == 100
    with open(os.path.join(dest, "d42", "f07.txt"), "rb") as f:
        assert f.read() == b"42/7\n" * 10
    assert result.seconds < 10


def test_file_size_budget_is_inclusive(no_leaks, dest):
    with planted(py("open('/workspace/a', 'wb').write(b'a' * 1000);"
                    "open('/workspace/b', 'wb').write(b'b' * 1001)")) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, ScanLimits(max_file_size=1000))
    assert violations(result) == {"b": {"file-too-large"}}
    assert only(result, "b").detail == "file too large: 1001 B > 1000 B"
    assert checked(result, dest) == {b"a": ("file", 0o644, b"a" * 1000)}


def test_total_size_budget_stops_the_walk_at_the_first_file_that_does_not_fit(no_leaks, dest):
    plant = py("import os\nfor n in 'abc':\n"
               "    open('/workspace/' + n, 'wb').write(os.urandom(2**20))")
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, ScanLimits(max_total_size=2 * MiB + 1))
    assert not result.complete
    v = only(result, "c")
    assert v.kind == "total-too-large" and v.rule == "D4 budget: max_total_size=2097153"
    assert v.detail == "2.0 MiB copied, this file adds 1.0 MiB"
    assert set(checked(result, dest)) == {b"a", b"b"}


def test_path_bytes_budget_bounds_the_result(no_leaks, dest):
    plant = py("import os\nfor i in range(50):\n    open('/workspace/%03d' % i + 'x' * 60, 'w')")
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, ScanLimits(max_path_bytes=1000))
    assert not result.complete
    assert result.violations[-1].kind == "paths-too-long"
    assert result.violations[-1].rule == "D4 budget: max_path_bytes=1000"
    assert len(result.files) == 7  # 7 * 2 * 63 <= 1000 < 8 * 2 * 63
    checked(result, dest)


def test_time_budget_stops_the_walk_and_returns(no_leaks, dest):
    with planted(py("import os\nfor i in range(100):\n    open('/workspace/%d' % i, 'w')")) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, ScanLimits(max_seconds=1e-6))
    assert not result.complete
    v = result.violations[-1]
    assert v.kind == "scan-timeout" and v.rule == "D4 budget: max_seconds=1e-06"
    assert len(result.files) < 100
    checked(result, dest)


def test_an_entry_the_host_cannot_stat_is_unreadable(no_leaks, dest, monkeypatch):
    real_lstat = scan._lstat

    def failing(name, dir_fd):
        if name == b"bad.txt":
            raise PermissionError(13, "Permission denied")
        return real_lstat(name, dir_fd)

    with planted("echo a > bad.txt && echo b > good.txt") as sb:
        monkeypatch.setattr(scan, "_lstat", failing)
        result = scan_and_copy(sb.workspace_fd, dest)
    v = only(result, "bad.txt")
    assert (v.kind, v.rule, v.detail) == (
        "unreadable", "D2 fd walk: the host must be able to read the entry",
        "lstat failed: Permission denied")
    assert checked(result, dest) == {b"good.txt": ("file", 0o644, b"b\n")}


# --------------------------------------------------------------------------- REC-BOUND-01


def fifos(count: int, where: str = ".", prefix: str = "f") -> str:
    """Agent code that makes `count` FIFOs named prefix00000... in /workspace/where."""
    return (f"import os\nos.chdir('/workspace')\nos.makedirs({where!r}, exist_ok=True)\n"
            f"for i in range({count}): os.mkfifo(f'{where}/{prefix}{{i:05d}}')")


def test_REC_BOUND_01_the_scan_holds_the_first_100_violations_and_counts_the_rest(
        no_leaks, dest):
    with planted(py(fifos(5000))) as sb:
        result = scan_and_copy(sb.workspace_fd, dest)
    assert result.complete
    assert [v.path for v in result.violations] == [f"f{i:05d}" for i in range(100)]
    assert {v.kind for v in result.violations} == {"fifo"}
    assert result.violations_dropped == 4900
    checked(result, dest)


def test_REC_BOUND_01_a_violation_at_a_deliverable_is_held_after_any_number_of_others(
        no_leaks, dest):
    # The FIFOs sort before the deliverable: walked first, they fill the 100 places.
    plant = py(fifos(3000, "aaa") + "\nos.makedirs('out')\nos.symlink('/etc/passwd', 'out/answer.txt')")
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, deliverables=["out/answer.txt"])
    assert len(result.violations) == 101 and result.violations_dropped == 2900
    assert result.violations[-1].path == "out/answer.txt"
    assert result.violations[-1].kind == "symlink"


def test_REC_BOUND_01_violations_inside_a_deliverable_directory_keep_places_of_their_own(
        no_leaks, dest):
    plant = py(fifos(3000, "aaa") + "\n" + fifos(500, "src", "g").split("\n", 1)[1])
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest, deliverables=["src"])
    inside = [v.path for v in result.violations if v.path.startswith("src/")]
    assert inside == [f"src/g{i:05d}" for i in range(100)]
    assert len(result.violations) == 200 and result.violations_dropped == 3300


def test_REC_BOUND_01_a_reported_path_is_cut_to_its_json_limit(no_leaks, dest):
    # 31 levels of names of 100 two-byte characters: 6 KiB of path, 19 KiB as JSON.
    plant = py("import os\nos.chdir('/workspace')\nfor _ in range(31):\n"
               "    os.mkdir('\u00e9' * 100)\n    os.chdir('\u00e9' * 100)\nos.mkfifo('pipe')")
    with planted(plant) as sb:
        result = scan_and_copy(sb.workspace_fd, dest)
    (v,) = result.violations
    assert v.kind == "fifo"
    assert len(json.dumps(v.path)) <= 1024
    assert v.path.startswith("\u00e9" * 100 + "/" + "\u00e9" * 50)
    assert v.path.endswith(f"[karotte: cut, {31 * 101 + 4} characters in all]")


def test_REC_BOUND_01_many_rejected_entries_are_a_budget_violation_in_bounded_memory(
        no_leaks, dest):
    # 60,000 FIFOs (the sandbox's inodes allow 65,536) against a budget of 20,000 entries:
    # the walk stops at the budget, and holds 100 violations whatever the count.
    with planted(py(fifos(60_000))) as sb:
        tracemalloc.start()
        try:
            result = scan_within(30, sb.workspace_fd, dest, ScanLimits(max_entries=20_000))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert not result.complete
    assert (result.violations[0].path, result.violations[0].kind) == (".", "too-many-entries")
    assert len(result.violations) == 100 and result.violations_dropped == 20_000 - 99
    # The names listed (20,000 of 6 bytes) are what the walk holds; 20,000 Violation
    # records would take about 5 MiB.
    assert peak < 4 * MiB, f"the scan allocated {peak / MiB:.1f} MiB at its peak"


# --------------------------------------------------------------------------- the API


def test_dest_dir_must_be_a_fresh_empty_host_directory(no_leaks, dest):
    with planted("mkdir inside && echo x > f") as sb:
        fd = sb.workspace_fd
        with pytest.raises(ScanError, match="was the sandbox closed"):
            scan_and_copy(None, dest)
        with pytest.raises(ScanError, match="does not exist"):
            scan_and_copy(fd, os.path.join(dest, "missing"))
        os.mkdir(os.path.join(dest, "real"))
        os.symlink("real", os.path.join(dest, "link"))
        with pytest.raises(ScanError, match="is a symlink"):
            scan_and_copy(fd, os.path.join(dest, "link"))
        with pytest.raises(ScanError, match="not empty"):
            scan_and_copy(fd, dest)
        with pytest.raises(ScanError, match="workspace's own filesystem"):
            scan_and_copy(fd, f"/proc/self/fd/{fd}/inside")
        acl = os.path.join(dest, "acl")
        os.mkdir(acl)
        # A default ACL (user::rwx group::r-x other::r-x), as setfacl -d would write it.
        os.setxattr(acl, "system.posix_acl_default", struct.pack(
            "<I" + "HHI" * 3, 2, 0x01, 7, 0xFFFFFFFF, 0x04, 5, 0xFFFFFFFF, 0x20, 5, 0xFFFFFFFF))
        with pytest.raises(ScanError, match="default ACL"):
            scan_and_copy(fd, acl)
        plain = os.path.join(dest, "plain")
        with open(plain, "w"):
            pass
        file_fd = os.open(plain, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with pytest.raises(ScanError, match="not a directory"):
                scan_and_copy(file_fd, os.path.join(dest, "real"))
        finally:
            os.close(file_fd)
        assert os.listdir(os.path.join(dest, "real")) == []  # nothing written on refusal


def test_scan_limits_reject_nonsense():
    for bad in ({"max_entries": 0}, {"max_file_size": -1}, {"max_depth": 1.5},
                {"max_seconds": float("inf")}, {"max_seconds": 0}, {"sparse_ratio": 1.5},
                {"max_name_length": True}):
        with pytest.raises(ValueError, match="ScanLimits"):
            ScanLimits(**bad)


def test_a_violation_of_a_kind_outside_the_closed_set_is_refused_where_it_is_made():
    # Trainers count violations by kind: a new kind must be added to VIOLATION_KINDS (and
    # to docs/scan.md), not appear unannounced.
    with pytest.raises(ValueError, match="VIOLATION_KINDS"):
        Violation("a", "symlinc", scan.RULE_TYPES)
    assert all(Violation("a", kind, scan.RULE_TYPES).kind == kind for kind in VIOLATION_KINDS)
