"""extract.py's fast path: runs of plain entries (a regular file, a symlink or a new
directory, each in a directory of the chain of the entry before or one the run made)
applied by csrc/extract.c through karotte._native, which stops, consuming nothing of it, at
whatever extract.py must look at itself (csrc/extract.h says what, and why it never does
what extract.py would refuse). The run's files are hashed by a second C call, from the
same bytes, on the thread that keeps the hashes (Batch.hashes). Without the extension (an
interpreter without cffi), AVAILABLE is False and extract.py applies every entry itself.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

try:
    from .._native import ffi, lib
    AVAILABLE = hasattr(lib, "karotte_extract_hash")
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


class Dir(NamedTuple):
    """A directory the run made: its path, and the tar's mode bits and mtime (seconds),
    which extract.py sets when the layer ends."""

    path: bytes
    mode: int
    mtime: int


class Batch:
    """What one call applied: paths (every entry's, in order), marks (the other paths
    whose parent differs from the entry's before: extract.py's holds), dirs (made), and
    the files to hash from the same bytes (hashes())."""

    def __init__(self, view: memoryview, done: Any, n: int, paths: list[bytes]):
        self._view, self._done, self._n = view, done, n
        self.paths = paths
        self.marks: list[bytes] = []
        self.dirs: list[Dir] = []
        for i in range(n):
            d = done[i]
            if d.kind == _DIR:
                self.dirs.append(Dir(paths[i], d.mode, d.mtime))
            elif d.new_parent:
                self.marks.append(paths[i])

    def hashes(self) -> Iterator[tuple[int, int, str]]:
        """(inode, size, sha256 hex) of each file of the batch, in order: hashed here, in
        C without the GIL, from the bytes the run wrote (immutable: views of the chunks
        read)."""
        lib.karotte_extract_hash(ffi.from_buffer(self._view), self._done, self._n)
        for i in range(self._n):
            d = self._done[i]
            if d.kind == _FILE:
                yield d.ino, d.size, bytes(ffi.buffer(d.sha256, 32)).hex()
        self._view.release()


class Run:
    """The C side of one layer: its budget and counts, kept in C structs between calls."""

    def __init__(self, budget: Any, root: int):
        self._budget = ffi.new("struct kx_budget *", (
            budget.max_entries, budget.max_bytes, budget.max_file_size, budget.max_depth,
            budget.max_path_bytes))
        self._count = ffi.new("struct kx_count *")
        self._chain = ffi.new("struct kx_chain *")
        self._chain.root = root
        self._paths = ffi.new("uint8_t[]", _PATHS)
        self._n = ffi.new("size_t *")
        self._paths_len = ffi.new("size_t *")
        self._need = ffi.new("size_t *")

    def apply(self, view: memoryview, chain: list[tuple[bytes, int]], chown_ids: bool,
              entries: int, read: int, total: int
              ) -> tuple[int, Batch | None, list[tuple[bytes, int]], int, int, int, int]:
        """Entries from view below chain (the (name, fd) of each directory from the root
        down, which the call takes over); the bytes consumed, what was applied (None:
        nothing), the chain after it (the caller's to close), the layer's counts
        (entries, read, total) after them, and the bytes the next entry takes where only
        its data stopped the run (it was not all in view; else 0)."""
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
        after = list(zip(path.split(b"/") if path else [], (c.fds[i] for i in range(c.n))))
        n = self._n[0]
        need = self._need[0]
        if not n:
            return consumed, None, after, count.entries, count.read, count.total, need
        paths = bytes(ffi.buffer(self._paths, self._paths_len[0] - 1)).split(b"\0")
        batch = Batch(view[:consumed], done, n, paths)
        return consumed, batch, after, count.entries, count.read, count.total, need
