"""Custody scan: walk the agent's workspace inode by inode and copy what passes.

After the sandbox is killed (D1), the host holds a directory fd of the agent's
/workspace tmpfs. scan_and_copy walks it relative to that fd and copies every
accepted regular file and directory into a fresh host tree (D2). Everything else is
a Violation that names the path (escaped), what it is and the rule it broke (D3, D4).

Why it is safe, step by step:
- Every name is looked up relative to an fd we hold (openat/fstatat), never as a
  joined path, so no symlink, rename or `..` can move the walk outside the tree.
- lstat (fstatat with AT_SYMLINK_NOFOLLOW) decides the type before anything is
  opened: a FIFO, socket, device or symlink is rejected without an open, so a FIFO
  cannot block us and a device cannot be read (FS-FIFO-01, FS-SPECIAL-01). These rules,
  judged on the stat alone, are karotte/scan_rules.py; this module is the walk and the copy.
- Opens carry O_NOFOLLOW (a symlink swapped in after lstat fails with ELOOP) and
  O_NONBLOCK (a FIFO swapped in cannot block); fstat on the opened fd must show the
  inode lstat saw. The bytes are read from that very fd (FS-TOCTOU-01).
- The copy is made of new inodes created with O_EXCL in dest fds we hold, with
  normalised modes, owned by the caller, without xattrs (FS-MODE-01).
- Every file and directory of the copy, dest_dir included, gets atime and mtime
  COPY_TIME, so that nothing in the grader's tree says when grading began: a program
  that could tell its checked runs from its timed ones by the age of its files could
  answer right only while checked (PERF-HOLLOW-01).
- The walk is iterative and every budget is checked as it goes: depth, entries,
  file size, total size, name length, path bytes and wall time (D4).
- The result is bounded whatever the agent made (REC-BOUND-01): it holds every
  violation at a deliverable or on the way to one, the first VIOLATIONS_KEPT inside
  deliverable directories and the first VIOLATIONS_KEPT elsewhere, and counts the rest;
  a path it reports is cut to PATH_TEXT_LIMIT bytes of JSON. A violation it only counts
  costs no more than the lstat that found it.
"""
from __future__ import annotations

import errno
import os
import stat
import time
from typing import AnyStr, Sequence

from .errors import KarotteError
from .results import VIOLATION_KINDS, ScannedFile, ScanResult, Violation, capped, escape
from .scan_rules import (Finding, dir_findings, file_findings, human_size, name_finding,
                         special_finding)
from .scan_rules import (RULE_HARDLINK, RULE_MODE, RULE_NAME, RULE_TYPES,  # noqa: F401
                         SPARSE_MIN_SIZE)  # (public here too)
from .spec import MiB, ScanLimits

__all__ = [
    "ScanError", "ScanLimits", "Violation", "ScannedFile", "ScanResult", "VIOLATION_KINDS",
    "COPY_TIME", "VIOLATIONS_KEPT", "PATH_TEXT_LIMIT", "scan_and_copy", "escape", "relation",
    "Walk", "Frame", "walk_into",
]

# atime and mtime of everything in the copy: 2000-01-01T00:00:00Z. Not 0, so that a
# grader that zips the submission (ZIP cannot hold a time before 1980) still works.
COPY_TIME = 946_684_800
_COPY_TIMES_NS = (COPY_TIME * 1_000_000_000, COPY_TIME * 1_000_000_000)
_CHUNK = 1 * MiB
# REC-BOUND-01: what the result holds of the violations, whatever the agent made. A
# deliverable's path is at most 255 bytes (Environment's check), three times that in JSON,
# so a cut path still starts with it and custody still sees where it is.
VIOLATIONS_KEPT = 100  # inside deliverable directories, and again elsewhere
PATH_TEXT_LIMIT = 1024  # bytes of a reported path's JSON form

# Agent inodes: never follow a link, never block, never leak into a child.
_SRC_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SRC_DIR_FLAGS = _SRC_FLAGS | os.O_DIRECTORY
# O_NOCTTY: should a tty ever get here, it cannot become our controlling terminal.
_SRC_FILE_FLAGS = _SRC_FLAGS | os.O_NOCTTY
# The copy: only ever a new inode, never through a link.
_DST_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DST_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# open() errors that mean the entry is no longer what lstat saw.
_CHANGED_ERRNOS = {errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.ENODEV}

