"""What a sandbox is asked to be: limits, mounts, network. Secure by default."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from . import imageref
try:
    from .egress.policy import EgressPolicy
except ImportError:  # the grader's flat copy of the library (grading.RUNTIME_MODULES) has
    EgressPolicy = ()  # no egress package, and a grader's nested runs take network "none"
from .protections import PROTECTIONS

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}


def parse_size(text: str | int) -> int:
    """'1G', '512MiB', '64k', '4096' -> bytes (binary units; a bare number is bytes).

    A sign is kept ('-5M' -> -5242880): whether a size is allowed is SandboxSpec's to say,
    in one place, with the same message for the API and the command line."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64K, 512M, 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class SpecError(ValueError):
    """A value that a SandboxSpec field cannot take. ``field`` names the field and
    ``requirement`` says what it must be, so a front end (the CLI) can name its own
    option instead of the Python field."""

    def __init__(self, field: str, requirement: str, value: object):
        super().__init__(f"SandboxSpec.{field} must be {requirement}, got {value!r}")
        self.field = field
        self.requirement = requirement
        self.value = value


class BindError(ValueError):
    """A bind that the sandbox cannot make as asked; the message names it and the fix."""


# Where a bind may never go: the sandbox's kernel filesystems. A bind there would hide
# what init mounts (and init reads /proc/sys after the mounts), or show the host's.
KERNEL_DIRS = {
    "/proc": "is the sandbox's own procfs, of its PID namespace",
    "/dev": "holds the sandbox's device nodes, its own devpts and /dev/shm",
    "/sys": "stays out of every sandbox: it shows the host's devices and kernel state",
}


def path_within(path: str, top: str) -> bool:
    """Whether path is top or below it (both normalised and absolute)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the sandbox; read-only unless writable.

    follow_symlinks=False mounts it nosymfollow: no path through the bind follows a
    symlink in it (ELOOP), and readlink still shows each one. For a tree of another's
    links that must not resolve in this sandbox's root (the grader's /changes). It needs
    Linux 5.14; an older kernel fails the sandbox's start, naming it.

    src and dst are absolute; dst is normalised (no '.', '..', '//' or trailing '/'),
    not '/', and not in /proc, /dev or /sys. Where dst meets Karotte's own mounts is
    checked by the mount plan (karotte/mounts.py), which knows them."""

    src: str
    dst: str
    writable: bool = False
    follow_symlinks: bool = True

    def __post_init__(self):
        for name in ("writable", "follow_symlinks"):
            if not isinstance(getattr(self, name), bool):
                raise BindError(f"bind {name} must be True or False, got "
                                f"{getattr(self, name)!r}")
        for name in ("src", "dst"):
            path = getattr(self, name)
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
                raise BindError(f"bind {name} must be an absolute path without NUL bytes, "
                                f"got {path!r}")
        dst = self.dst
        if dst == "/":
            raise BindError(f"bind {self.src} -> /: it would replace the sandbox's whole root; "
                            f"bind onto a directory of its own, such as /data")
        if os.path.normpath(dst) != dst or dst.startswith("//"):
            raise BindError(f"bind destination {dst!r} is not normalised; write it as "
                            f"{os.path.normpath(dst).replace('//', '/')!r}")
        for top, what in KERNEL_DIRS.items():
            if path_within(dst, top):
                raise BindError(f"bind {self.src} -> {dst}: {top} {what}; bind somewhere "
                                f"else, such as /data")


AGENT_USERS = ("agent", "root")
_BYTES = ("memory", "disk", "tmp_size", "home_size", "output_limit")


