"""What a sandbox is asked to be: limits, mounts, network. Secure by default."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}


def parse_size(text: str | int) -> int:
    """'1G', '512MiB', '64k', '4096' -> bytes (binary units; a bare number is bytes)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64K, 512M, 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the sandbox; read-only unless writable."""

    src: str
    dst: str
    writable: bool = False

    @classmethod
    def parse(cls, text: str) -> "Bind":
        """'SRC:DST[:ro|rw]' as in ``karotte-sandbox exec --bind``."""
        parts = text.split(":")
        mode = "ro"
        if len(parts) == 3:
            mode = parts.pop()
        if len(parts) != 2 or mode not in ("ro", "rw") or not parts[0] or not parts[1]:
            raise ValueError(f"bind must be SRC:DST[:ro|rw], got {text!r}")
        return cls(parts[0], parts[1], writable=mode == "rw")


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
    network: str = "none"  # "none": a private network namespace with loopback only
    hostname: str = "karotte"
    binds: tuple[Bind, ...] = ()
    # Protections (names as in `karotte-sandbox check`) the caller accepts to go without.
    allow_degraded: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        for name in ("memory", "pids", "disk", "inodes", "tmp_size", "home_size", "nofile",
                     "output_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxSpec.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.cpus, (int, float)) and math.isfinite(self.cpus) and self.cpus > 0):
            raise ValueError(f"SandboxSpec.cpus must be a positive number, got {self.cpus!r}")
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout)
                and self.timeout > 0):
            raise ValueError(f"SandboxSpec.timeout must be positive seconds, got {self.timeout!r}")
        if self.network != "none":
            raise ValueError(f"SandboxSpec.network: only 'none' (loopback only) is supported, "
                             f"got {self.network!r}")
        if self.memory < 16 * MiB:
            raise ValueError(f"SandboxSpec.memory: at least 16 MiB is needed, got {self.memory}")
        if self.pids < 2:
            raise ValueError("SandboxSpec.pids: at least 2 (init and one command)")


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
