"""Apply one OCI layer (an uncompressed tar stream) onto a tree, treating the layer as hostile.

apply_layer reads the tar once, in order (the store hashes the same bytes for the config's
diff_ids), and writes each entry into the tree behind a directory fd, hashing each file
as it writes it. manifest (karotte/images/tree.py) lists the tree that results, for the
store's manifest and `image verify`.

Why a layer cannot write outside the tree or plant anything the tree must not hold:
- A name is split into components before anything is touched: an absolute name, a `..`
  component or a NUL byte refuses the image (IMG-TRAVERSAL-01). Nothing is ever opened by
  a joined path.
- Parents are opened component by component from the root fd with
  openat(O_DIRECTORY|O_NOFOLLOW) (karotte/images/treewalk.py): a symlink where a directory
  is needed, planted by an earlier entry or an earlier layer, refuses the image instead of
  redirecting the write (IMG-SYMLINK-01). The final component is made new
  (O_CREAT|O_EXCL|O_NOFOLLOW, mkdirat, symlinkat, linkat): what a lower layer left there
  is unlinked first, fd-relative, so no write ever lands in an inode that was there
  before; a directory over a directory merges, as the OCI layer spec says.
- A hard link must name a regular file already in the tree, found the same way; never a
  directory, a symlink, a name not yet extracted, or anything outside (IMG-HARDLINK-01).
- Character and block devices, FIFOs and any other type refuse the image (IMG-DEVICE-01):
  a tree holds only files, directories and symlinks.
- setuid and setgid bits are stripped, and the sticky bit from files, not refused: images
  made by ordinary tools carry them (/usr/bin/passwd) and enroot strips them the same way
  (tar --mode=u-s,g-s). Directories keep their sticky bit (/tmp is 1777). World-writable
  modes stay as the image says (IMG-SETUID-01).
- No xattr is ever set: `security.*` (file capabilities, SELinux labels) and `trusted.*`
  are dropped, and `user.*` too, since `user.overlay.*` would steer the overlay that mounts
  this tree in a user namespace (IMG-XATTR-01).
- Whiteouts (IMG-WHITEOUT-01), karotte/images/whiteout.py: `.wh.NAME` deletes NAME of the
  lower layers, `.wh..wh..opq` what they put in its directory, keeping what this layer
  adds; a whiteout that would erase its parent or the root, or is malformed, refuses the
  image. AUFS's own metadata at the root is skipped, as Docker skips it; a hard link into
  `.wh..wh.plnk` is then refused as a link to a name not in the tree.
- Budgets (IMG-BOMB-01) are checked from each header before its data is read: entries,
  depth, path bytes, one file's size, the bytes of regular files in the tree after this
  layer (what it frees counts) and the bytes of data read. An extended header (pax, GNU
  long name) over EXTENDED_HEADER_LIMIT and sparse files are refused before they are read
  (karotte/images/tarstream.py reads the tar).
- Every error of the tar reader, and a header with a bad checksum mid-stream (tarfile
  would take it for the end of the archive and silently drop the rest), becomes a
  LayerError (IMG-TAR-01); so does an entry the host cannot write (IMG-WRITE-01). Nothing but
  LayerError comes out of what a tar contains. ids's own exceptions pass through.

Runs of plain entries (a file, a symlink or a new directory in a directory already there) are
applied by csrc/extract.c where karotte._native is built (karotte/images/fastpath.py): it
stops, consuming nothing, at whatever these rules must look at, which is then applied
here; the tree is the same either way (apply_layer's native=False).

Modes and owners: files keep their permission bits (minus setuid, setgid, sticky),
directories what the tar says (minus setuid, setgid), set with fchmod on our own fd;
owners come from ids (fchown, or lchown for symlinks); mtimes from the tar, set on the fd
or with AT_SYMLINK_NOFOLLOW. A directory's mode and mtime are set when the layer ends,
deepest first, so that its own entries can still be written and do not move its mtime.
Run unprivileged, a lower directory without owner rwx is opened up while the layer writes
in it and given its mode back at the end.
"""
from __future__ import annotations

