"""Whiteouts (IMG-WHITEOUT-01): how a layer deletes what its lower layers put in the tree.

A regular, empty `.wh.NAME` deletes NAME of the lower layers; `.wh..wh..opq` deletes what
lower layers put in its directory; either keeps what this layer adds, in whatever order
the tar has them (the layer records what it made: `added`, and the directories above it:
`holds`). `.wh.`, `.wh..`, `.wh...`, an opaque marker at the root, a whiteout that is not
an empty regular file, a whiteout through a symlink and a `.wh.` name used as a directory
refuse the image. AUFS's own metadata at the root (AUFS_META, and what is under it) is
skipped by the layer, as Docker skips it.

Whiteouts is a part of extract's layer: it walks the tree with the layer's own fd-relative
steps (`_parent`, `_open_dir`, `_clear`), so a deletion never follows a link either.
"""
from __future__ import annotations

import os
import stat
from typing import Any

from ..results import escape
from .tree import LayerError, join, lstat_at, sorted_names

AUFS_META = (b".wh..wh.plnk", b".wh..wh.aufs", b".wh..wh.orph")
WHITEOUT = b".wh."
OPAQUE = b".wh..wh..opq"


class Whiteouts:
    """The whiteout half of extract's _Layer (which provides refuse, _parent, _open_dir,
    _clear, added and holds)."""

    def _ours(self, path: bytes) -> bool:
        """Whether this layer made path, or something below it."""
        return path in self.added or path in self.holds

    def _remove_lower(self, parent: int, name: bytes, path: bytes) -> None:
        """Remove what lower layers put at name, keeping what this layer made there (in
        whatever order the tar has the whiteout and this layer's own entries)."""
        st = lstat_at(name, parent)
        if st is None:
            return
        if not self._ours(path):
            self._clear(parent, name, path)
            return
        if not stat.S_ISDIR(st.st_mode):
            return  # this layer's own entry
        fd = self._open_dir(parent, name, path)
        stack = [(fd, path, sorted_names(fd))]
        try:
            while stack:
                dfd, dpath, names = stack[-1]
                if not names:
                    stack.pop()
                    os.close(dfd)
                    continue
                child = names.pop()
                cpath = dpath + b"/" + child
                st = lstat_at(child, dfd)
                if st is None:
                    continue
                if not self._ours(cpath):
                    self._clear(dfd, child, cpath)
                elif stat.S_ISDIR(st.st_mode):
                    cfd = self._open_dir(dfd, child, cpath)
                    stack.append((cfd, cpath, sorted_names(cfd)))
        finally:
            for dfd, _, _ in stack:
                os.close(dfd)

    def _whiteout(self, m: Any, dirs: list[bytes], name: bytes) -> None:
        if not m.isreg() or m.size:
            raise self.refuse("IMG-WHITEOUT-01", "a whiteout must be an empty regular file")
        if name == OPAQUE:
            if not dirs:
                raise self.refuse("IMG-WHITEOUT-01", "an opaque marker at the root would "
                                  "erase every lower layer")
            target = None
        else:
            target = name[len(WHITEOUT):]
            if target in (b"", b".", b".."):
                raise self.refuse("IMG-WHITEOUT-01", f"{escape(name)} would erase its "
                                  "parent directory")
            if target.startswith(WHITEOUT):
                raise self.refuse("IMG-WHITEOUT-01", "a whiteout of a whiteout name (AUFS "
                                  "metadata is allowed only at the root: "
                                  ".wh..wh.plnk, .wh..wh.aufs, .wh..wh.orph)")
        try:
            parent = self._parent(dirs, create=False)
        except LayerError as exc:
            if exc.rule == "IMG-SYMLINK-01":
                raise self.refuse("IMG-SYMLINK-01", f"a whiteout through a symlink: "
                                  f"{exc.detail}") from None
            raise
        if parent is None:
            return  # nothing there to delete
        if target is not None:
            self._remove_lower(parent, target, join(dirs, target))
            return
        for child in sorted_names(parent):
            self._remove_lower(parent, child, join(dirs, child))
