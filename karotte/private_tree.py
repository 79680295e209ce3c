"""A private copy of an image's tree for one sandbox: a userland whose inodes no other run
or sandbox shares.

The page cache, futex keys and inotify marks of a file are the kernel's per inode, and
every sandbox on one image reads the same inodes: a run can leave marks in them that a
later run reads (LINK-CACHE-02: a check run tells the timed run of the same program its
answer) or signal through them to a sandbox alive beside it (LINK-SIBLING-02: a graded
program holding the hidden data, to a sibling episode's agent). A sandbox on a copy made
for it alone has nothing of the userland in common with any other: what it marks is
gone when the copy is removed.

The copy is a reflink (FICLONE: new inodes sharing the data blocks, no data copied) where
the tree and $KAROTTE_RUNTIME_DIR are on one xfs or btrfs; else a full copy into the
runtime directory (by default /dev/shm, a tmpfs, whose pages are charged to the cgroup
the copy is made in: under a grading, one of the grading's own, limited to the run's
memory, so the grading's limits hold the copy). A reflink shares whatever caches the
blocks below the filesystem (a loop device's backing file, a hypervisor's page cache):
docs/side-channels.md measures that channel. `cp -a` makes the copy: owners (a root
caller's store keeps the image's ids; the sandbox idmaps the copy as it does the tree),
modes, hard links, symlinks as links. The directory is a hostdirs one, named after this
process: removed when the block ends (errors included), at exit, and by
`karotte-sandbox gc` after a SIGKILL; the cp runs in a cgroup of its own, which the same
gc empties. docs/side-channels.md says what the copy closes, what it costs and what stays
open.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from . import cgroups, hostdirs, imageref, imageroot
from .errors import KarotteError
from .spec import GiB, SandboxSpec

FICLONE = 0x40049409  # <linux/fs.h>: _IOW(0x94, 9, int)
COPY_MEMORY = 8 * GiB  # the copy's cgroup limit where the caller gives none
COPY_PIDS = 8  # sh, then cp in its place
CP = "/bin/cp"
# Why the host's userland is not copied: it is the whole of the host's /usr (here 5.6 GiB
# in 117,672 files), which takes a minute and gigabytes of memory per run, and it is never
# on the runtime directory's filesystem, so no reflink can make it cheap.
HOST_REFUSED = (
    "a private userland needs an image: the host's userland is the host's whole /usr, "
    "gigabytes in a hundred thousand files, too large to copy for each run. Declare the "
    "environment's image (Environment.image = 'debian:bookworm+python3', say), on which "
    "the agent and its runs have a userland of their own that is copied in about a second, "
    "or run without private_userland")


class PrivateTreeError(KarotteError):
    """The private copy could not be made: the image names none, or the copy failed."""


@dataclass(frozen=True)
class PrivateTree:
    """A copy of an image's tree made for one sandbox, and what it cost."""

    image: str  # "dir:/.../rootfs": the copy, for SandboxSpec(image=...)
    source: str  # the tree it copies
    env: Mapping[str, str]  # the image config's Env (a dir: tree has none)
    workdir: str | None  # the image config's WorkingDir
    method: str  # "reflink" (FICLONE: new inodes, shared blocks) or "copy"
    seconds: float  # to make it
    charged: int | None  # memory the copy's cgroup was charged (its peak), if known


@dataclass(frozen=True)
class Userland:
    """The image a nested run gets: its own image as is, or a private copy of it."""

    image: str
    env: Mapping[str, str] = field(default_factory=dict)  # Env a dir: copy lost: pass it on
    copy: PrivateTree | None = None


@contextlib.contextmanager
def userland(image: str, private: object, parent: cgroups.Cgroup | None, memory: int,
             timeout: float) -> Iterator[Userland]:
    """What ctx.run's host side runs a program on: image itself, or (private=True) a
    private copy of it for this run alone, charged to a cgroup under parent limited to the
    run's memory, and removed after the run."""
    if private is False:
        yield Userland(image)
        return
    if private is not True:
        raise TypeError(f"private_userland must be True or False, got {private!r}")
    with private_tree(image, parent=parent, memory=memory, timeout=timeout) as copy:
        yield Userland(copy.image, copy.env, copy)