import hashlib
import math
import os
import stat
from dataclasses import dataclass
from typing import BinaryIO, Callable

from ..results import capped, escape
# Re-exported: RULES, LayerError, TreeEntry, manifest (extract's since it began), image_ids.
from .tree import (DIR_FLAGS, RULES, FileHashes, LayerError, TreeEntry, image_ids, join,
                   lstat_at, manifest, sorted_names)
from . import fastpath
from .tarstream import (BLOCKDEV, CHARDEV, DIRECTORY, EXTENDED_HEADER_LIMIT, FIFO, HARDLINK,
                        SYMLINK, Member, TarError, TarReader)
from .treewalk import TreeWalk
from .whiteout import AUFS_META, WHITEOUT, Whiteouts

__all__ = ["LayerError", "LayerBudget", "TreeEntry", "RULES", "EXTENDED_HEADER_LIMIT",
           "apply_layer", "image_ids", "manifest"]

_ENTRY_TEXT_LIMIT = 1024  # bytes of JSON of the entry a LayerError names

# Never follow a link, never leak into a child.
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_MTIME = 9 * 10**9  # seconds: what a signed 64-bit count of nanoseconds holds


@dataclass(frozen=True)
class LayerBudget:
    """Limits of one layer, every one checked as the tar is read."""
    max_entries: int = 1_000_000  # headers of the layer (whiteouts and links included)
    max_bytes: int = 32 << 30  # regular files in the tree after this layer; data read
    max_file_size: int = 8 << 30
    max_depth: int = 64  # components of a name
    max_path_bytes: int = 4096  # of a name, a symlink target or a hard link's target


# What reading a malformed stream raises (ValueError, OverflowError: numbers out of range;
# EOFError: a gzip stream cut short).
_TAR_ERRORS = (TarError, ValueError, OverflowError, EOFError)
_KINDS = {CHARDEV: "a character device", BLOCKDEV: "a block device", FIFO: "a FIFO"}