RULE_CHANGED = "D2 fd walk: lstat, the opened fd and the copy must see one unchanged inode"
RULE_UNREADABLE = "D2 fd walk: the host must be able to read the entry"

class ScanError(KarotteError):
    """The scan could not run: a bad workspace fd or dest_dir, or a host-side failure
    while writing the copy. Never caused by what the agent left in its workspace."""


def relation(path: AnyStr, deliverable: AnyStr) -> str | None:
    """Where a path lies against a deliverable (relative to the workspace, or absolute as a
    filesystem diff's are: a leading '/' of either does not count; no trailing '/'): "at"
    the deliverable or on the way to it, "inside" it (a deliverable directory), or None.
    Escaped text or raw bytes alike."""
    sep = "/" if isinstance(path, str) else b"/"
    path, deliverable = path.lstrip(sep), deliverable.lstrip(sep)
    if path == deliverable or deliverable.startswith(path + sep):
        return "at"
    if path.startswith(deliverable + sep):
        return "inside"
    return None


def _reported(raw: bytes) -> str:
    """How a violation names its path: escaped, cut to PATH_TEXT_LIMIT; "." for the root."""
    return capped(escape(raw), PATH_TEXT_LIMIT) if raw else "."


def _lstat(name: bytes, dir_fd: int) -> os.stat_result:
    """fstatat(dir_fd, name, AT_SYMLINK_NOFOLLOW): what the entry is, without opening it."""
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)


def _fingerprint(st: os.stat_result) -> tuple[int, ...]:
    # ctime moves on any write, truncate, chmod or link, so a live writer shows here.
    return (st.st_dev, st.st_ino, st.st_mode, st.st_nlink, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns)


class _Stop(Exception):
    """A budget ran out: the walk ends here (the violation is already recorded)."""


class Frame:
    """One directory being walked: its fd, the fd of its copy, and the names left."""

    __slots__ = ("src", "dst", "raw", "depth", "names", "next")

    def __init__(self, src: int, dst: int, raw: bytes, depth: int, names: list[bytes]):
        self.src, self.dst, self.raw, self.depth, self.names = src, dst, raw, depth, names
        self.next = 0

    def finish(self) -> None:
        """Done with this directory: its copy gets COPY_TIME (only now: every create or
        unlink in it moves its mtime), and both fds are closed."""
        try:
            _stamp(self.dst, self.raw)
        finally:
            self.close()

    def close(self) -> None:
        os.close(self.src)
        os.close(self.dst)


