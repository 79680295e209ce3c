"""The rules for one entry of a custody scan, judged on its name and its stat alone.

A walk (karotte/scan.py for the workspace, karotte/changes.py for an image's diff) asks
these before it opens anything: a name that is not one component, a FIFO, socket, device
or symlink, a hard link, a setuid, setgid or sticky bit, a file too large or too sparse
is rejected on lstat, with no open and no read (FS-FIFO-01, FS-SPECIAL-01). It asks
again on the fstat of the fd it opened, so the inode that is copied is the one judged
(FS-TOCTOU-01). Each rule answers in O(1) with findings, (kind, rule, detail) triples,
that the walk records as Violations; a rule never raises on what the agent made.
"""
from __future__ import annotations

import os
import stat

from .spec import KiB, ScanLimits

__all__ = ["RULE_TYPES", "RULE_HARDLINK", "RULE_MODE", "RULE_NAME", "SPARSE_MIN_SIZE",
           "Finding", "name_finding", "special_finding", "dir_findings", "file_findings",
           "human_size"]

Finding = tuple[str, str, str]  # a Violation's kind, rule and detail

SPARSE_MIN_SIZE = 64 * KiB  # smaller files are never called sparse: their holes cost little

RULE_TYPES = "D3 file types: only regular files and directories"
RULE_HARDLINK = "D3 hard links: a regular file must have st_nlink == 1"
RULE_MODE = "D2 modes: no setuid, setgid or sticky bits"
RULE_NAME = "D2 names: a name is one path component, not '.' or '..'"

_SPECIAL_KINDS = {
    stat.S_IFLNK: ("symlink", "symlink not allowed"),
    stat.S_IFIFO: ("fifo", "FIFO not allowed"),
    stat.S_IFSOCK: ("socket", "socket not allowed"),
    stat.S_IFBLK: ("block-device", "block device not allowed"),
    stat.S_IFCHR: ("char-device", "character device not allowed"),
}
_SPECIAL_BITS = ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid"), (stat.S_ISVTX, "sticky"))


def human_size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"


def name_finding(name: bytes, limits: ScanLimits) -> Finding | None:
    """What is wrong with a name as the kernel listed it, before its lstat; None if nothing."""
    # The kernel never returns these, but a name that is not one component is the one
    # thing that could make a dir_fd-relative create land outside dest_dir.
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        return "invalid-name", RULE_NAME, ""
    if len(name) > limits.max_name_length:
        return ("name-too-long", f"D4 budget: max_name_length={limits.max_name_length}",
                f"name of {len(name)} bytes")
    return None


def special_finding(st: os.stat_result) -> Finding:
    """Why an entry that is neither a regular file nor a directory is rejected."""
    fmt = stat.S_IFMT(st.st_mode)
    kind, detail = _SPECIAL_KINDS.get(fmt, ("unknown-type", f"file type {fmt:#o}"))
    return kind, RULE_TYPES, detail


def dir_findings(st: os.stat_result) -> list[Finding]:
    """Every rule a directory breaks."""
    # Special bits on a directory are rejected like on a file (setgid dirs too: a
    # deliverable stays one plain tree, whatever the copy would normalise).
    return [(kind, RULE_MODE, f"directory mode {stat.S_IMODE(st.st_mode):04o}")
            for bit, kind in _SPECIAL_BITS if st.st_mode & bit]


def file_findings(st: os.stat_result, limits: ScanLimits) -> list[Finding]:
    """Every rule a regular file breaks: links, mode bits, then size or sparseness."""
    found = []
    if st.st_nlink > 1:
        found.append(("hardlink", RULE_HARDLINK, f"hard link count {st.st_nlink}"))
    found += [(kind, RULE_MODE, f"mode {stat.S_IMODE(st.st_mode):04o}")
              for bit, kind in _SPECIAL_BITS if st.st_mode & bit]
    size = st.st_size
    if size > limits.max_file_size:
        found.append(("file-too-large", f"D4 budget: max_file_size={limits.max_file_size}",
                      f"file too large: {human_size(size)} > {human_size(limits.max_file_size)}"))
    elif size > SPARSE_MIN_SIZE and st.st_blocks * 512 < size * limits.sparse_ratio:
        found.append(("sparse", f"D4 budget: sparse_ratio={limits.sparse_ratio:g}",
                      f"{human_size(st.st_blocks * 512)} allocated for a size of "
                      f"{human_size(size)}"))
    return found
