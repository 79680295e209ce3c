"""The store's files: blobs copied in and hashed as they come (by a thread of their own,
so that a layer is extracted while it is copied), and the small file steps of the store
(records written whole and synced, a tree removed whatever its modes, syncfs).

A blob is written to the store's tmp/ and renamed into blobs/sha256/<hex> only once its
sha256 is known and matches what named it; the caller refuses the image otherwise.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import queue
import shutil
import stat
import threading
from typing import IO, Any, Callable

from .tree import CHUNK

_QUEUED = 32  # chunks in flight to the copy thread at most (each keeps its read buffer: 1-5 MiB)


class BlobCopy:
    """A blob being written to path (new; None: only hashed) by a thread that hashes and
    writes each chunk put to it, in order: sha256 and write(2) release the GIL, so the
    copy runs beside the extraction that reads the same chunks. finish() is the blob's
    digest, its data synced."""

    def __init__(self, path: str | None):
        self.path = path
        self._fd = -1 if path is None else os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._sha = hashlib.sha256()
        self._queue: queue.Queue[bytes | None] = queue.Queue(_QUEUED)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="karotte-blob-copy", daemon=True)
        self._thread.start()

    def put(self, chunk: bytes) -> None:
        if self._error is None:
            self._queue.put(chunk)

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                self._sha.update(chunk)
                view = memoryview(chunk) if self._fd >= 0 else b""
                while view:
                    view = view[os.write(self._fd, view):]
            except BaseException as exc:  # raised by finish(), in the importing thread
                self._error = exc

    def finish(self) -> str:
        """The digest of what was put ("sha256:<hex>"), every byte of it on disk."""
        self._stop()
        if self._error is not None:
            raise self._error
        if self._fd >= 0:
            os.fsync(self._fd)
        return "sha256:" + self._sha.hexdigest()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self) -> None:
        self._stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Tee:
    """A read-only stream of src, read in whole chunks, whose every byte also goes to copy
    (if any): the caller reads what it needs, and drain() reads the rest (a blob is hashed
    whole). progress(done, total) hears of each chunk read.

    readinto reads src straight into the caller's buffer and hands copy a view of it: the
    caller must never write into that buffer again (extract's TarReader fills a new one
    each time), as the copy thread may still be reading it."""

    def __init__(self, src: IO[bytes], copy: BlobCopy | None,
                 progress: Callable[[int, int | None], None], total: int | None):
        self._src, self._copy = src, copy
        self._progress, self._total, self._done = progress, total, 0
        self._buf = memoryview(b"")

    def peek(self, n: int) -> bytes:
        if len(self._buf) < n:
            self._fill()
        return bytes(self._buf[:n])

    def _got(self, chunk: Any) -> None:
        if self._copy is not None:
            self._copy.put(chunk)
        self._done += len(chunk)
        self._progress(self._done, self._total)

    def _fill(self) -> bool:
        chunk = self._src.read(CHUNK)
        if not chunk:
            return False
        self._got(chunk)
        self._buf = memoryview(bytes(self._buf) + chunk) if self._buf else memoryview(chunk)
        return True

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            out = bytes(self._buf)
            self._buf = memoryview(b"")
            while chunk := self._src.read(CHUNK):
                self._got(chunk)
                out += chunk
            return out
        if not self._buf and not self._fill():
            return b""
        out = self._buf[:n]
        self._buf = self._buf[len(out):]
        if len(out) == len(out.obj):  # a whole chunk read: itself, not a copy of it
            return out.obj  # type: ignore[return-value]
        return bytes(out)

    def readinto(self, buffer: Any) -> int:
        if not self._buf:
            n = self._src.readinto(buffer)
            if n:
                with memoryview(buffer) as view:
                    self._got(view[:n].toreadonly())
            return n or 0
        n = min(len(buffer), len(self._buf))
        buffer[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        self._buf = memoryview(b"")
        while self._fill():
            self._buf = memoryview(b"")


def write_file(path: str, text: str) -> None:
    with open(path, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: str) -> None:
    """Flush the one filesystem that holds path (syncfs(2)); os.sync would flush every
    filesystem of the host, and wait for all of them."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs of {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def remove(path: str) -> int:
    """Remove a tree that may hold directories without write or search permission (an
    image's own modes); the bytes of the regular files it held."""
    freed = 0
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return st.st_size
    for dirpath, dirnames, filenames in os.walk(path, topdown=True):
        os.chmod(dirpath, 0o700)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                with contextlib.suppress(OSError):
                    os.chmod(full, 0o700)
        for f in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                if stat.S_ISREG(st.st_mode):
                    freed += st.st_size
    shutil.rmtree(path, onerror=_raise_unless_gone)
    return freed


def _raise_unless_gone(function: Callable, path: str, exc_info: Any) -> None:
    exc = exc_info[1]
    if not (isinstance(exc, OSError) and exc.errno == errno.ENOENT):
        raise exc
