"""Custody of an image sandbox's filesystem diff: the overlay's upper directory, scanned as
what the agent changed of the image and copied as a vetted diff that a new sandbox lays
over the same image (SandboxSpec.changes).

On an image the upper holds exactly what the agent changed: init makes every mount point of
its plan in a layer of its own above the tree (csrc/init/mounts.c), so nothing of /dev,
/proc, /tmp, /workspace, /home/agent or the binds is in it, and the overlay runs without
metacopy, index or redirects, so every file there holds its own bytes. After kill_all the
host walks it through Sandbox.upper_fd with the workspace scan's walk and rules
(karotte/scan.py, docs/scan.md), and with these for what only an upper has:

- a whiteout (a character device 0/0) is a deletion: ScanResult.deleted, and a whiteout in
  the copy;
- a directory with user.overlay.opaque "y" replaces the image's directory there:
  ScanResult.replaced, and the same xattr on its copy;
- user.overlay.origin, impure, nlink, uuid and protattr say where an entry came from and
  how to number it; its bytes and names are all in the upper, and the copy drops them;
- user.overlay.overlay.* is a user.overlay.* xattr that the agent set: overlayfs (6.7+)
  stores it escaped, so that it marks nothing (before 6.7 it refuses to set it), and the
  copy drops it as it drops every xattr of the agent's;
- a symlink is kept as a symlink: its target read with readlinkat on an O_PATH fd of the
  link itself (the inode lstat saw; at most PATH_MAX - 1 bytes, each counted against
  max_total_size), and made again with symlinkat in the copy. The host never follows it;
  the sandbox on the diff resolves it in its own root, which is the agent's system, and
  the grader's process sees /changes without following any link (a nosymfollow bind). A
  symlink at, on the way to or inside a deliverable stays a violation: a deliverable is a
  regular file in plain directories;
- any other user.overlay.* xattr (a redirect, a metacopy file whose data is in a lower
  layer, an xattr whiteout, a value overlayfs does not write here) is rejected: the copy
  would show something other than what the agent saw (overlay-metadata). overlayfs writes
  none of them with the sandbox's options, and the agent cannot, but the rule does not
  rest on either.

The copy is in overlay-lower form, in the store's convention for this caller: a root
caller's copy carries the ids the agent saw (those of the sandbox's user namespace, as a
tree of the store carries the image's own), which the same idmap shows to the next sandbox;
an unprivileged caller's copy is the caller's, as its trees are. Modes are the agent's (less
setuid, setgid and sticky on files, which are rejected): not normalised as in the
workspace's copy, because a diff's modes are part of the system it changes (a host key of
0600, a /var/tmp of 1777 that a copy-up brought into the upper). docs/image-sandbox.md,
"Custody of the diff".
"""
from __future__ import annotations

import errno
import os
import stat
import time
from typing import Callable, Sequence

from .results import ScanResult, capped, escape
from .scan import (COPY_TIME, PATH_TEXT_LIMIT, RULE_MODE, RULE_UNREADABLE, Frame, ScanError,
                   ScanLimits, Walk, relation, walk_into)
from .userns import AGENT_UID, ns_owner_ids, uid_base

__all__ = ["scan_changes", "OVERLAY_XATTR", "OPAQUE"]

OVERLAY_XATTR = "user.overlay."  # overlayfs' own xattrs with userxattr
OPAQUE = OVERLAY_XATTR + "opaque"
# overlayfs' bookkeeping: where an entry was copied up from (origin, impure), its link count
# and flags across copy-up (nlink, protattr), the layer's identity (uuid). The entry's bytes
# and names are the upper's own either way.
_BOOKKEEPING = frozenset({"origin", "impure", "nlink", "uuid", "protattr"})
_MEANING = {
    "redirect": "its contents are another path of a lower layer",
    "metacopy": "its data is in a lower layer, not in the upper",
    "whiteout": "an xattr whiteout, which only a lower layer may hold",
    "whiteouts": "a directory of xattr whiteouts, which only a lower layer may hold",
    "opaque": "opaque, but not a directory marked 'y'",
}
RULE_OVERLAY = "D3 overlay: an entry of the diff holds every byte and name it shows"
RULE_OWNER = "D2 owners: every id in the upper is one of the sandbox's"
# The link itself, never what it points at: O_PATH opens no file and follows nothing.
_LINK_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _ids_inside() -> Callable[[int], int | None] | None:
    """host id -> the id the agent saw, for a root caller's sandbox (docs/userns.md: its ids
    from uid_base(), its agent's uid one of the namespace owners); None for an unprivileged
    caller, whose copy stays the caller's."""
    if os.geteuid() != 0:
        return None
    base = uid_base()
    owners = ns_owner_ids(base)

    def inside(host: int) -> int | None:
        if base <= host < base + 65536:
            return host - base
        return AGENT_UID if host in owners else None

    return inside


