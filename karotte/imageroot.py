"""The root of a sandbox on an image: which tree `SandboxSpec.image` names, and the tree as
a read-only, idmapped mount that the host hands to karotte-init.

`resolve_root` is the one place an image reference becomes a tree: "host" is no image
(the host's userland, karotte/mounts.py), "dir:/PATH" is the caller's own tree, with no
image config (no Env, no WorkingDir). init lays an overlay over the tree (csrc/init/
mounts.c, KM_OVERLAY); why the tree is idmapped and how the overlay is made:
docs/image-sandbox.md.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass, field
from typing import Mapping

from . import imageref, images
from .errors import HostUnsupported, SandboxError
from .seccomp import SYSCALL_NUMBERS
from .spec import SandboxSpec

OVERLAY_USERNS_KERNEL = (5, 11)  # overlayfs mounted in a user namespace (userxattr)
IDMAPPED_LAYERS_KERNEL = (5, 19)  # overlayfs on an idmapped lower layer

# <linux/mount.h>
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x100000
_MOUNT_ATTR = struct.Struct("=QQQQ")  # attr_set, attr_clr, propagation, userns_fd


@dataclass(frozen=True)
class ImageRoot:
    """The tree a sandbox runs on and what its image config asks of every command."""

    tree: str  # absolute host path of the read-only tree (the overlay's lower)
    env: Mapping[str, str] = field(default_factory=dict)  # the config's Env, before the caller's
    workdir: str | None = None  # the config's WorkingDir: the cwd when an exec names none
    changes: str | None = None  # absolute host path of the vetted diff laid over the tree


def resolve_root(spec: SandboxSpec, leases: contextlib.ExitStack) -> ImageRoot | None:
    """The tree of spec.image, or None for "host". spec.py has checked the form. An image of
    the store (a name, or a source imported on first use) is leased on `leases`, which the
    sandbox closes when it is destroyed: until then the store's gc keeps the tree."""
    ref = imageref.parse(spec.image)
    if ref.kind == "host":
        return None
    changes = _changes(spec)
    if ref.kind != "dir":
        image = leases.enter_context(images.lease(ref))
        env = dict(entry.partition("=")[::2] for entry in image.config.env)
        return ImageRoot(image.tree, env, image.config.working_dir, changes)
    path = ref.path
    tree = os.path.realpath(path)
    if not os.path.isdir(tree):
        raise (FileNotFoundError if not os.path.lexists(path) else NotADirectoryError)(
            f"image {spec.image}: {path} is not a directory; make the tree first (for example "
            f"`mmdebstrap --variant=essential bookworm {path}`), or name one that exists")
    if tree == "/":
        raise ValueError(f"image {spec.image} resolves to /, the host's own root; name a "
                         f"tree of its own")
    _check_owner(f"image {spec.image}", tree)
    return ImageRoot(tree, changes=changes)


def _changes(spec: SandboxSpec) -> str | None:
    """The vetted diff's directory (spec.py has checked the form), resolved."""
    if spec.changes is None:
        return None
    path = os.path.realpath(spec.changes)
    if not os.path.isdir(path) or path == "/":
        raise (FileNotFoundError if not os.path.lexists(spec.changes) else NotADirectoryError)(
            f"changes {spec.changes} is not a directory; pass the dest_dir that "
            f"karotte.changes.scan_changes filled, while it exists")
    _check_owner(f"changes {spec.changes}", path)
    return path


def lower_fds(root: ImageRoot, userns_fd: int) -> list[int]:
    """The overlay's lowers as init takes them from a root caller: the tree and then the
    vetted diff, each idmapped onto the sandbox's user namespace (the same map: the diff
    carries the ids the agent saw, as the tree carries the image's). Closed on failure."""
    fds = [idmapped_tree(root.tree, userns_fd)]
    try:
        if root.changes is not None:
            fds.append(idmapped_tree(root.changes, userns_fd))
    except BaseException:
        os.close(fds[0])
        raise
    return fds


