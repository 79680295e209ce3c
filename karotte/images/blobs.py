"""The store's files: blobs read, hashed and (where kept) copied in by a thread of their
own, ahead of the extraction of what it read, and the small file steps of the store
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
from typing import IO, Any, Callable, Iterator

from .tree import CHUNK

try:
    from .._native import ffi as _ffi, lib as _lib
    _POOLED = _ffi.new_allocator(alloc=_lib.karotte_chunk_alloc, free=_lib.karotte_chunk_free,
                                 should_clear_after_alloc=False) \
        if hasattr(_lib, "karotte_chunk_alloc") else None
except ImportError:  # the system Python of an unprivileged import, without cffi
    _POOLED = None

_AHEAD = 8  # chunks read ahead of the importing thread at most (each 1 MiB and HEAD)
HEAD = 64 << 10  # room before each chunk read, for what the reader had left of the one before


def chunk_buffer(size: int) -> Any:
    """A new writable buffer of size bytes for one read: a block of csrc/chunks.c's pool
    where the extension is built (kept for the next once the last view of it is gone,
    while pooled() is held; its bytes are not zeroed, and only those a read wrote are ever
    viewed), else a bytearray."""
    if _POOLED is None:
        return bytearray(size)
    return _ffi.buffer(_POOLED("uint8_t[]", size))


@contextlib.contextmanager
def pooled() -> Iterator[None]:
    """The chunk pool held for the block (an import's layers): chunk_buffer()s freed inside
    it are kept for the next; when the last holder lets go, the kept ones are unmapped."""
    if _POOLED is None:
        yield
        return
    _lib.karotte_chunk_hold()
    try:
        yield
    finally:
        _lib.karotte_chunk_release()


class BlobCopy:
    """A blob read from its source by a thread of its own, chunk by chunk, each hashed and
    (unless path is None) written to path (new), then handed to the importing thread
    (get): the read, sha256 and write(2) release the GIL and run beside the extraction of
    the chunks read before. Each chunk is a new buffer (chunk_buffer) with HEAD bytes of
    room before it, never written again by this thread once handed on. finish() is the
    blob's digest, its data synced, once every chunk was taken."""

    def __init__(self, path: str | None):
        self.path = path
        self._fd = -1 if path is None else os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._sha = hashlib.sha256()
        self._out: queue.Queue[tuple[Any, int] | None] = queue.Queue(_AHEAD)
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, src: IO[bytes]) -> None:
        """Read src from where it is to its end (the thread's from now on)."""
        self._thread = threading.Thread(target=self._run, args=(src,),
                                        name="karotte-blob-read", daemon=True)
        self._thread.start()

    def _run(self, src: IO[bytes]) -> None:
        try:
            while not self._stopping:
                buf = chunk_buffer(HEAD + CHUNK)
                with memoryview(buf) as view:
                    n = src.readinto(view[HEAD:])
                    if not n:
                        break
                    data = view[HEAD:HEAD + n]
                    self._sha.update(data)
                    while self._fd >= 0 and data:
                        data = data[os.write(self._fd, data):]
                self._out.put((buf, n))
        except BaseException as exc:  # raised by get() or finish(), in the importing thread
            self._error = exc
        finally:
            self._out.put(None)

    def get(self) -> tuple[Any, int] | None:
        """The next chunk read (its buffer, and its bytes after HEAD); None at the end."""
        item = self._out.get()
        if item is None:
            self._out.put(None)  # the end stays the end
            if self._error is not None:
                raise self._error
        return item

    def behind(self) -> bool:
        """Whether no chunk is read and waiting (get() would wait)."""
        return self._out.empty()

    def finish(self) -> str:
        """The digest of the whole blob ("sha256:<hex>"), every byte of it on disk."""
        self._join()
        if self._error is not None:
            raise self._error
        if self._fd >= 0:
            os.fsync(self._fd)
        return "sha256:" + self._sha.hexdigest()

    def _join(self) -> None:
        if self._thread is not None:
            while self._thread.is_alive():  # taken, so that a waiting put goes on
                with contextlib.suppress(queue.Empty):
                    self._out.get(timeout=0.05)
            self._thread.join()

    def close(self) -> None:
        self._stopping = True
        self._join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Tee:
    """A read-only stream of src, read in whole chunks, whose every byte also goes through
    copy (if any: its thread reads ahead, hashes and copies; else read here): the caller
    reads what it needs, and drain() reads the rest (a blob is hashed whole).
    progress(done, total) hears of each chunk taken.

    take() is what extract's TarReader reads with: the next chunk with what the reader had
    left of the last before it, in one buffer without copying the chunk."""

    def __init__(self, src: IO[bytes], copy: BlobCopy | None,
                 progress: Callable[[int, int | None], None], total: int | None):
        self._src, self._copy = src, copy
        self._progress, self._total, self._done = progress, total, 0
        self._buf = memoryview(b"")
        self._work: Callable[[], bool] | None = None
        self._kept: tuple[Any, int, int] | None = None  # take(): a chunk's rest, unjoined
        if copy is not None:
            copy.start(src)

    def while_waiting(self, work: Callable[[], bool] | None) -> None:
        """work() is called, while it says it did something, where the next chunk is not
        read yet (instead of waiting for it at once); None: none."""
        self._work = work

    def _next(self) -> tuple[Any, int] | None:
        if self._copy is not None:
            work = self._work
            while work is not None and self._copy.behind() and work():
                pass
            item = self._copy.get()
        else:
            buf = chunk_buffer(HEAD + CHUNK)
            with memoryview(buf) as view:
                n = self._src.readinto(view[HEAD:])
            item = (buf, n) if n else None
        if item is not None:
            self._done += item[1]
            self._progress(self._done, self._total)
        return item

    def take(self, rest: memoryview, want: int = 0) -> memoryview | None:
        """rest, then what follows it, as one read-only view (None at the end), of want
        bytes at least where the stream has them (0: any). Nothing of a chunk is copied
        where rest fits in the room before it; where rest does not (an entry that did not
        fit in the chunk before), rest and only as much of the chunk as want and HEAD more
        take are copied, and the chunk's other bytes are the next take's, which follow the
        end of this view in the chunk itself."""
        assert not self._buf, "take() after read(): one way of reading per stream"
        if self._kept is not None:
            buf, at, end = self._kept  # buf's bytes [at, end): the next after the join
            self._kept = None
            if len(rest) <= at - HEAD:  # rest: the stream's bytes just before at, in buf too
                return memoryview(buf)[at - len(rest):end].toreadonly()
            return self._join(rest, buf, at, end, want)
        item = self._next()
        if item is None:
            return None
        buf, n = item
        if len(rest) <= HEAD:
            buf[HEAD - len(rest):HEAD] = rest
            return memoryview(buf)[HEAD - len(rest):HEAD + n].toreadonly()
        return self._join(rest, buf, HEAD, HEAD + n, want)

    def _join(self, rest: memoryview, buf: Any, at: int, end: int, want: int) -> memoryview:
        upto = min(end, at + max(want - len(rest), 0) + HEAD)
        if upto < end:
            self._kept = (buf, upto, end)
        return memoryview(bytes(rest) + memoryview(buf)[at:upto])

    def _fill(self) -> bool:
        item = self._next()
        if item is None:
            return False
        chunk = memoryview(item[0])[HEAD:HEAD + item[1]].toreadonly()
        self._buf = memoryview(bytes(self._buf) + chunk) if self._buf else chunk
        return True

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            out = [bytes(self._buf)]
            self._buf = memoryview(b"")
            while self._fill():
                out.append(bytes(self._buf))
                self._buf = memoryview(b"")
            return b"".join(out)
        if not self._buf and not self._fill():
            return b""
        out = self._buf[:n]
        self._buf = self._buf[len(out):]
        return bytes(out)

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        self._buf = memoryview(b"")
        self._kept = None
        while self._next() is not None:
            pass


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