class Walk:
    """One walk of a tree and its copy: the rules, the budgets and the result so far.
    karotte/changes.py walks the overlay's upper with it, through the hooks below."""

    def __init__(self, limits: ScanLimits, start: float, deliverables: Sequence[str]):
        self.limits = limits
        self.deadline = start + limits.max_seconds
        self.deliverables = tuple(os.fsencode(d.strip("/")) for d in deliverables)
        self.files: list[ScannedFile] = []
        self.dirs: list[str] = []
        self.violations: list[Violation] = []
        self.kept = {"inside": 0, None: 0}  # violations held, by relation to a deliverable
        self.dropped = 0
        self.complete = True
        self.entries = 0
        self.total = 0
        self.path_bytes = 0
        self.buf = memoryview(bytearray(_CHUNK))

    # -- recording

    def _charge(self, raw: bytes, path: str) -> None:
        """Count path text against max_path_bytes, so many long deep names cannot make
        the result (and the host's memory) grow past a bound."""
        self.path_bytes += len(raw) + len(path)
        if self.path_bytes > self.limits.max_path_bytes:
            self._stop(raw, "paths-too-long", f"max_path_bytes={self.limits.max_path_bytes}",
                       "the paths of the entries read so far exceed the budget")

    def _violate(self, raw: bytes, kind: str, rule: str, detail: str = "") -> None:
        where = next((r for d in self.deliverables if (r := relation(raw, d))), None)
        if where != "at":
            # REC-BOUND-01: a million FIFOs cost a count, not a million records. The first
            # inside each class is held, so custody never misses a deliverable's.
            if self.kept[where] == VIOLATIONS_KEPT:
                self.dropped += 1
                return
            self.kept[where] += 1
        path = self._report(raw)
        self._charge(raw, path)
        self.violations.append(Violation(path, kind, rule, detail))

    def _found(self, raw: bytes, findings: list[Finding]) -> bool:
        """Record each of a rule's findings for the entry at raw; True if there were any."""
        for finding in findings:
            self._violate(raw, *finding)
        return bool(findings)

    def _stop(self, raw: bytes, kind: str, budget: str, detail: str) -> None:
        self.violations.append(Violation(self._report(raw), kind, f"D4 budget: {budget}", detail))
        self.complete = False
        raise _Stop

    def _check_time(self, raw: bytes) -> None:
        if time.monotonic() > self.deadline:
            self._stop(raw, "scan-timeout", f"max_seconds={self.limits.max_seconds:g}",
                       f"stopped after {self.limits.max_seconds:g} s")

    # -- what a walk of another tree may change (karotte/changes.py: the overlay's upper)

    def _report(self, raw: bytes) -> str:
        """How a violation names the entry at raw (relative, b"" for the root)."""
        return _reported(raw)

    def _shown(self, raw: bytes) -> str:
        """How the result names an accepted file or directory."""
        return escape(raw)

    def _other(self, parent: Frame, name: bytes, raw: bytes, st: os.stat_result) -> None:
        """An entry that is neither a regular file nor a directory, judged on lstat alone:
        a FIFO, socket, device or symlink is never opened. (A diff's walk keeps a symlink:
        it reads the target on an O_PATH fd of the link, which opens nothing it names.)"""
        self._violate(raw, *special_finding(st))

    def _accepts(self, fd: int, raw: bytes, fst: os.stat_result) -> bool:
        """A last judgement of an opened file or directory, on its fd; False if it is
        rejected (recorded). The workspace has nothing more to judge."""
        return True

    def _new_dir(self, dst_parent: int, name: bytes, raw: bytes, fst: os.stat_result) -> int:
        """The copy of an accepted directory, as an fd."""
        return _make_dir(dst_parent, name)

    def _set_mode(self, out: int, fst: os.stat_result, raw: bytes) -> int:
        """Give the copy of the file at raw its mode (and owner); returns the mode."""
        mode = 0o755 if fst.st_mode & 0o111 else 0o644
        os.fchmod(out, mode)
        return mode

    # -- the walk

    def run(self, root: Frame) -> None:
        stack = [root]
        try:
            while stack:
                frame = stack[-1]
                if frame.next == len(frame.names):
                    stack.pop().finish()
                    continue
                name = frame.names[frame.next]
                frame.next += 1
                child = self._entry(frame, name)
                if child is not None:
                    stack.append(child)
        except _Stop:
            while stack:  # what was copied stays, and is stamped like a complete copy
                stack.pop().finish()
        finally:
            for frame in stack:
                frame.close()

    def list_dir(self, fd: int, raw: bytes, depth: int) -> list[bytes] | None:
        """The names in a directory, sorted, within the entry and depth budgets; None if
        it cannot be read. Names are bytes, exactly as the kernel has them."""
        limits = self.limits
        names: list[bytes] = []
        try:
            # os.scandir reads lazily (getdents), so a huge directory is never read past
            # the budget; it works on its own dup of fd.
            with os.scandir(fd) as it:
                if depth == limits.max_depth:
                    if next(it, None) is not None:
                        self.complete = False
                        self._violate(raw, "too-deep", f"D4 budget: max_depth={limits.max_depth}",
                                      f"entries below depth {limits.max_depth} were not read")
                    return names
                room = limits.max_entries - self.entries
                for entry in it:
                    if len(names) == room:
                        self.complete = False
                        self._violate(raw, "too-many-entries",
                                      f"D4 budget: max_entries={limits.max_entries}",
                                      f"the workspace has more than {limits.max_entries} entries;"
                                      " the rest of this directory was not read")
                        break
                    names.append(os.fsencode(entry.name))
                    if len(names) % 4096 == 0:
                        self._check_time(raw)
        except OSError as exc:
            self._violate(raw, "unreadable", RULE_UNREADABLE, f"listing failed: {exc.strerror}")
            return None
        finally:
            self.entries += len(names)
        names.sort()
        return names

    def _entry(self, parent: Frame, name: bytes) -> Frame | None:
        raw = parent.raw + b"/" + name if parent.raw else name
        self._check_time(raw)
        finding = name_finding(name, self.limits)
        if finding is not None:
            self._violate(raw, *finding)
            return None
        try:
            st = _lstat(name, parent.src)
        except FileNotFoundError:
            self._violate(raw, "changed-during-scan", RULE_CHANGED,
                          "gone between listing and lstat")
            return None
        except OSError as exc:
            self._violate(raw, "unreadable", RULE_UNREADABLE, f"lstat failed: {exc.strerror}")
            return None
        fmt = stat.S_IFMT(st.st_mode)
        if fmt == stat.S_IFDIR:
            return self._dir(parent, name, raw, st)
        if fmt == stat.S_IFREG:
            self._file(parent, name, raw, st)
            return None
        self._other(parent, name, raw, st)
        return None

    def _open(self, parent: Frame, name: bytes, raw: bytes, st: os.stat_result,
              flags: int) -> tuple[int, os.stat_result] | None:
        """Open the entry lstat saw and prove, by fstat on the fd, that it is the same
        inode of the same type. Returns the fd and its fstat, or None (recorded)."""
        try:
            fd = os.open(name, flags, dir_fd=parent.src)
        except OSError as exc:
            if exc.errno in _CHANGED_ERRNOS:
                self._violate(raw, "changed-during-scan", RULE_CHANGED,
                              f"open after lstat failed: {exc.strerror}")
            else:
                self._violate(raw, "unreadable", RULE_UNREADABLE, f"open failed: {exc.strerror}")
            return None
        try:
            fst = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            self._violate(raw, "unreadable", RULE_UNREADABLE, f"fstat failed: {exc.strerror}")
            return None
        if _identity(fst) != _identity(st):
            os.close(fd)
            self._violate(raw, "changed-during-scan", RULE_CHANGED,
                          "the opened inode is not the one lstat saw")
            return None
        return fd, fst

    def _dir_problems(self, raw: bytes, st: os.stat_result) -> bool:
        """Record every rule the directory breaks (karotte/scan_rules.py); True if any."""
        return self._found(raw, dir_findings(st))

    def _dir(self, parent: Frame, name: bytes, raw: bytes, st: os.stat_result) -> Frame | None:
        if self._dir_problems(raw, st):
            return None
        opened = self._open(parent, name, raw, st, _SRC_DIR_FLAGS)
        if opened is None:
            return None
        fd, fst = opened
        dst = -1
        try:
            if self._dir_problems(raw, fst) or not self._accepts(fd, raw, fst):
                return None
            names = self.list_dir(fd, raw, parent.depth + 1)
            if names is None:
                return None
            path = self._shown(raw)
            self._charge(raw, path)
            dst = self._new_dir(parent.dst, name, raw, fst)
            self.dirs.append(path)
            frame = Frame(fd, dst, raw, parent.depth + 1, names)
            fd = dst = -1  # the frame owns them now
            return frame
        finally:
            if fd >= 0:
                os.close(fd)
            if dst >= 0:
                os.close(dst)

    def _file_problems(self, raw: bytes, st: os.stat_result) -> bool:
        """Record every rule the file breaks (judged on stat alone, in O(1)); True if any."""
        return self._found(raw, file_findings(st, self.limits))

    def _file(self, parent: Frame, name: bytes, raw: bytes, st: os.stat_result) -> None:
        if self._file_problems(raw, st):
            return  # rejected without an open
        opened = self._open(parent, name, raw, st, _SRC_FILE_FLAGS)
        if opened is None:
            return
        fd, fst = opened
        try:
            # the fd's inode is the one that counts
            if self._file_problems(raw, fst) or not self._accepts(fd, raw, fst):
                return
            size = fst.st_size
            if self.total + size > self.limits.max_total_size:
                self._stop(raw, "total-too-large", f"max_total_size={self.limits.max_total_size}",
                           f"{human_size(self.total)} copied, this file adds {human_size(size)}")
            path = self._shown(raw)
            self._charge(raw, path)
            self._copy(fd, fst, parent.dst, name, raw, path)
        finally:
            os.close(fd)

    def _copy(self, src: int, fst: os.stat_result, dst_dir: int, name: bytes, raw: bytes,
              path: str) -> None:
        try:
            out = os.open(name, _DST_FILE_FLAGS, 0o600, dir_fd=dst_dir)
        except OSError as exc:
            raise ScanError(f"cannot create the copy of {escape(raw)} in dest_dir: "
                            f"{exc.strerror}") from exc
        keep = False
        try:
            copied = self._copy_range(src, out, fst.st_size, raw)
            if copied is None:
                return
            try:
                after = os.fstat(src)
            except OSError as exc:
                self._violate(raw, "unreadable", RULE_UNREADABLE, f"fstat failed: {exc.strerror}")
                return
            if copied != fst.st_size or _fingerprint(after) != _fingerprint(fst):
                self._violate(raw, "changed-during-scan", RULE_CHANGED,
                              f"changed while copied (size {fst.st_size} at the check, "
                              f"{after.st_size} after {copied} bytes were copied)")
                return
            mode = self._set_mode(out, fst, raw)
            _stamp(out, raw)
            keep = True
        finally:
            os.close(out)
            if not keep:
                os.unlink(name, dir_fd=dst_dir)  # a rejected file leaves no partial copy
        self.total += copied
        self.files.append(ScannedFile(path, raw, copied, mode))

    def _copy_range(self, src: int, out: int, size: int, raw: bytes) -> int | None:
        """Copy at most `size` bytes from offset 0 of src (pread: the file position and
        any growth past the checked size do not matter). Returns the bytes copied, or
        None if the source could not be read (recorded)."""
        buf = self.buf
        offset = 0
        while offset < size:
            self._check_time(raw)
            try:
                n = os.preadv(src, [buf[:min(_CHUNK, size - offset)]], offset)
            except OSError as exc:
                self._violate(raw, "unreadable", RULE_UNREADABLE, f"read failed: {exc.strerror}")
                return None
            if n == 0:
                break  # shrank under us: the caller sees copied < size
            chunk = buf[:n]
            while chunk:
                try:
                    w = os.write(out, chunk)
                except OSError as exc:
                    raise ScanError(f"cannot write the copy of {escape(raw)} in dest_dir: "
                                    f"{exc.strerror}") from exc
                chunk = chunk[w:]
            offset += n
        return offset