def _check_owner(what: str, tree: str) -> None:
    """An unprivileged caller's sandbox maps only the caller's ids, and its root is the
    caller: a tree of anyone else's would show nobody's files, and the first write (a copy-up
    that must give the copy an owner the upper can hold) would fail. Refused up front."""
    uid = os.geteuid()
    owner = os.stat(tree).st_uid
    if uid != 0 and owner != uid:
        raise SandboxError(f"{what}: {tree} belongs to uid {owner}, and this "
                           f"unprivileged caller (uid {uid}) maps only its own ids into the "
                           f"sandbox: the tree must be the caller's own (chown -R), or run "
                           f"Karotte as root, whose trees are idmapped")


_LIBC = ctypes.CDLL(None, use_errno=True)  # once: a CDLL per call cost 7 us (docs/benchmarks.md)


def _syscall(name: str, *args) -> int:
    nr = SYSCALL_NUMBERS[name].get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"{name} has no number on {platform.machine()}")
    ret = _LIBC.syscall(nr, *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def idmapped_tree(tree: str, userns_fd: int) -> int:
    """A detached mount of tree, read-only, nosuid and nodev, whose ids are read in the
    user namespace userns_fd: the file of host uid 0 is root of that namespace, uid 1000 its
    agent. For a root caller (idmapping needs CAP_SYS_ADMIN over the tree's filesystem);
    init moves it into place as the overlay's lower. Returns the mount's fd (O_CLOEXEC)."""
    try:
        fd = _syscall("open_tree", -100, os.fsencode(tree),  # AT_FDCWD
                      _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE)
    except OSError as exc:
        raise _unsupported(tree, "open_tree", exc) from exc
    attr = _MOUNT_ATTR.pack(_MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID
                            | _MOUNT_ATTR_NODEV, 0, 0, userns_fd)
    try:
        _syscall("mount_setattr", fd, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, attr, len(attr))
    except OSError as exc:
        os.close(fd)
        raise _unsupported(tree, "mount_setattr(MOUNT_ATTR_IDMAP)", exc) from exc
    return fd


def _unsupported(tree: str, call: str, exc: OSError) -> HostUnsupported:
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    if exc.errno == errno.ENOSYS:
        why = (f"the kernel has no {call.split('(')[0]} (Linux 5.12+), or a seccomp profile "
               f"around this process denies it; upgrade the kernel, or run outside a container "
               f"whose profile denies the new mount API")
    elif exc.errno == errno.EINVAL:
        why = (f"the filesystem holding {tree} cannot be idmapped (NFS, FUSE, or an overlay "
               f"such as a container's own root cannot); put the tree on ext4, xfs, btrfs or "
               f"tmpfs (Linux 6.3+)")
    else:
        why = ("a seccomp profile or LSM (AppArmor, SELinux) around this process refused it; "
               "run Karotte on the host, or allow the new mount API")
    return HostUnsupported("image-overlay", f"an image's tree is shown to the sandbox through "
                           f"an idmapped mount, and {call} of {tree} failed with {name}: {why}")


def overlay_unsupported(what: str, err: int, kernel: str) -> HostUnsupported:
    """The error of a sandbox whose init could not lay the overlay (step overlay-*)."""
    name = errno.errorcode.get(err, str(err))
    need = ".".join(map(str, OVERLAY_USERNS_KERNEL))
    return HostUnsupported(
        "image-overlay", f"karotte-init failed at '{what}' ({name}) inside its user namespace: "
        f"overlayfs there needs Linux {need}+ (userxattr; an idmapped lower needs "
        f"{'.'.join(map(str, IDMAPPED_LAYERS_KERNEL))}+ and a tmpfs upper with user xattrs "
        f"6.6+; this is {kernel}), and no AppArmor policy (Ubuntu's "
        f"kernel.apparmor_restrict_unprivileged_userns) or container seccomp profile that "
        f"forbids mounts in user namespaces; upgrade the kernel or run on the host itself, or "
        f"use image='host'")