class _Diff(Walk):
    """The walk of an overlay's upper: scan.py's rules, and the upper's own."""

    def __init__(self, limits: ScanLimits, start: float, deliverables: Sequence[str]):
        super().__init__(limits, start, deliverables)
        self.deleted: list[str] = []
        self.replaced: list[str] = []
        self.inside = _ids_inside()
        self.owner: tuple[int, int] | None = None  # of the entry just accepted
        self.opaque = False  # the directory just accepted is opaque

    def _report(self, raw: bytes) -> str:
        return capped("/" + escape(raw), PATH_TEXT_LIMIT)

    def _shown(self, raw: bytes) -> str:
        return "/" + escape(raw)

    def _other(self, parent: Frame, name: bytes, raw: bytes, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):
            self._link(parent, name, raw, st)
            return
        if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0):
            super()._other(parent, name, raw, st)
            return
        # A whiteout: the agent deleted what the image has here.
        path = self._shown(raw)
        self._charge(raw, path)
        try:
            os.mknod(name, stat.S_IFCHR, 0, dir_fd=parent.dst)
        except OSError as exc:
            raise ScanError(f"cannot make the whiteout of {path} in dest_dir: {exc.strerror} "
                            "(root may; an unprivileged user since Linux 5.8)") from exc
        try:
            os.utime(name, ns=(COPY_TIME * 10**9,) * 2, dir_fd=parent.dst, follow_symlinks=False)
        except OSError as exc:
            raise ScanError(f"cannot set the timestamps of the whiteout of {path}: "
                            f"{exc.strerror}") from exc
        self.deleted.append(path)

    def _link(self, parent: Frame, name: bytes, raw: bytes, st: os.stat_result) -> None:
        """A symlink of the agent's: copied as one (its target, never what it points at)."""
        if any(relation(raw, d) for d in self.deliverables):
            super()._other(parent, name, raw, st)  # rejected as in the workspace
            return
        opened = self._open(parent, name, raw, st, _LINK_FLAGS)
        if opened is None:
            return
        fd, fst = opened
        try:
            target = os.readlink(b"", dir_fd=fd)  # readlinkat(fd, ""): this very inode's
        except OSError as exc:
            self._violate(raw, "unreadable", RULE_UNREADABLE, f"readlink failed: {exc.strerror}")
            return
        finally:
            os.close(fd)
        if not self._accepts_owner(raw, fst):
            return
        # The kernel holds at most PATH_MAX - 1 bytes of target; each counts as a copied
        # byte, so a flood of long links cannot fill the host's copy past the budget.
        if self.total + len(target) > self.limits.max_total_size:
            self._stop(raw, "total-too-large", f"max_total_size={self.limits.max_total_size}",
                       f"{self.total} bytes copied, this link's target adds {len(target)}")
        self._charge(raw, self._shown(raw))
        try:
            os.symlink(target, name, dir_fd=parent.dst)  # symlinkat: follows nothing
            if self.owner is not None:
                os.chown(name, *self.owner, dir_fd=parent.dst, follow_symlinks=False)
            os.utime(name, ns=(COPY_TIME * 10**9,) * 2, dir_fd=parent.dst, follow_symlinks=False)
        except OSError as exc:
            raise ScanError(f"cannot make the symlink /{escape(raw)} in dest_dir: "
                            f"{exc.strerror}") from exc
        self.total += len(target)

    def _dir_problems(self, raw: bytes, st: os.stat_result) -> bool:
        # setgid and sticky stay: a copy-up brings the image's own directories here with
        # their modes (/var/tmp 1777, /var/mail 2775). setuid on a directory means nothing
        # to Linux, and nothing the agent needs: rejected as in the workspace.
        if st.st_mode & stat.S_ISUID:
            self._violate(raw, "setuid", RULE_MODE, f"directory mode {stat.S_IMODE(st.st_mode):04o}")
            return True
        return False

    def _accepts(self, fd: int, raw: bytes, fst: os.stat_result) -> bool:
        try:
            names = [n for n in os.listxattr(fd) if n.startswith(OVERLAY_XATTR)]
            marks = {n[len(OVERLAY_XATTR):]: os.getxattr(fd, n) for n in names}
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                self._violate(raw, "unreadable", "D2 fd walk: the host must be able to read "
                              "the entry", f"xattrs: {exc.strerror}")
                return False
            marks = {}  # no user xattrs on this upper (tmpfs before 6.6): nothing to mark
        self.opaque = False
        for key, value in sorted(marks.items()):
            # overlay.*: a user.overlay.* xattr the agent set, which overlayfs (6.7+) stores
            # escaped so that it marks nothing; its own xattr, dropped like any other.
            if key in _BOOKKEEPING or key.startswith("overlay."):
                continue
            if key == "opaque" and value == b"y" and stat.S_ISDIR(fst.st_mode):
                self.opaque = True
                continue
            meaning = _MEANING.get(key, "not one overlayfs writes in this upper")
            self._violate(raw, "overlay-metadata", RULE_OVERLAY,
                          f"{OVERLAY_XATTR}{capped(key, 64)}: {meaning}")
            return False
        return self._accepts_owner(raw, fst)

    def _accepts_owner(self, raw: bytes, fst: os.stat_result) -> bool:
        """Whether the entry's owner is one of the sandbox's; sets self.owner, the ids the
        copy gets (None: the caller's)."""
        if self.inside is None:
            self.owner = None
            return True
        uid, gid = self.inside(fst.st_uid), self.inside(fst.st_gid)
        if uid is None or gid is None:
            self._violate(raw, "unmapped-owner", RULE_OWNER,
                          f"host owner {fst.st_uid}:{fst.st_gid}")
            return False
        self.owner = uid, gid
        return True

    def _own(self, fd: int, fst: os.stat_result, raw: bytes, keep: int) -> int:
        """The copy's owner and mode (of fst's bits, those in keep); returns the mode."""
        mode = stat.S_IMODE(fst.st_mode) & keep
        try:
            if self.owner is not None:
                os.fchown(fd, *self.owner)
            elif stat.S_ISDIR(fst.st_mode):
                # The caller owns the copy and must create in it; the owner may chmod its own
                # directory anyway, so u+rwx gives the agent nothing it lacked.
                mode |= 0o700
            os.fchmod(fd, mode)
        except OSError as exc:
            raise ScanError(f"cannot set the owner and mode of the copy of /{escape(raw)}: "
                            f"{exc.strerror}") from exc
        return mode

    def _new_dir(self, dst_parent: int, name: bytes, raw: bytes, fst: os.stat_result) -> int:
        fd = super()._new_dir(dst_parent, name, raw, fst)
        try:
            self._own(fd, fst, raw, 0o3777)
            if self.opaque:
                try:
                    os.setxattr(fd, OPAQUE, b"y")
                except OSError as exc:
                    raise ScanError(
                        f"cannot mark the copy of /{escape(raw)} opaque ({OPAQUE}): "
                        f"{exc.strerror}; put dest_dir on a filesystem with user xattrs "
                        "(ext4, xfs, btrfs, tmpfs from Linux 6.6)") from exc
                self.replaced.append(self._shown(raw))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _set_mode(self, out: int, fst: os.stat_result, raw: bytes) -> int:
        return self._own(out, fst, raw, 0o777)