@dataclass(frozen=True)
class SandboxSpec:
    """Limits and layout of one sandbox. Every default is enforced by the kernel."""

    memory: int = 1 * GiB  # memory.max / memory.limit_in_bytes; tmpfs pages count too
    pids: int = 256  # pids.max, init included
    cpus: float = 1.0  # cpu.max quota, in CPUs
    timeout: float = 60.0  # wall-clock seconds per exec
    disk: int = 1 * GiB  # /workspace tmpfs size; also RLIMIT_FSIZE
    inodes: int = 65536  # /workspace tmpfs nr_inodes
    tmp_size: int = 256 * MiB  # /tmp, also /dev/shm
    home_size: int = 64 * MiB  # /home/agent
    nofile: int = 1024  # RLIMIT_NOFILE
    output_limit: int = 1 * MiB  # bytes kept of each of stdout and stderr per exec
    # "none": a private network namespace with loopback only; an EgressPolicy
    # (karotte.egress.parse_policy): that, and a host-side proxy by allow-list (karotte/net.py)
    network: str | EgressPolicy = "none"
    hostname: str = "karotte"
    binds: tuple[Bind, ...] = ()
    # The root filesystem: "host" (the host's userland, read-only) or "dir:/ABS/PATH" (an
    # overlay on that directory tree; karotte/imageroot.py, docs/image-sandbox.md).
    image: str = "host"
    # A vetted diff (karotte.changes.scan_changes's dest_dir, an absolute path) laid over the
    # image as its top read-only layer; only with an image (docs/image-sandbox.md, "Custody
    # of the diff").
    changes: str | None = None
    # Who runs the commands: "agent" (uid 1000, no capabilities) or "root" (uid 0 of the
    # sandbox's own user namespace with only the file-ownership capabilities, for image
    # tasks that install packages or chown; docs/image-sandbox.md, "Root inside").
    agent_user: str = "agent"
    # Protections (names as in `karotte-sandbox check`) the caller accepts to go without.
    allow_degraded: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        for name in ("memory", "pids", "disk", "inodes", "tmp_size", "home_size", "nofile",
                     "output_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(name, "a positive number of bytes" if name in _BYTES
                                else "a positive integer", value)
        for name, what in (("cpus", "a positive number of CPUs"),
                           ("timeout", "a positive number of seconds")):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0):
                raise SpecError(name, what, value)
        if not (isinstance(self.network, EgressPolicy) or self.network == "none"):
            raise SpecError("network", "'none' (loopback only) or an EgressPolicy "
                            "(karotte.egress.parse_policy(allow=[...]))", self.network)
        if self.memory < 16 * MiB:
            raise SpecError("memory", "at least 16 MiB", self.memory)
        if self.pids < 2:
            raise SpecError("pids", "at least 2 (init and one command)", self.pids)
        _check_distinct(self.binds)
        _check_image(self.image)
        _check_changes(self.changes, self.image)
        if self.agent_user not in AGENT_USERS:
            raise SpecError("agent_user", " or ".join(map(repr, AGENT_USERS)), self.agent_user)
        if isinstance(self.allow_degraded, (set, list, tuple)):
            object.__setattr__(self, "allow_degraded", frozenset(self.allow_degraded))
        _check_degraded(self.allow_degraded)


DIR_IMAGE = ("a tree other than / named by an absolute, normalised path without NUL bytes "
             "(dir:/ABSOLUTE/PATH)")


def _check_image(image: object) -> None:
    """One of the references of karotte/imageref.py (karotte/imageroot.py resolves each to a
    tree); a dir: tree, which a sandbox runs on as it is, by an absolute path."""
    try:
        ref = imageref.parse(image)
    except imageref.ImageRefError as exc:
        raise SpecError("image", f"an image reference ({exc})", image) from None
    if ref.kind == "dir":
        path = ref.path
        if not (path.startswith("/") and not path.startswith("//") and "\0" not in path
                and os.path.normpath(path) == path and path != "/"):
            raise SpecError("image", DIR_IMAGE, image)