class _Layer(Whiteouts, TreeWalk):
    """One apply_layer call: the root fd, the budget, and what this layer added."""

    def __init__(self, root_fd: int, budget: LayerBudget,
                 ids: Callable[[int, int], tuple[int, int]] | None,
                 hashes: dict[int, tuple[int, str]] | None, native: bool):
        self.budget, self.ids = budget, ids
        self.hashes = None if hashes is None else FileHashes(hashes)
        self.unprivileged = os.geteuid() != 0
        self.root = os.open(".", DIR_FLAGS, dir_fd=root_fd)  # our own fd and offset
        # Plain entries in C, where it is built and owners are None's or image_ids'.
        # Where hashes are kept, the thread that hashes a run's files writes them too.
        self.fast = fastpath.Run(budget, self.root, defer=self.hashes is not None) if (
            native and fastpath.AVAILABLE and ids in (None, image_ids)) else None
        self.chain: list[tuple[bytes, int]] = []  # open fds of the current entry's parents
        self.raw = b""  # the entry being applied, as the tar names it
        self.entries = 0
        self.read = 0
        self.total = 0
        self.added: set[bytes] = set()  # paths this layer made (a merged directory too)
        self.holds: set[bytes] = set()  # directories with something this layer made below
        self.dirs: dict[bytes, tuple[int, int | None]] = {}  # path: (mode, mtime ns) at end
        mode = stat.S_IMODE(os.fstat(self.root).st_mode)
        if self.unprivileged and mode & 0o700 != 0o700:  # as _open_up does below the root
            self.dirs[b""] = (mode, None)
            os.fchmod(self.root, mode | 0o700)

    def close(self, failing: bool = False) -> None:
        """The layer's fds closed and its hashes in; failing: the layer already raised,
        whose error is the one to report (the hashes' own, if any, is dropped)."""
        try:
            for _, fd in self.chain:
                os.close(fd)
            self.chain.clear()
            os.close(self.root)
        finally:
            if self.hashes is not None:
                try:
                    self.hashes.close()
                except OSError as exc:  # a file's deferred write (Batch.finish)
                    if not failing:
                        raise self.refuse("IMG-WRITE-01", f"{escape(exc.filename)}: "
                                          f"{exc.strerror}") from None
                except BaseException:
                    if not failing:
                        raise

    def refuse(self, rule: str, detail: str) -> LayerError:
        return LayerError(capped(escape(self.raw), _ENTRY_TEXT_LIMIT) if self.raw else
                          "(the layer's first header)", rule, detail)

    # -- the stream

    def run(self, stream: BinaryIO, tree_bytes: int | None) -> None:
        try:
            self.total = self._measure() if tree_bytes is None else tree_bytes
        except OSError as exc:
            raise self.refuse("IMG-WRITE-01", f"measuring the tree: {exc.strerror}") from None
        tar = TarReader(stream)
        # Where the reads are behind, this thread hashes instead of waiting (FileHashes).
        wait = getattr(stream, "while_waiting", None) if self.hashes is not None else None
        if wait is not None:
            wait(self.hashes.help)
        try:
            self._stream(tar)
        finally:
            if wait is not None:
                wait(None)

    def _stream(self, tar: TarReader) -> None:
        while True:
            try:
                if self.fast is not None and tar.plain():
                    self._fast(tar)  # reads on too: the same refusals as next()'s
                member = tar.next()
            except _TAR_ERRORS as exc:
                raise self.refuse("IMG-TAR-01", f"the header after this entry: {exc}"
                                  if self.entries else f"not a tar: {exc}") from None
            if member is None:
                break
            self.raw = member.name
            self.entries += 1
            if self.entries > self.budget.max_entries:
                raise self.refuse("IMG-BOMB-01",
                                  f"more than max_entries={self.budget.max_entries} entries")
            try:
                self._entry(tar, member)
            except OSError as exc:
                raise self.refuse("IMG-WRITE-01", exc.strerror or str(exc)) from None
        try:
            self._finish()
        except OSError as exc:
            raise self.refuse("IMG-WRITE-01", f"at the end of the layer: {exc.strerror}") \
                from None

    def _fast(self, tar: TarReader) -> None:
        """The plain entries that follow, below the chain of the entry before, applied by
        csrc/extract.c (karotte/images/fastpath.py); it leaves the rest to _entry. An
        entry of up to fastpath.GROW bytes whose data is not all read yet is read on
        for, and the run goes on."""
        assert self.fast is not None
        if len(self.chain) > fastpath.CHAIN or \
                sum(len(name) + 1 for name, _ in self.chain) > fastpath.CHAIN_PATH:
            return
        need = 1024
        while need <= fastpath.GROW and tar.more(need):
            view = tar.pending()
            try:  # the chain's fds are the C run's during it: it closes those it leaves
                consumed, batch, self.entries, self.read, self.total, need = \
                    self.fast.apply(view, self.chain, self.ids is not None, self.entries,
                                    self.read, self.total)
            finally:
                view.release()
            tar.consume(consumed)
            if batch is not None:
                self._took(batch)
            if not need:
                return

    def _took(self, batch: fastpath.Batch) -> None:
        """What a C run applied, recorded as _entry records its own; its files finished
        (written, where the run left them open, and hashed) by FileHashes."""
        if self.hashes is not None:
            self.hashes.later(batch.finish)  # first: the run's open files are its to close
        self.added.update(batch.paths)
        for path in batch.marks:
            self._hold(path.rpartition(b"/")[0])
        for d in batch.dirs:
            self.dirs[d.path] = (d.mode & 0o7777 & ~0o6000, d.mtime * 1_000_000_000)
            self._add(d.path)
        self.raw = batch.paths[-1]

    def _parts(self, raw: bytes, rule: str, what: str) -> list[bytes]:
        """raw's components, or a refusal: absolute, '..', NUL, too long, too deep."""
        budget = self.budget
        if b"\0" in raw:
            raise self.refuse(rule, f"{what} holds a NUL byte")
        if len(raw) > budget.max_path_bytes:
            raise self.refuse("IMG-BOMB-01", f"{what} is {len(raw)} bytes "
                                             f"(max_path_bytes={budget.max_path_bytes})")
        if raw.startswith(b"/"):
            raise self.refuse(rule, f"{what} is absolute")
        parts = [p for p in raw.split(b"/") if p not in (b"", b".")]
        if b".." in parts:
            raise self.refuse(rule, f"{what} has a '..' component")
        if len(parts) > budget.max_depth:
            raise self.refuse("IMG-BOMB-01", f"{what} is {len(parts)} components deep "
                                             f"(max_depth={budget.max_depth})")
        return parts

    def _entry(self, tar: TarReader, m: Member) -> None:
        parts = self._parts(self.raw, "IMG-TRAVERSAL-01", "the name")
        if parts and parts[0] in AUFS_META:
            self._count_read(m)  # skipped, but read all the same
            return
        if WHITEOUT in self.raw and any(p.startswith(WHITEOUT) for p in parts[:-1]):
            raise self.refuse("IMG-WHITEOUT-01", "a whiteout name used as a directory")
        if not parts:
            if m.type != DIRECTORY:
                raise self.refuse("IMG-TRAVERSAL-01", "the root of the tree must be a directory")
            self._own(self.root, m)
            self.dirs[b""] = (stat.S_IMODE(m.mode) & ~0o6000, self._mtime(m))
            return
        dirs, name = parts[:-1], parts[-1]
        if name.startswith(WHITEOUT):
            self._whiteout(m, dirs, name)
        elif m.isreg():
            self._file(tar, m, dirs, name)
        elif m.type == DIRECTORY:
            self._dir(m, dirs, name)
        elif m.type == SYMLINK:
            self._symlink(m, dirs, name)
        elif m.type == HARDLINK:
            self._hardlink(m, dirs, name)
        else:
            kind = _KINDS.get(m.type, f"tar type {m.type.decode('latin-1')!r}")
            raise self.refuse("IMG-DEVICE-01", f"{kind} is not allowed in an image")

    # -- budget, owners, times

    def _count_read(self, m: Member) -> None:
        if m.isreg():
            self.read += m.size
            if self.read > self.budget.max_bytes:
                raise self.refuse("IMG-BOMB-01", f"the layer's data exceeds "
                                  f"max_bytes={self.budget.max_bytes}")

    def _own_ids(self, fd: int, uid: int, gid: int) -> None:
        if self.ids is not None:
            try:
                os.fchown(fd, *self.ids(uid, gid))
            except OverflowError as exc:
                raise self.refuse("IMG-TAR-01", f"owner out of range: {exc}") from None

    def _own(self, fd: int, m: Member) -> None:
        self._own_ids(fd, m.uid, m.gid)

    def _mtime(self, m: Member) -> int:
        mtime = m.mtime
        if not isinstance(mtime, (int, float)) or not math.isfinite(mtime) \
                or abs(mtime) > _MAX_MTIME:
            raise self.refuse("IMG-TAR-01", f"mtime {mtime!r} out of range")
        return int(mtime * 1_000_000_000)

    # -- entries

    def _clear(self, parent: int, name: bytes, path: bytes) -> None:
        """Remove what is at name (a lower layer's, or an earlier entry's), fd-relative."""
        st = lstat_at(name, parent)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            self._rmtree(parent, name, path)
        else:
            self._unlink(parent, name, st)

    def _unlink(self, parent: int, name: bytes, st: os.stat_result) -> None:
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            self.total -= st.st_size  # its last link: the bytes are freed
        os.unlink(name, dir_fd=parent)

    def _rmtree(self, parent: int, name: bytes, path: bytes) -> None:
        """Remove the directory name and all below it, never following a link."""
        fd = self._open_dir(parent, name, path)
        stack = [(parent, name, path, fd, sorted_names(fd))]
        try:
            while stack:
                up, dname, dpath, dfd, names = stack[-1]
                if not names:
                    stack.pop()
                    os.close(dfd)
                    os.rmdir(dname, dir_fd=up)
                    continue
                child = names.pop()
                st = lstat_at(child, dfd)
                if st is None:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    cpath = dpath + b"/" + child
                    cfd = self._open_dir(dfd, child, cpath)
                    stack.append((dfd, child, cpath, cfd, sorted_names(cfd)))
                else:
                    self._unlink(dfd, child, st)
        finally:
            for _, _, _, dfd, _ in stack:
                os.close(dfd)

    def _file(self, tar: TarReader, m: Member, dirs: list[bytes],
              name: bytes) -> None:
        budget = self.budget
        if m.size > budget.max_file_size:
            raise self.refuse("IMG-BOMB-01", f"a file of {m.size} bytes "
                              f"(max_file_size={budget.max_file_size})")
        self._count_read(m)
        parent = self._parent(dirs, create=True)
        fd = self._new_file(parent, name) if self.total + m.size <= budget.max_bytes \
            else None
        if fd is None:  # something is there (a lower layer's), or the budget needs its bytes
            self._clear(parent, name, join(dirs, name))
            if self.total + m.size > budget.max_bytes:
                raise self.refuse("IMG-BOMB-01", f"the tree's files would exceed "
                                  f"max_bytes={budget.max_bytes}")
            fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent)
        try:
            self.total += m.size
            self._copy(tar, m, fd)
            self._own(fd, m)
            # IMG-SETUID-01: the permission bits only; chmod after chown, which clears them.
            os.fchmod(fd, stat.S_IMODE(m.mode) & 0o777)
            os.utime(fd, ns=(self._mtime(m),) * 2)
        finally:
            os.close(fd)
        self._add(join(dirs, name))

    @staticmethod
    def _new_file(parent: int, name: bytes) -> int | None:
        """A new file name in parent, or None where a name is there (never followed:
        O_EXCL|O_NOFOLLOW fails on a symlink too)."""
        try:
            return os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent)
        except FileExistsError:
            return None

    def _copy(self, tar: TarReader, m: Member, fd: int) -> None:
        """The member's data into fd, exactly m.size bytes, or a refusal; hashed into
        hashes, if kept."""
        done = 0
        h, hashes = hashlib.sha256(), self.hashes
        try:
            for chunk in tar.data(m.size):
                if hashes is not None:
                    hashes.update(h, m.size, chunk)
                done += len(chunk)
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
        except _TAR_ERRORS as exc:
            raise self.refuse("IMG-TAR-01", f"its data: {exc}") from None
        if done != m.size:
            raise self.refuse("IMG-TAR-01", f"{done} bytes of data where the header says "
                              f"{m.size}")
        if hashes is not None:
            hashes.done(h, m.size, os.fstat(fd).st_ino)

    def _dir(self, m: Member, dirs: list[bytes], name: bytes) -> None:
        parent = self._parent(dirs, create=True)
        path = join(dirs, name)
        st = lstat_at(name, parent)
        if st is None or not stat.S_ISDIR(st.st_mode):
            if st is not None:
                self._unlink(parent, name, st)
            os.mkdir(name, 0o700, dir_fd=parent)
        # else: a directory over a directory merges (OCI), taking this layer's metadata
        fd = self._open_dir(parent, name, path)
        try:
            self._own(fd, m)
        except BaseException:
            os.close(fd)
            raise
        # Kept as the last of the chain: the entries a tar lists after a directory are
        # mostly its own, and the next entry's _parent closes it where they are not.
        self.chain.append((name, fd))
        self.dirs[path] = (stat.S_IMODE(m.mode) & ~0o6000, self._mtime(m))
        self._add(path)

    def _symlink(self, m: Member, dirs: list[bytes], name: bytes) -> None:
        target = m.linkname
        if not target or b"\0" in target:
            raise self.refuse("IMG-TRAVERSAL-01", "a symlink with an empty target or a NUL")
        if len(target) > self.budget.max_path_bytes:
            raise self.refuse("IMG-BOMB-01", f"a symlink target of {len(target)} bytes "
                              f"(max_path_bytes={self.budget.max_path_bytes})")
        mtime = self._mtime(m)
        parent = self._parent(dirs, create=True)
        self._clear(parent, name, join(dirs, name))
        # Kept as the image has it, absolute or not; nothing here ever follows it.
        os.symlink(target, name, dir_fd=parent)
        if self.ids is not None:
            try:
                os.chown(name, *self.ids(m.uid, m.gid), dir_fd=parent, follow_symlinks=False)
            except OverflowError as exc:
                raise self.refuse("IMG-TAR-01", f"owner out of range: {exc}") from None
        os.utime(name, ns=(mtime, mtime), dir_fd=parent, follow_symlinks=False)
        self._add(join(dirs, name))

    def _hardlink(self, m: Member, dirs: list[bytes], name: bytes) -> None:
        raw = m.linkname
        what = f"the hard link's target {escape(raw)}"
        tparts = self._parts(raw, "IMG-HARDLINK-01", what)
        if not tparts:
            raise self.refuse("IMG-HARDLINK-01", f"{what} is the root")
        if tparts == [*dirs, name]:
            raise self.refuse("IMG-HARDLINK-01", f"{what} is the link itself")
        tparent = self._reopen(tparts[:-1])
        if tparent is None:
            raise self.refuse("IMG-HARDLINK-01", f"{what} is not in the tree (yet), or its "
                              "path has a symlink or a non-directory (never followed)")
        try:
            st = lstat_at(tparts[-1], tparent)
            if st is None:
                raise self.refuse("IMG-HARDLINK-01", f"{what} is not in the tree (yet)")
            if not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else \
                    "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise self.refuse("IMG-HARDLINK-01", f"{what} is {kind}")
            parent = self._parent(dirs, create=True)
            self._clear(parent, name, join(dirs, name))
            # linkat without AT_SYMLINK_FOLLOW, from our fd of the target's directory.
            os.link(tparts[-1], name, src_dir_fd=tparent, dst_dir_fd=parent,
                    follow_symlinks=False)
        finally:
            os.close(tparent)
        self._add(join(dirs, name))

