"""A tree of the store behind a directory fd, never following a link: what a tree may
hold (RULES, whose refusals are LayerError), the fd helpers extraction walks it with, and
its manifest (TreeEntry per path; manifest.jsonl, which `image verify` checks again).

The manifest is measured with lstat and read through O_NOFOLLOW fds. A file extraction
wrote and hashed as it wrote it (apply_layer's `hashes`, by inode) is not read again: the
store's own tmp/ tree has no other writer, and an inode whose size is not the one hashed
is read like any other.
"""
from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from ..errors import KarotteError
from ..results import escape

__all__ = ["LayerError", "TreeEntry", "RULES", "manifest", "manifest_file", "manifest_text",
           "entry_dict"]

try:
    from .._native import ffi as _ffi, lib as _lib
    NATIVE = hasattr(_lib, "karotte_tree_walk")
except ImportError:  # the system Python of an unprivileged import, without cffi
    _ffi = _lib = None
    NATIVE = False
_KT_FILE, _KT_SYMLINK = 0, 1  # csrc/tree.h's KT_FILE, KT_SYMLINK (KT_DIR: the rest)
_MAX_DEPTH = 4096  # csrc/tree.c's MAX_DEPTH: a deeper tree is refused (ELOOP)
# struct kt_entry as csrc/tree.h lays it out: ino, size, mode, uid, gid, kind, path_off,
# path_len, target_off, target_len, hashed, sha256, then the compiler's padding.
_PLAIN_TEXT = re.compile(rb"[\x20-\x5b\x5d-\x7e]*")  # what results.escape keeps as it is
_ENTRY = struct.Struct("=QqIIIIIIIII32s" + (
    f"{_ffi.sizeof('struct kt_entry') - 84}x" if NATIVE else ""))

RULES = {
    "IMG-TRAVERSAL-01": "a name must stay inside the tree: no absolute name, no '..', "
                        "no NUL, parents must be directories",
    "IMG-SYMLINK-01": "no write through a symlink an earlier entry or layer planted",
    "IMG-HARDLINK-01": "a hard link must name a regular file already in the tree",
    "IMG-DEVICE-01": "only files, directories, symlinks and hard links: no device, FIFO "
                     "or other type",
    "IMG-WHITEOUT-01": "a whiteout is an empty regular file that deletes one name of the "
                       "lower layers, never its parent or the root",
    "IMG-BOMB-01": "every size and count within the layer budget",
    "IMG-TAR-01": "the layer must be a well-formed tar",
    "IMG-WRITE-01": "the entry must be writable into the tree",
    "IMG-TREE-01": "a tree holds only files, directories and symlinks",
}

# Never follow a link, never leak into a child.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# manifest's reads: O_NONBLOCK and O_NOCTTY, should anything but a file ever be there.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CHUNK = 1 << 20

# What extraction hashed as it wrote: inode -> (size, sha256 hex).
Hashes = Mapping[int, "tuple[int, str]"]


class LayerError(KarotteError):
    """A layer entry refused. ``entry`` is its path as the tar names it, escaped (as
    karotte.results.escape does); ``rule`` the attack id of RULES it broke; ``detail`` what
    was found. The image is refused as a whole."""

    def __init__(self, entry: str, rule: str, detail: str):
        super().__init__(f"layer entry {entry} refused by {rule} ({RULES[rule]}): {detail}; "
                         "the image is refused: rebuild it without this entry")
        self.entry, self.rule, self.detail = entry, rule, detail


@dataclass(frozen=True)
class TreeEntry:
    """One path of the final tree, as manifest measures it (never following a link).
    ``path`` is relative to the root ("." is the root) and escaped as karotte.results.escape
    does, as is ``target``; ``mode`` the permission bits (S_IMODE); ``size`` 0 for a
    directory, the target's length for a symlink."""
    path: str
    type: str  # "file" | "dir" | "symlink": nothing else exists in a tree
    mode: int
    uid: int
    gid: int
    size: int
    sha256: str | None  # files only
    target: str | None  # symlinks only, kept as is, never followed


