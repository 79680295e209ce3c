"""The mount plan: what the sandbox's filesystem is made of, in the order init builds it.

Everything is a fresh tmpfs or a read-only bind of the host's userland, described in
rootfs/. Every mount is nosuid and nodev except the single device-node binds under
/dev and the private devpts (nosuid, noexec); nothing of the host is visible that is
not listed here. On an image (SandboxSpec.image) the root is an overlay of the image's
tree instead, and nothing of the host's userland or /etc is there
(docs/image-sandbox.md).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from . import hostdirs, userland
from . import protocol as p
from .spec import Bind, BindError, SandboxSpec, path_within

WORKSPACE = "/workspace"
HOME = "/home/agent"


@dataclass(frozen=True)
class Rootfs:
    userland: tuple[str, ...]
    host_etc: tuple[str, ...]
    devices: tuple[str, ...]
    etc_files: tuple[tuple[str, bytes], ...]


@lru_cache(maxsize=1)
def default_rootfs() -> Rootfs:
    pkg = resources.files("karotte.rootfs")
    desc = json.loads(pkg.joinpath("default.json").read_text())
    etc = pkg.joinpath("etc")
    files = tuple(sorted((f.name, f.read_bytes()) for f in etc.iterdir() if f.is_file()))
    return Rootfs(tuple(desc["userland"]), tuple(desc["host_etc"]), tuple(desc["devices"]), files)


@lru_cache(maxsize=1)
def _userland_ops() -> tuple[tuple[str, str], ...]:
    """("symlink", target) or ("bind", path) for each host userland path that exists."""
    ops = []
    for path in default_rootfs().userland:
        try:
            if os.path.islink(path):
                ops.append(("symlink", path, os.readlink(path)))
            elif os.path.isdir(path):
                ops.append(("bind", path, path))
        except OSError:
            continue
    return tuple(ops)


@lru_cache(maxsize=None)
def etc_dir(hostname: str) -> str:
    """The sandbox's /etc as a host directory: the generated identity files, and copies of
    the host files programs need (rootfs/default.json). Made once per process and hostname
    (one bind instead of dozens per sandbox); removed at exit by lifecycle.cleanup(), or by
    gc after a crash."""
    rootfs = default_rootfs()
    path = hostdirs.new_dir("etc", 0o755)
    for name in rootfs.host_etc:
        _copy_public(os.path.join("/etc", name), os.path.join(path, name))
    generated = dict(rootfs.etc_files)
    generated["hostname"] = f"{hostname}\n".encode()
    generated["hosts"] = (f"127.0.0.1\tlocalhost {hostname}\n"
                          f"::1\tlocalhost ip6-localhost {hostname}\n").encode()
    for name, content in generated.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(content)
        os.chmod(os.path.join(path, name), 0o644)
    return path


def _copy_public(src: str, dst: str) -> None:
    """Copy what every host user may read, and nothing else: a bind would have shown the
    sandbox (an unmapped "other") exactly that. /etc/ssl/private stays behind."""
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):  # os-release -> ../usr/lib/os-release resolves inside too
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISDIR(st.st_mode):
        if st.st_mode & (stat.S_IROTH | stat.S_IXOTH) != (stat.S_IROTH | stat.S_IXOTH):
            return
        os.mkdir(dst, 0o755)
        for name in sorted(os.listdir(src)):
            _copy_public(os.path.join(src, name), os.path.join(dst, name))
    elif stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IROTH:
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o755 if st.st_mode & stat.S_IXOTH else 0o644)


def add_mount_plan(msg: p.Message, spec: SandboxSpec, agent_uid: int, agent_gid: int,
                   tree: str | None = None, changes: str | None = None) -> None:
    """Append the mount plan to a CONFIG message. Owner ids are as seen by init. tree: the
    image's tree (karotte/imageroot.py), or None for the host's userland; changes: the
    vetted diff laid over it, or None."""
    if tree is not None:
        _add_image_plan(msg, spec, agent_uid, agent_gid, tree, changes)
        return
    for kind, path, target in _userland_ops():
        if kind == "symlink":
            msg.mount(p.M_SYMLINK, path, target)
        else:
            msg.mount(p.M_BIND, path, path, flags=p.MF_RDONLY)
    # Over those binds: what of the host's userland is the trainer's (karotte/userland.py).
    for path, source in userland.hiding_mounts():
        msg.mount(p.M_BIND, path, source, flags=p.MF_RDONLY)

    # /etc: one read-only bind of a directory made once per process (see etc_dir).
    msg.mount(p.M_BIND, "/etc", etc_dir(spec.hostname), flags=p.MF_RDONLY)

    # /dev: in the read-only root, binds of a few harmless character devices. (Not a
    # tmpfs of its own: each superblock costs the kernel memory in every memory cgroup.)
    _add_devices(msg, spec)
    _add_writable(msg, spec, agent_uid, agent_gid)
    msg.mount(p.M_DIR, "/root", mode=0o700)
    _add_binds(msg, spec, _hidden_by_binds())


def _add_devices(msg: p.Message, spec: SandboxSpec) -> None:
    """/dev's device-node binds, devpts, /dev/shm and the fd links; then /proc."""
    for dev in default_rootfs().devices:
        msg.mount(p.M_BIND, f"/dev/{dev}", f"/dev/{dev}", flags=p.MF_DEV)
    msg.mount(p.M_DEVPTS, "/dev/pts")
    msg.mount(p.M_TMPFS, "/dev/shm", "", mode=0o1777, size=spec.tmp_size, inodes=4096)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        msg.mount(p.M_SYMLINK, f"/dev/{name}", target)
    msg.mount(p.M_PROC, "/proc")


