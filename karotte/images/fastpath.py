"""extract.py's fast path: runs of plain entries (a regular file, a symlink or a new
directory, each in a directory of the chain of the entry before, one the run made, or one
already there that the run opens without following links)
applied by csrc/extract.c through karotte._native, which stops, consuming nothing of it, at
whatever extract.py must look at itself (csrc/extract.h says what, and why it never does
what extract.py would refuse). The run's files are finished by a second C call, from the
same bytes, on the thread that keeps the hashes (Batch.finish): their data written there
(where the Run defers it: the C run leaves each new file open and sized) and hashed. Without
the extension (an interpreter without cffi), AVAILABLE is False and extract.py applies every
entry itself.
"""
from __future__ import annotations

import os
import resource
import struct
from typing import Any, Iterator, NamedTuple

try:
    from .._native import ffi, lib
    AVAILABLE = hasattr(lib, "karotte_extract_finish")
except ImportError:  # the system Python of an unprivileged import, without cffi
    ffi = lib = None
    AVAILABLE = False

_RUN = 4096  # entries applied per call at most
GROW = 4 << 20  # bytes an entry may take for the caller to read on and call again
_PATHS = 1 << 20  # bytes of the entries' paths per call at most
CHAIN = 256  # csrc/extract.h's KX_CHAIN: a deeper chain is left to extract.py
CHAIN_PATH = 4096  # KX_PATH
_FILE, _DIR = 0, 2  # KX_FILE, KX_DIR
_new = ffi.new_allocator(should_clear_after_alloc=False) if AVAILABLE else None
# struct kx_done as csrc/extract.h lays it out: ino, size, data_off, mode, mtime, path_off,
# path_len, kind, new_parent, sha256, fd, err, then the compiler's padding.
_DONE = struct.Struct("=QqQqqIIII32sii" + (
    f"{ffi.sizeof('struct kx_done') - 96}x" if AVAILABLE else ""))
# Files left open for Batch.finish at most, by every import of the process at once: a
# quarter of the descriptors it may open (the trainer's own need the rest), and no more
# than a few runs' worth.
_OPEN_MAX = 512


class Dir(NamedTuple):
    """A directory the run made: its path, and the tar's mode bits and mtime (seconds),
    which extract.py sets when the layer ends."""

    path: bytes
    mode: int
    mtime: int


class Batch:
    """What one call applied: paths (every entry's, in order), marks (the other paths
    whose parent differs from the entry's before: extract.py's holds), dirs (made), and
    the files to finish from the same bytes (finish())."""

    def __init__(self, view: memoryview, done: Any, n: int, paths: list[bytes], count: Any):
        self._view, self._done, self._n, self._count = view, done, n, count
        self.paths = paths
        self.marks: list[bytes] = []
        self.dirs: list[Dir] = []
        for i in range(n):
            d = done[i]
            if d.kind == _DIR:
                self.dirs.append(Dir(paths[i], d.mode, d.mtime))
            elif d.new_parent:
                self.marks.append(paths[i])

    def finish(self) -> "Batch":
        """The batch's files finished, in C without the GIL, from the bytes the run read
        (never written again: views of the chunks read): the data of those the run left
        open written, their mtimes set and fds closed, and every file hashed; itself, whose
        iteration gives (inode, size, sha256 hex) of each file. OSError (with the path)
        where a file's write failed; every file is finished all the same. Once only."""
        with self._view:
            failed = lib.karotte_extract_finish(ffi.from_buffer(self._view), self._done,
                                                self._n, self._count, 1)
        if failed:
            err = self._done[failed - 1].err
            raise OSError(err, os.strerror(err), self.paths[failed - 1])
        return self

    def __iter__(self) -> Iterator[tuple[int, int, str]]:
        raw = bytes(ffi.buffer(self._done, self._n * _DONE.size))
        for ino, size, _, _, _, _, _, kind, _, sha, _, _ in _DONE.iter_unpack(raw):
            if kind == _FILE:
                yield ino, size, sha.hex()


class Run:
    """The C side of one layer: its budget and counts, kept in C structs between calls.
    defer: files' data written by Batch.finish (which the caller must call on every batch
    with files), not by the run."""

    def __init__(self, budget: Any, root: int, defer: bool):
        self._budget = ffi.new("struct kx_budget *", (
            budget.max_entries, budget.max_bytes, budget.max_file_size, budget.max_depth,
            budget.max_path_bytes))
        self._count = ffi.new("struct kx_count *")
        if defer:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            self._count.open_max = _OPEN_MAX if soft == resource.RLIM_INFINITY else \
                max(0, min(_OPEN_MAX, soft // 4))
        self._chain = ffi.new("struct kx_chain *")
        self._chain.root = root
        self._paths = ffi.new("uint8_t[]", _PATHS)
        self._n = ffi.new("size_t *")
        self._paths_len = ffi.new("size_t *")
        self._need = ffi.new("size_t *")

    def apply(self, view: memoryview, chain: list[tuple[bytes, int]], chown_ids: bool,
              entries: int, read: int, total: int
              ) -> tuple[int, Batch | None, int, int, int, int]:
        """Entries from view below chain (the (name, fd) of each directory from the root
        down, which the C run takes over and which is set to the chain after it, the
        caller's to close, as the run returns); the bytes consumed, what was applied
        (None: nothing), the layer's counts (entries, read, total) after them, and the
        bytes the next entry takes where only its data stopped the run (it was not all in
        view; else 0)."""
        c, count = self._chain, self._count
        path = b"/".join(name for name, _ in chain)
        c.n = len(chain)
        for i, (_, fd) in enumerate(chain):
            c.fds[i] = fd
        c.path_len = len(path)
        ffi.memmove(c.path, path, len(path))
        count.entries, count.read, count.total = entries, read, total
        room = min(_RUN, len(view) // 512)  # an entry takes a block at least
        done = _new("struct kx_done[]", room)  # the batch's own: its hashes come later
        consumed = lib.karotte_extract_run(ffi.from_buffer(view), len(view), c, int(chown_ids),
                                           self._budget, count, done, room, self._n,
                                           self._paths, _PATHS, self._paths_len, self._need)
        path = bytes(ffi.buffer(c.path, c.path_len))
        chain[:] = zip(path.split(b"/") if path else [], (c.fds[i] for i in range(c.n)))
        n, need = self._n[0], self._need[0]
        if not n:
            return consumed, None, count.entries, count.read, count.total, need
        try:
            paths = bytes(ffi.buffer(self._paths, self._paths_len[0] - 1)).split(b"\0")
            batch = Batch(view[:consumed], done, n, paths, count)
        except BaseException:  # the run's open files are written and closed all the same
            with view:
                lib.karotte_extract_finish(ffi.from_buffer(view), done, n, count, 0)
            raise
        return consumed, batch, count.entries, count.read, count.total, need
