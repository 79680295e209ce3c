"""extract.py's fast path: runs of plain entries (a regular file or a symlink in the
directory of the entry before) applied by csrc/extract.c through karotte._native, which
stops, consuming nothing of it, at whatever extract.py must look at itself (csrc/extract.h
says what, and why it never does what extract.py would refuse). Without the extension (an
interpreter without cffi), AVAILABLE is False and extract.py applies every entry itself.
"""
from __future__ import annotations

from typing import Any, NamedTuple

try:
    from .._native import ffi, lib
    AVAILABLE = hasattr(lib, "karotte_extract_run")
except ImportError:  # the system Python of an unprivileged import, without cffi
    ffi = lib = None
    AVAILABLE = False

_RUN = 4096  # entries applied per call at most


class Done(NamedTuple):
    """One entry the C run applied: its last component, and for a file its inode, size
    and sha256 (hex)."""

    name: bytes
    ino: int
    size: int
    sha256: str | None


class Run:
    """The C side of one layer: its budget and counts, kept in C structs between calls."""

    def __init__(self, budget: Any, entries: int, read: int, total: int):
        self._budget = ffi.new("struct kx_budget *", (
            budget.max_entries, budget.max_bytes, budget.max_file_size, budget.max_depth,
            budget.max_path_bytes))
        self._count = ffi.new("struct kx_count *", (entries, read, total))
        self._done = ffi.new("struct kx_done[]", _RUN)
        self._n = ffi.new("size_t *")

    def apply(self, view: memoryview, dir_fd: int, dir_path: bytes, chown_ids: bool,
              entries: int, read: int, total: int) -> tuple[int, list[Done], int, int, int]:
        """Entries from view into dir_fd (the directory dir_path): the bytes consumed, the
        entries applied, and the layer's counts (entries, read, total) after them."""
        count = self._count
        count.entries, count.read, count.total = entries, read, total
        buf = ffi.from_buffer(view)
        consumed = lib.karotte_extract_run(buf, len(view), dir_fd, dir_path, len(dir_path),
                                           int(chown_ids), self._budget, count, self._done,
                                           _RUN, self._n)
        done = []
        for i in range(self._n[0]):
            d = self._done[i]
            name = bytes(view[d.name_off:d.name_off + d.name_len])
            done.append(Done(name, d.ino, d.size, bytes(ffi.buffer(d.sha256, 32)).hex())
                        if d.is_file else Done(name, 0, 0, None))
        return consumed, done, count.entries, count.read, count.total