def _check_changes(changes: object, image: str) -> None:
    if changes is None:
        return
    if not (isinstance(changes, str) and changes.startswith("/") and "\0" not in changes
            and not changes.startswith("//") and os.path.normpath(changes) == changes
            and changes != "/"):
        raise SpecError("changes", "a vetted diff's directory other than /, by an absolute, "
                        "normalised path without NUL bytes", changes)
    if imageref.parse(image).kind == "host":
        raise SpecError("changes", "None on the host's userland: a diff is laid over an "
                        "image, so name the image it was taken on as well "
                        "(SandboxSpec(image=..., changes=...))", changes)


def _check_degraded(names: frozenset[str]) -> None:
    """allow_degraded names lines of `karotte-sandbox check`: a misspelt one would
    silently accept nothing, and a sandbox would fail where its caller meant it to run."""
    if not isinstance(names, frozenset):
        raise SpecError("allow_degraded", "a set of check line names", names)
    unknown = sorted(n for n in names if n not in PROTECTIONS)
    if unknown:
        hint = (" ('cgroups' is now the lines it stands for: "
                "allow_degraded=karotte.protections.NO_CGROUP)" if "cgroups" in unknown else "")
        raise SpecError("allow_degraded", "names of `karotte-sandbox check` lines, e.g. "
                        "{'cgroup-swap'}, or NO_CGROUP to run without a cgroup" + hint,
                        set(unknown))


def _check_distinct(binds: tuple[Bind, ...]) -> None:
    """Each bind needs a destination of its own: two onto one path would leave only the
    last, and one inside another depends on their order and creates its mount point in
    the other's host directory."""
    if not isinstance(binds, tuple) or not all(isinstance(b, Bind) for b in binds):
        raise SpecError("binds", "a tuple of Bind", binds)
    for i, bind in enumerate(binds):
        for other in binds[:i]:
            if bind.dst == other.dst:
                raise BindError(f"two binds onto {bind.dst} ({other.src} and {bind.src}); "
                                f"give each a destination of its own")
            if path_within(bind.dst, other.dst) or path_within(other.dst, bind.dst):
                inner, outer = (bind, other) if path_within(bind.dst, other.dst) else (other, bind)
                raise BindError(f"bind {inner.src} -> {inner.dst} is inside the bind "
                                f"{outer.src} -> {outer.dst}; give each a destination of its "
                                f"own, side by side (such as /data and /more)")


MAX_DEPTH_LIMIT = 256  # the walk holds two fds per level (source and copy)


@dataclass(frozen=True)
class ScanLimits:
    """D4 budgets. Each default is far above what an honest RL workspace holds."""

    max_depth: int = 32  # path components below the workspace root
    max_entries: int = 100_000  # directory entries read, of any type
    max_file_size: int = 64 * MiB  # st_size of one regular file (not its blocks)
    max_total_size: int = 256 * MiB  # bytes copied, all files together
    max_name_length: int = 255  # bytes of one name
    max_seconds: float = 10.0  # wall time of the whole scan and copy
    sparse_ratio: float = 0.5  # sparse: st_blocks*512 < st_size*ratio (st_size > 64 KiB)
    max_path_bytes: int = 64 * MiB  # path text the result holds (raw and escaped forms)

    def __post_init__(self):
        for name in ("max_depth", "max_entries", "max_file_size", "max_total_size",
                     "max_name_length", "max_path_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ScanLimits.{name} must be a positive integer, got {value!r}")
        if self.max_depth > MAX_DEPTH_LIMIT:
            raise ValueError(f"ScanLimits.max_depth is at most {MAX_DEPTH_LIMIT} (the walk holds "
                             f"two fds per level), got {self.max_depth}")
        if not (isinstance(self.max_seconds, (int, float)) and math.isfinite(self.max_seconds)
                and self.max_seconds > 0):
            raise ValueError(f"ScanLimits.max_seconds must be positive seconds, "
                             f"got {self.max_seconds!r}")
        if not (isinstance(self.sparse_ratio, (int, float)) and 0 <= self.sparse_ratio <= 1):
            raise ValueError(f"ScanLimits.sparse_ratio must be in [0, 1] (0 turns the check "
                             f"off), got {self.sparse_ratio!r}")