class FileHashes:
    """The sha256 of each file extraction writes, into hashes (inode -> (size, hex)) when
    the layer is done (close), in the order the files were written (an inode freed and
    used again takes the later file's hash).

    The C run's files (later: each run finished whole, its deferred writes too, by one
    call) and a file of LARGE bytes or more (update: chunk by chunk) are done by a thread
    of its own beside the extraction: the C calls and sha256 release the GIL, and the data
    is never written again once read, so the views need no copy. A smaller file written
    here is hashed at once, where a thread's hand-over would cost more than the hash. The
    thread runs no Python per file: it keeps what each call gives, and close() reads them
    into hashes, so it does not hold the GIL that the extracting thread takes back after
    each of its C calls.

    At most _QUEUED items wait, each a view that keeps its read buffer alive (1 MiB, up to
    fastpath.GROW more after reading on for an entry). The extracting thread never waits
    while a run waits: where the queue is full, the reads are behind (help) or the layer
    ends, it takes the oldest run and does it itself. A layer of small files leaves the
    other core idle and one of large files leaves this one idle; either thread may take
    any run. The chunks of one large file stay in order, on the thread."""

    LARGE = 16 << 10
    _QUEUED = 32

    def __init__(self, hashes: dict[int, tuple[int, str]]):
        self.hashes = hashes
        # ("run", files, box) or ("update", hashlib object, view); None: the end.
        self._items: collections.deque[tuple[Any, ...] | None] = collections.deque()
        self._changed = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # In order, appended by the extracting thread only: (inode, size, hashlib object),
        # or a run's box, which gets what its files() gave once it ran.
        self._results: list[Any] = []

    def _start(self) -> None:
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="karotte-file-hash",
                                      daemon=True)
            thread.start()
            self._thread = thread  # only once it runs: close() joins it

    def _put(self, item: tuple[Any, ...] | None) -> None:
        self._start()
        while len(self._items) >= self._QUEUED and self.help():
            pass
        with self._changed:
            while len(self._items) >= self._QUEUED and item is not None:
                self._changed.wait()  # only chunks of large files wait: the thread's
            self._items.append(item)
            self._changed.notify_all()

    def update(self, h: Any, size: int, view: memoryview) -> None:
        if size < self.LARGE:
            h.update(view)
            return
        self._put(("update", h, view))

    def done(self, h: Any, size: int, ino: int) -> None:
        """The file of h ends (its digest is read in close, after the thread's updates)."""
        self._results.append((ino, size, h))

    def later(self, files: Callable[[], Iterable[tuple[int, int, str]]]) -> None:
        """Files done on the thread (or here), in order with the rest: files() finishes
        them and gives what close() reads (inode, size, sha256 hex) of each from."""
        box: list[Any] = []
        self._results.append(box)
        item = ("run", files, box)
        try:
            self._put(item)
        except BaseException:  # no thread, or interrupted: the run may hold open files
            with self._changed:
                queued = any(i is item for i in self._items)
            if not queued:
                self._do(item)
            raise

    def help(self) -> bool:
        """The oldest waiting run taken and done here, in the extracting thread; whether
        there was one. Every run is run, an error before it or not: a run's files may be
        open, its to close. What it raises is raised by close()."""
        with self._changed:
            for i, item in enumerate(self._items):
                if item is not None and item[0] == "run":
                    del self._items[i]
                    self._changed.notify_all()
                    break
            else:
                return False
        self._do(item)
        return True

    def _do(self, item: tuple[Any, ...]) -> None:
        try:
            if item[0] == "run":
                item[2].append(item[1]())
            elif self._error is None:
                item[1].update(item[2])
        except BaseException as exc:  # raised by close(), in the extracting thread
            if self._error is None:
                self._error = exc

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._items:
                    self._changed.wait()
                item = self._items.popleft()
                self._changed.notify_all()
            if item is None:
                return
            self._do(item)

    def close(self) -> None:
        """Every hash queued, done and in hashes; what the thread raised, raised here."""
        while self.help():  # the layer's last runs, on both threads
            pass
        if self._thread is not None:
            self._put(None)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            self._results.clear()
            raise error
        hashes = self.hashes
        for result in self._results:
            if isinstance(result, tuple):
                hashes[result[0]] = (result[1], result[2].hexdigest())
            else:  # an empty box: its run raised; the manifest's walk hashes its files
                for ino, size, digest in (result[0] if result else ()):
                    hashes[ino] = (size, digest)
        self._results.clear()


def image_ids(uid: int, gid: int) -> tuple[int, int]:
    """The image's own ids, those of 65536 and over becoming nobody (65534): the store's
    owners as root, which csrc/extract.c gives plain entries itself."""
    return (uid if uid < 65536 else 65534, gid if gid < 65536 else 65534)


