"""The fd-relative steps an extract layer (karotte/images/extract.py's _Layer) walks its
tree with, never following a link: a directory opened O_NOFOLLOW (refused as
IMG-SYMLINK-01 where an earlier entry or layer planted a symlink, and opened up while the
layer writes in it when run unprivileged), the chain of an entry's parents kept from entry
to entry (made where missing), what the layer made (`added`, and the directories above it:
`holds`, which whiteouts keep), and the layer's before and after: the bytes of the files
already in the tree (its budget), and its directories' modes and mtimes when it ends,
deepest first.

TreeWalk is a part of _Layer, as Whiteouts is: it uses the layer's root, chain, dirs,
added, holds, unprivileged, refuse and _own_ids.
"""
from __future__ import annotations

import errno
import os
import stat

from ..results import escape
from .tree import DIR_FLAGS, lstat_at, sorted_names


class TreeWalk:
    """The tree-walking half of extract's _Layer."""

    # -- walking the tree

    def _open_dir(self, parent: int, name: bytes, path: bytes) -> int:
        """The directory name in parent, never through a symlink; writable by us."""
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except PermissionError:
            if not self.unprivileged:
                raise
            self._open_up(parent, name, path)
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            st = lstat_at(name, parent)
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise self.refuse("IMG-SYMLINK-01", f"{escape(path)} is a symlink; a layer "
                                  "never writes through one") from None
            raise self.refuse("IMG-TRAVERSAL-01", f"{escape(path)} is not a directory") \
                from None
        if self.unprivileged and stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
            self._open_up(parent, name, path)
        return fd

    def _open_up(self, parent: int, name: bytes, path: bytes) -> None:
        """Unprivileged, the mode bits bind us too: give a directory owner rwx while the
        layer works in it; _finish gives it its mode back. By name, since a directory
        without r cannot be opened: lstat shows a directory there, and nothing but this
        layer writes in the tree, so there is no link to follow."""
        st = lstat_at(name, parent)
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise self.refuse("IMG-TRAVERSAL-01", f"{escape(path)} is not a directory")
        mode = stat.S_IMODE(st.st_mode)
        self.dirs.setdefault(path, (mode, None))
        os.chmod(name, mode | 0o700, dir_fd=parent)

    def _parent(self, dirs: list[bytes], create: bool) -> int | None:
        """The fd of the directory dirs names, opened component by component from the
        root (missing ones made, if create; else None). The chain of fds is kept for the
        next entry: nothing a layer does removes an ancestor of the entry it applies."""
        keep = 0
        while keep < min(len(dirs), len(self.chain)) and self.chain[keep][0] == dirs[keep]:
            keep += 1
        for _, fd in self.chain[keep:]:
            os.close(fd)
        del self.chain[keep:]
        for i in range(keep, len(dirs)):
            parent = self.chain[-1][1] if self.chain else self.root
            path = b"/".join(dirs[:i + 1])
            if lstat_at(dirs[i], parent) is None:
                if not create:
                    return None
                os.mkdir(dirs[i], 0o700, dir_fd=parent)
                fd = os.open(dirs[i], DIR_FLAGS, dir_fd=parent)
                self.chain.append((dirs[i], fd))
                self._own_ids(fd, 0, 0)  # a parent the tar never named: root's, 0755
                self.dirs[path] = (0o755, None)
                self._add(path)
                continue
            self.chain.append((dirs[i], self._open_dir(parent, dirs[i], path)))
        return self.chain[-1][1] if self.chain else self.root

    def _reopen(self, parts: list[bytes]) -> int | None:
        """A fresh fd of the directory parts names (the caller closes it), or None if a
        component is missing, a symlink or not a directory. The current entry's chain of
        fds stays as it is."""
        fd = os.open(".", DIR_FLAGS, dir_fd=self.root)
        for part in parts:
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return None
                raise
            os.close(fd)
            fd = nxt
        return fd

    def _add(self, path: bytes) -> None:
        self.added.add(path)
        if path:
            self._hold(path.rpartition(b"/")[0])

    def _hold(self, path: bytes) -> None:
        """path (a directory) and those above it hold something this layer made."""
        while path not in self.holds:
            self.holds.add(path)
            if not path:
                break
            path = path.rpartition(b"/")[0]

    # -- before and after

    def _measure(self) -> int:
        """Bytes of the regular files already in the tree (each inode once)."""
        total = 0
        seen: set[int] = set()
        stack = [(os.open(".", DIR_FLAGS, dir_fd=self.root), b"")]
        try:
            while stack:
                fd, path = stack.pop()
                try:
                    for child in sorted_names(fd):
                        st = lstat_at(child, fd)
                        if st is None:
                            continue
                        if stat.S_ISDIR(st.st_mode):
                            cpath = path + b"/" + child if path else child
                            stack.append((self._open_dir(fd, child, cpath), cpath))
                        elif stat.S_ISREG(st.st_mode) and (st.st_nlink == 1 or
                                                           st.st_ino not in seen):
                            seen.add(st.st_ino)
                            total += st.st_size
                finally:
                    os.close(fd)
        finally:
            for fd, _ in stack:
                os.close(fd)
        return total

    def _finish(self) -> None:
        """Directories' modes and mtimes, deepest first: nothing is written in them now.
        Siblings are next to each other in that order, so each is opened from the fds of
        its parents kept from the one before (they are shallower: not given their modes
        yet)."""
        for _, fd in self.chain:
            os.close(fd)
        self.chain.clear()
        chain: list[tuple[bytes, int]] = []  # the parents of the directory before
        try:
            for path in sorted(self.dirs, key=lambda p: (-p.count(b"/") - bool(p), p)):
                mode, mtime = self.dirs[path]
                fd = self._reach(chain, path.split(b"/") if path else [])
                if fd is None:
                    continue  # replaced or whited out since
                try:
                    os.fchmod(fd, mode)
                    if mtime is not None:
                        os.utime(fd, ns=(mtime, mtime))
                finally:
                    os.close(fd)
        finally:
            for _, fd in chain:
                os.close(fd)

    def _reach(self, chain: list[tuple[bytes, int]], parts: list[bytes]) -> int | None:
        """A fresh fd of the directory parts names (the caller closes it), opened from the
        fds of chain (its parents so far, kept and updated for the next call), or None if
        a component is missing, a symlink or not a directory."""
        keep = 0
        while keep < min(len(parts) - 1, len(chain)) and chain[keep][0] == parts[keep]:
            keep += 1
        for _, fd in chain[keep:]:
            os.close(fd)
        del chain[keep:]
        for part in parts[len(chain):]:
            try:
                fd = os.open(part, DIR_FLAGS, dir_fd=chain[-1][1] if chain else self.root)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return None
                raise
            chain.append((part, fd))
        if not parts:
            return os.open(".", DIR_FLAGS, dir_fd=self.root)
        return chain.pop()[1]