def scan_changes(upper_fd: int, dest_dir: str | bytes | os.PathLike, limits: ScanLimits, *,
                 deliverables: Sequence[str] = ()) -> ScanResult:
    """Walk the overlay's upper behind upper_fd (Sandbox.upper_fd) and copy what passes into
    dest_dir as a vetted diff: accepted regular files and directories with the agent's
    modes and, for a root caller, the ids the agent saw; whiteouts for deletions; opaque
    directories marked as overlayfs reads them. SandboxSpec(image=..., changes=dest_dir)
    lays it over the image. A symlink is copied as a symlink (never followed), unless it is
    at, on the way to or inside a deliverable.

    deliverables are absolute paths ("/etc/nginx/nginx.conf") whose violations decide the
    score, held however many others there are. Every path of the result is absolute.
    Call it after kill_all, with dest_dir a fresh empty directory on a filesystem with user
    xattrs; on ScanError discard it.
    """
    walk = _Diff(limits, time.monotonic(), deliverables)
    start = walk_into(walk, upper_fd, "upper_fd", dest_dir)
    return ScanResult(tuple(walk.files), tuple(walk.dirs), tuple(walk.violations),
                      walk.complete, time.monotonic() - start, walk.dropped,
                      tuple(walk.deleted), tuple(walk.replaced))