def lstat_at(name: bytes, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def sorted_names(fd: int) -> list[bytes]:
    return sorted(os.fsencode(n) for n in os.listdir(fd))


def join(dirs: list[bytes] | tuple[bytes, ...], name: bytes) -> bytes:
    return b"/".join((*dirs, name))


def manifest(root_fd: int, hashes: Hashes | None = None) -> tuple[TreeEntry, ...]:
    """Every path of the tree under root_fd, the root (".") first, then depth first with
    names in byte order; measured with lstat, files read through O_NOFOLLOW fds whose
    fstat must match (unless hashes, from the extraction that wrote them, has the inode
    at that size). Raises LayerError (IMG-TREE-01) for anything that is not a file,
    directory or symlink, or a path that changed while it was measured. Walked by
    csrc/tree.c where karotte._native is built (the tests compare it with the walk here)."""
    if NATIVE:
        with _walk(root_fd, hashes or {}) as (t, text):
            return _entries(t, text)
    return _manifest_python(root_fd, hashes or {})


def manifest_file(root_fd: int, hashes: Hashes | None = None) -> tuple[str, int]:
    """manifest_text(manifest(root_fd, hashes)) and the bytes of the tree's files: the
    store's build of a tree writes only these, which csrc/tree.c writes in one call, but
    for the lines whose names need escaping (written here)."""
    if not NATIVE:
        entries = _manifest_python(root_fd, hashes or {})
        return manifest_text(entries), sum(e.size for e in entries if e.type == "file")
    with _walk(root_fd, hashes or {}) as (t, text):
        length, files = _ffi.new("size_t *"), _ffi.new("int64_t *")
        odd, n_odd = _ffi.new("uint32_t[]", max(t.n, 1)), _ffi.new("size_t *")
        out = _lib.karotte_tree_text(t, length, files, odd, n_odd)
        if out == _ffi.NULL:
            raise MemoryError("the manifest's text")
        try:
            lines = bytes(_ffi.buffer(out, length[0])).decode("ascii")
        finally:
            _lib.karotte_tree_text_free(out)
        if n_odd[0]:
            raw = _ffi.buffer(t.entries, t.n * _ENTRY.size)
            escaped = [manifest_text((_entry(_ENTRY.unpack_from(raw, i * _ENTRY.size), text,
                                              None),)) for i in odd[0:n_odd[0]]]
            parts = lines.split("\0")
            lines = "".join(p + e for p, e in zip(parts, escaped)) + parts[-1]
        return lines, files[0]


@contextlib.contextmanager
def _walk(root_fd: int, hashes: Hashes) -> Iterator[tuple[Any, bytes]]:
    """csrc/tree.c's walk of the tree (its struct kt_tree, valid inside the block, and its
    text), hashes passed to it as known; the refusals manifest raises."""
    inos = sorted(hashes)
    known = array.array("q")
    for ino in inos:
        known.extend((ino, hashes[ino][0]))
    digests = b"".join(bytes.fromhex(hashes[ino][1]) for ino in inos)
    t = _ffi.new("struct kt_tree *")
    try:
        rc = _lib.karotte_tree_walk(root_fd, _ffi.from_buffer("int64_t[]", known)
                                    if inos else _ffi.NULL, digests, len(inos), t)
        text = bytes(_ffi.buffer(t.text, t.len)) if t.len else b""
        if rc < 0 and t.err == errno.ELOOP:
            raise LayerError(".", "IMG-TREE-01", f"deeper than {_MAX_DEPTH} directories")
        if rc < 0:
            raise OSError(t.err, f"listing the tree for its manifest: {os.strerror(t.err)}")
        if rc == 1:  # the path that stopped the walk follows the entries
            bad = _ENTRY.unpack(bytes(_ffi.buffer(t.entries + t.n, _ENTRY.size)))
            raise LayerError(escape(text[bad[6]:bad[6] + bad[7]]), "IMG-TREE-01",
                             "changed while measured" if t.changed else
                             f"file type {t.bad_type:#o} in the tree")
        yield t, text
    finally:
        _lib.karotte_tree_free(t)


def _entries(t: Any, text: bytes) -> tuple[TreeEntry, ...]:
    rows = _ENTRY.iter_unpack(bytes(_ffi.buffer(t.entries, t.n * _ENTRY.size)))
    # Names and targets that are all printable ASCII (most trees) are their own escape:
    # sliced from the text decoded once.
    names: Any = text.decode("ascii") if _PLAIN_TEXT.fullmatch(text) else None
    return tuple(_entry(row, text, names) for row in rows)


def _entry(row: tuple, text: bytes, names: str | None) -> TreeEntry:
    """A struct kt_entry as the TreeEntry it is; names: text decoded, if all plain."""
    ino, size, mode, uid, gid, kind, po, pl, to, tl, hashed, sha = row
    path = (names[po:po + pl] if names is not None else escape(text[po:po + pl])) \
        if pl else "."
    if kind == _KT_FILE:
        return TreeEntry(path, "file", mode, uid, gid, size, sha.hex(), None)
    if kind == _KT_SYMLINK:
        return TreeEntry(path, "symlink", mode, uid, gid, size, None,
                         names[to:to + tl] if names is not None else escape(text[to:to + tl]))
    return TreeEntry(path, "dir", mode, uid, gid, 0, None, None)


def _manifest_python(root_fd: int, hashes: Hashes) -> tuple[TreeEntry, ...]:
    out: list[TreeEntry] = []
    root = os.open(".", DIR_FLAGS, dir_fd=root_fd)
    st = os.fstat(root)
    out.append(TreeEntry(".", "dir", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, 0,
                         None, None))
    stack: list[tuple[int, bytes, list[bytes]]] = [(root, b"", sorted_names(root)[::-1])]
    try:
        while stack:
            fd, dpath, todo = stack[-1]
            if not todo:
                stack.pop()
                os.close(fd)
                continue
            name = todo.pop()
            path = dpath + b"/" + name if dpath else name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            common = (escape(path), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISDIR(st.st_mode):
                cfd = os.open(name, DIR_FLAGS, dir_fd=fd)
                if os.fstat(cfd).st_ino != st.st_ino:
                    os.close(cfd)
                    raise LayerError(escape(path), "IMG-TREE-01", "changed while measured")
                stack.append((cfd, path, sorted_names(cfd)[::-1]))
                out.append(TreeEntry(common[0], "dir", *common[1:], 0, None, None))
            elif stat.S_ISLNK(st.st_mode):
                target = escape(os.readlink(name, dir_fd=fd))
                out.append(TreeEntry(common[0], "symlink", *common[1:], st.st_size, None,
                                     target))
            elif stat.S_ISREG(st.st_mode):
                known = hashes.get(st.st_ino)
                digest = known[1] if known is not None and known[0] == st.st_size else \
                    _sha256(fd, name, path, st)
                out.append(TreeEntry(common[0], "file", *common[1:], st.st_size, digest,
                                     None))
            else:
                raise LayerError(escape(path), "IMG-TREE-01",
                                 f"file type {stat.S_IFMT(st.st_mode):#o} in the tree")
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return tuple(out)


def _sha256(dir_fd: int, name: bytes, path: bytes, st: os.stat_result) -> str:
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        if (os.fstat(fd).st_ino, os.fstat(fd).st_size) != (st.st_ino, st.st_size):
            raise LayerError(escape(path), "IMG-TREE-01", "changed while measured")
        h = hashlib.sha256()
        while chunk := os.read(fd, CHUNK):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


# A manifest entry's fields read straight off it: dataclasses.asdict deep-copies every
# value, which for a tree of 20,000 paths took 0.1 s of each import (scripts/bench_images.py).
_ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(TreeEntry))


def entry_dict(entry: TreeEntry) -> dict:
    return {name: getattr(entry, name) for name in _ENTRY_FIELDS}


def manifest_text(entries: tuple[TreeEntry, ...]) -> str:
    """manifest.jsonl: one JSON object per entry, keys sorted, exactly as
    json.dumps(entry_dict(e), sort_keys=True) writes it, formatted here: json.dumps per
    entry took 0.1 s of an import of 20,000 paths (scripts/bench_images.py)."""
    return "".join(
        f'{{"gid": {e.gid}, "mode": {e.mode}, "path": {_json(e.path)}, "sha256": '
        f'{_json_or_null(e.sha256)}, "size": {e.size}, "target": {_json_or_null(e.target)}, '
        f'"type": {_json(e.type)}, "uid": {e.uid}}}\n' for e in entries)


_json = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str


def _json_or_null(text: str | None) -> str:
    return "null" if text is None else _json(text)
