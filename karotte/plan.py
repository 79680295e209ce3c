"""The plan of a sandbox: what karotte-init is told to build before the first command.

One CONFIG message, made of each mechanism's part: the agent's ids (karotte/userns.py) and
capabilities (spec.agent_user), hostname, the seccomp filter (karotte/seccomp.py), rlimits,
the network (karotte/net.py) and the mount plan (karotte/mounts.py). init reads it in apply_config (csrc/init/main.c).
"""
from __future__ import annotations

import resource
from functools import lru_cache

from . import mounts, net
from . import protocol as p
from .seccomp import compile_policy
from .spec import KiB, SandboxSpec
from .userns import AGENT_UID, Identity


@lru_cache(maxsize=1)
def _seccomp_filter() -> bytes:
    return compile_policy()


@lru_cache(maxsize=64)
def config_message(spec: SandboxSpec, ident: Identity, tree: str | None = None,
                   changes: str | None = None) -> bytes:
    """The CONFIG message of a sandbox: everything init sets up before its first command.
    tree: the image's tree (karotte/imageroot.py), or None for the host's userland; changes:
    the vetted diff laid over it (SandboxSpec.changes, resolved), or None."""
    msg = p.Message(p.CONFIG)
    # agent_user="root": uid 0 of the sandbox's namespace (nested: of its own) with the
    # capabilities of p.ROOT_CAPS; "agent": uid 1000 and no T_CAPS, so no capability.
    uid = 0 if spec.agent_user == "root" else AGENT_UID
    msg.record(p.T_IDS, uid.to_bytes(4, "little") + uid.to_bytes(4, "little")
               + int(ident.nested).to_bytes(4, "little"))
    if spec.agent_user == "root":
        msg.record(p.T_CAPS, p.ROOT_CAPS.to_bytes(8, "little"))
    msg.string(p.T_HOSTNAME, spec.hostname)
    msg.record(p.T_SECCOMP, _seccomp_filter())
    msg.rlimit(resource.RLIMIT_NOFILE, spec.nofile, spec.nofile)
    msg.rlimit(resource.RLIMIT_FSIZE, spec.disk, spec.disk)
    msg.rlimit(resource.RLIMIT_CORE, 0, 0)
    # Counted per user, and on the host against the user namespace's creator: cap what
    # one sandbox can take from its owner's pools (POSIX message queue bytes, queued
    # signals), which an unprivileged caller shares with all its sandboxes.
    msg.rlimit(resource.RLIMIT_MSGQUEUE, 64 * KiB, 64 * KiB)
    msg.rlimit(resource.RLIMIT_SIGPENDING, 1024, 1024)
    net.add_network_plan(msg, spec)
    mounts.add_mount_plan(msg, spec, ident.owner_uid, ident.owner_gid, tree, changes)
    return msg.to_bytes()