def _add_binds(msg: p.Message, spec: SandboxSpec, hidden: dict[str, str]) -> None:
    for bind in spec.binds:
        _check_bind(bind, spec.hostname, hidden)
        if not os.path.exists(bind.src):
            raise FileNotFoundError(f"bind source does not exist: {bind.src}")
        flags = (0 if bind.writable else p.MF_RDONLY) | (
            0 if bind.follow_symlinks else p.MF_NOSYMFOLLOW)
        msg.mount(p.M_BIND, bind.dst, os.path.realpath(bind.src), flags=flags)


# On an image: /dev is a small tmpfs of its own, so the image's /dev (whatever nodes or
# files it holds) stays hidden and the mount points of the device binds are not made in
# the overlay's upper.
_DEV_TMPFS = {"size": 64 * 1024, "inodes": 64}


def _add_image_plan(msg: p.Message, spec: SandboxSpec, agent_uid: int, agent_gid: int,
                    tree: str, changes: str | None) -> None:
    """The plan on an image: the overlay root (its upper is spec.disk and spec.inodes; the
    vetted diff, if any, laid over the tree), then what every sandbox has (/dev, /proc,
    /tmp, /workspace, /home/agent) and nothing of the host: no userland bind, no /etc, no
    /root (the image's own stay). init makes the mount points of all that follows the
    overlay in a layer of their own, above the tree: none of them is in the upper."""
    if changes is not None:
        msg.mount(p.M_LAYER, "/", changes)
    msg.mount(p.M_OVERLAY, "/", tree, size=spec.disk, inodes=spec.inodes)
    msg.mount(p.M_TMPFS, "/dev", "", mode=0o755, **_DEV_TMPFS)
    _add_devices(msg, spec)
    _add_writable(msg, spec, agent_uid, agent_gid)
    _add_binds(msg, spec, _IMAGE_HIDDEN)


def _add_writable(msg: p.Message, spec: SandboxSpec, agent_uid: int, agent_gid: int) -> None:
    # Writable places, each its own tmpfs with a byte and an inode limit. Their pages
    # are charged to the sandbox's memory cgroup, so they also count against memory.
    msg.mount(p.M_TMPFS, "/tmp", "", mode=0o1777, size=spec.tmp_size, inodes=spec.inodes)
    msg.mount(p.M_TMPFS, WORKSPACE, "", mode=0o755, uid=agent_uid, gid=agent_gid,
              size=spec.disk, inodes=spec.inodes)
    msg.mount(p.M_TMPFS, HOME, "", mode=0o700, uid=agent_uid, gid=agent_gid,
              size=spec.home_size, inodes=4096)


def _hidden_by_binds() -> dict[str, str]:
    """The plan's mount points that a bind onto them (or onto a directory above them)
    would hide, and what each holds. /workspace is not one: a host directory in its
    place is what a bind there is for (the grader's nested runs bind the submission)."""
    hidden = {path: "part of the host's userland (read-only) that every program runs from"
              for path in default_rootfs().userland}
    hidden["/etc"] = "the sandbox's own (its generated passwd, group and hosts)"
    return {**hidden, **_IMAGE_HIDDEN}


# What a bind would hide on an image too; the rest of its root is the overlay, in which
# init makes any mount point.
_IMAGE_HIDDEN = {"/tmp": "a tmpfs with a size and an inode limit",
                 HOME: "the agent's home, a tmpfs with a size limit"}


def _check_bind(bind: Bind, hostname: str, hidden: dict[str, str]) -> None:
    """Refuse a bind that would hide a mount of the plan, or that needs a mount point
    that cannot be made (below a read-only mount, where it does not exist)."""
    for point, what in hidden.items():
        if path_within(point, bind.dst):
            raise BindError(f"bind {bind.src} -> {bind.dst} would hide {point}, {what}; bind "
                            f"onto a path of its own, such as /data")
        if path_within(bind.dst, point):
            inside = (os.path.join(etc_dir(hostname), os.path.relpath(bind.dst, "/etc"))
                      if point == "/etc" else bind.dst)
            if not os.path.lexists(inside):
                raise BindError(f"bind {bind.src} -> {bind.dst}: {point} is read-only in the "
                                f"sandbox, so a bind below it needs a mount point that exists "
                                f"there, and {bind.dst} does not; bind onto a path of its own, "
                                f"such as /data")