def apply_layer(stream: BinaryIO, root_fd: int, *, budget: LayerBudget = LayerBudget(),
                ids: Callable[[int, int], tuple[int, int]] | None = None,
                hashes: dict[int, tuple[int, str]] | None = None,
                tree_bytes: int | None = None, native: bool = True) -> int:
    """Apply one uncompressed layer tar read from stream (once, in order) onto the tree
    whose root directory fd is root_fd; root_fd is not closed.

    ids maps an entry's (uid, gid) to the host owner to chown it to (None: everything
    stays the caller's own). Raises LayerError, naming the entry and the rule, for
    anything the tar holds that the module docstring refuses; the tree is then partly
    written: discard it. Reading stops at the tar's end-of-archive marker: a caller that
    hashes the stream reads what follows itself.

    hashes, if given, gets (size, sha256 hex) of each file written, by inode: what
    manifest(root_fd, hashes) takes instead of reading the files again.

    Returns the bytes of the regular files in the tree after the layer (each inode once),
    which the next layer's call may take as tree_bytes instead of measuring the tree.

    native: runs of plain entries (files, symlinks and new directories in directories
    already there) go to csrc/extract.c where the extension is built and ids is None or
    image_ids; False applies every entry here (the tree is the same).
    """
    layer = _Layer(root_fd, budget, ids, hashes, native)
    try:
        layer.run(stream, tree_bytes)
    except BaseException:
        layer.close(failing=True)
        raise
    layer.close()
    return layer.total