@contextlib.contextmanager
def private_tree(image: str, *, parent: cgroups.Cgroup | None = None,
                 memory: int = COPY_MEMORY, timeout: float = 300.0) -> Iterator[PrivateTree]:
    """A private copy of image's tree for the block: `SandboxSpec(image=copy.image)`.

    image: a reference of docs/images.md other than "host" (PrivateTreeError, saying why:
    HOST_REFUSED). The store's image is leased while it is copied. The copy is made in a
    cgroup of its own under parent (default: the caller's), limited to `memory` bytes: a
    copy into a tmpfs is charged there. timeout: seconds the copy may take. The copy is
    removed when the block ends, whatever ends it."""
    if imageref.parse(image).kind == "host":
        raise PrivateTreeError(HOST_REFUSED)
    limits = cgroups.CgroupLimits(memory=memory, pids=COPY_PIDS, cpus=1.0)
    with cgroups.create(cgroups.leaf_name("copy"), limits, parent) as cgroup:
        top = hostdirs.new_dir("tree", 0o700)  # the copy keeps the image's ids: no host user enters
        try:
            yield _copy(image, top, cgroup, timeout)
        finally:
            _remove(top)  # before the cgroup goes: the pages it frees are charged there


def _copy(image: str, top: str, cgroup: cgroups.Cgroup, timeout: float) -> PrivateTree:
    start = time.monotonic()
    with contextlib.ExitStack() as leases:  # the store keeps the tree until it is copied
        root = imageroot.resolve_root(SandboxSpec(image=image), leases)  # not None: not "host"
        method = "reflink" if can_reflink(root.tree, top) else "copy"
        dest = os.path.join(top, "rootfs")
        _run_in(cgroup, [CP, "-a", "--no-target-directory",
                         f"--reflink={'always' if method == 'reflink' else 'never'}",
                         root.tree, dest], timeout, image)
    return PrivateTree(f"dir:{dest}", root.tree, dict(root.env), root.workdir, method,
                       time.monotonic() - start, cgroup.memory_peak())


def _run_in(cgroup: cgroups.Cgroup, argv: list[str], timeout: float, image: str) -> None:
    """argv in cgroup (so that it pays for the tmpfs pages it writes): a shell that waits
    for a line on stdin until it has been moved there, then execs argv."""
    proc = subprocess.Popen(["/bin/sh", "-c", 'read -r go && exec "$@"', "sh", *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd="/", start_new_session=True)
    try:
        cgroup.add(proc.pid)
        _, err = proc.communicate(b"go\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        cgroup.kill_all()
        proc.communicate()
        raise PrivateTreeError(f"the private copy of {image} took more than {timeout:.0f} s "
                               f"(the time left to the grading); give the grading more time "
                               f"(grader_limits.timeout) or use a smaller image") from None
    finally:
        if proc.returncode is None:
            cgroup.kill_all()
            proc.wait()
    if proc.returncode == 0:
        return
    if cgroup.oom_kills():
        raise PrivateTreeError(
            f"the private copy of {image} does not fit in the memory it is charged to, the "
            f"run's memory= (a copy into a tmpfs, {hostdirs.runtime_dir()}, is memory): raise "
            f"it by the image's size, or put $KAROTTE_RUNTIME_DIR on the image store's xfs "
            f"or btrfs, where the copy is a reflink and takes next to none")
    tail = err.decode("utf-8", "replace").strip()[-600:]
    raise PrivateTreeError(f"the private copy of {image} failed ({argv[0]} exited "
                           f"{proc.returncode}): {tail}")


def can_reflink(tree: str, directory: str) -> bool:
    """Whether a file of tree can be cloned into directory (FICLONE): one filesystem, and
    one that shares blocks between files (xfs, btrfs)."""
    sample = _a_file(tree)
    if sample is None:
        return False
    probe = os.path.join(directory, ".reflink-probe")
    src = os.open(sample, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.ioctl(dst, FICLONE, src)
            return True
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY,
                             errno.EPERM, errno.EBADF):
                return False
            raise
        finally:
            os.close(dst)
            os.unlink(probe)
    finally:
        os.close(src)


def _a_file(tree: str) -> str | None:
    """A regular file of tree with data, or None."""
    for root, _, files in os.walk(tree):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path) and os.path.isfile(path) and os.path.getsize(path):
                return path
    return None


def _remove(top: str) -> None:
    """rm -rf top. An unprivileged caller's copy of a directory it may not write (an
    image's 0555 directory) is made writable first; links are never followed."""
    try:
        shutil.rmtree(top)
    except FileNotFoundError:
        return
    except PermissionError:
        for root, dirs, _ in os.walk(top):
            for name in dirs:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
        shutil.rmtree(top)