def _stamp(fd: int, raw: bytes) -> None:
    """atime and mtime COPY_TIME on our own fd of the copy of raw (futimens). The ctime
    cannot be set: it still shows when the copy was made (see docs/scan.md)."""
    try:
        os.utime(fd, ns=_COPY_TIMES_NS)
    except OSError as exc:
        what = f"the copy of {escape(raw)}" if raw else "dest_dir"
        raise ScanError(f"cannot set the timestamps of {what}: {exc.strerror}") from exc


def _make_dir(dst_parent: int, name: bytes) -> int:
    """A new directory in the copy (mkdirat fails if anything is there), as an fd."""
    try:
        os.mkdir(name, 0o700, dir_fd=dst_parent)
        fd = os.open(name, _DST_DIR_FLAGS, dir_fd=dst_parent)
    except OSError as exc:
        raise ScanError(f"cannot create a directory in dest_dir: {exc.strerror}") from exc
    try:
        os.fchmod(fd, 0o755)  # exact, whatever the umask
    except OSError as exc:
        os.close(fd)
        raise ScanError(f"cannot set the mode of a directory in dest_dir: {exc.strerror}") from exc
    return fd


def _open_root(src_fd: int, name: str) -> tuple[int, os.stat_result]:
    """A fresh fd of the tree's root (name: the Sandbox property that gave src_fd): our own
    directory offset, the caller's fd untouched."""
    if not isinstance(src_fd, int):
        raise ScanError(f"{name} must be an open directory fd, got {src_fd!r} "
                        "(was the sandbox closed before the scan? scan between kill_all and close)")
    try:
        before = os.fstat(src_fd)
    except OSError as exc:
        raise ScanError(f"{name} {src_fd} is not an open fd: {exc.strerror}") from exc
    if not stat.S_ISDIR(before.st_mode):
        raise ScanError(f"{name} {src_fd} is not a directory; pass Sandbox.{name}")
    try:
        fd = os.open(".", _SRC_DIR_FLAGS, dir_fd=src_fd)
    except OSError as exc:
        raise ScanError(f"cannot open the tree of {name} {src_fd}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if _identity(st) != _identity(before):
        os.close(fd)
        raise ScanError(f"{name} {src_fd} did not reopen as itself")
    return fd, st


def _open_dest(dest_dir: str | bytes | os.PathLike, workspace: os.stat_result) -> int:
    try:
        fd = os.open(dest_dir, _DST_DIR_FLAGS)
    except FileNotFoundError as exc:
        raise ScanError(f"dest_dir {dest_dir!r} does not exist; create a fresh empty "
                        "directory for the copy") from exc
    except OSError as exc:
        why = "is a symlink" if os.path.islink(dest_dir) else exc.strerror
        raise ScanError(f"dest_dir {dest_dir!r} cannot be used ({why}); pass a fresh empty "
                        "directory, not a link") from exc
    try:
        st = os.fstat(fd)
        if st.st_dev == workspace.st_dev:
            raise ScanError(f"dest_dir {dest_dir!r} is on the workspace's own filesystem; "
                            "the copy must live on a host filesystem the agent never had")
        with os.scandir(fd) as it:
            if next(it, None) is not None:
                raise ScanError(f"dest_dir {dest_dir!r} is not empty; pass a fresh empty "
                                "directory so that the copy holds only vetted files")
        try:
            xattrs = os.listxattr(fd)
        except OSError:
            xattrs = []  # a filesystem without xattrs has no default ACL either
        if "system.posix_acl_default" in xattrs:
            raise ScanError(f"dest_dir {dest_dir!r} has a default ACL, which every file of "
                            "the copy would inherit; remove it (setfacl -k) or use another "
                            "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def walk_into(walk: Walk, src_fd: int, name: str, dest_dir: str | bytes | os.PathLike) -> float:
    """Run walk over the tree behind src_fd (name: the Sandbox property that gave it) into
    dest_dir, which must exist and be empty. Returns the walk's start (monotonic)."""
    start = time.monotonic()
    root, root_st = _open_root(src_fd, name)
    try:
        dest = _open_dest(dest_dir, root_st)
    except BaseException:
        os.close(root)
        raise
    try:
        names = walk.list_dir(root, b"", 0)
    except _Stop:
        names = None
    except BaseException:
        os.close(root)
        os.close(dest)
        raise
    walk.run(Frame(root, dest, b"", 0, names or []))
    return start


def scan_and_copy(workspace_fd: int, dest_dir: str | bytes | os.PathLike,
                  limits: ScanLimits = ScanLimits(), *,
                  deliverables: Sequence[str] = ()) -> ScanResult:
    """Walk the workspace behind workspace_fd and copy what passes into dest_dir.

    deliverables are the paths (relative to the workspace) whose violations decide the
    score: the result holds every violation at one of them or on the way to one, and the
    first VIOLATIONS_KEPT inside them, however many others there are.

    Call it after the sandbox's processes are all gone (Sandbox.kill_all). dest_dir
    must exist and be empty; on return it holds the accepted files and directories as
    new inodes (files 0644 or 0755, directories 0755, owned by the caller), and every
    one of them, dest_dir included, has atime and mtime COPY_TIME. On ScanError the
    copy is incomplete: discard dest_dir.
    """
    walk = Walk(limits, time.monotonic(), deliverables)
    start = walk_into(walk, workspace_fd, "workspace_fd", dest_dir)
    return ScanResult(tuple(walk.files), tuple(walk.dirs), tuple(walk.violations),
                      walk.complete, time.monotonic() - start, walk.dropped)
