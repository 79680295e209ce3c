"""What a failed step of a sandbox's start means: the check lines it takes away, and the fix.

karotte-init and the spawn name the step that failed with a code of `enum kp_step`
(csrc/protocol.h), which `karotte.protocol` turns into a name: KS_MOUNT_PROC is
"mount-proc" (`Reply.step`, `protocol.step_name`). This is the one table from that name
to the lines of `karotte-sandbox check` the step sets up, and to the fix; no code
matches the text of init's messages. Plain data: importable without the C extension,
as the probe must be.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass, field

from .protections import CGROUP_LINES, PROTECTIONS

MOUNT_SETATTR_KERNEL = (5, 12)

_TOO_OLD = (f"this kernel is too old or built without it: Karotte needs Linux "
            f"{'.'.join(map(str, MOUNT_SETATTR_KERNEL))}+ with seccomp filters; run "
            "`karotte-sandbox check`")
_MOUNT_REFUSED = ("the kernel refused a mount inside the user namespace: a container or LSM "
                  "policy may forbid it; run `karotte-sandbox check`")
_UNREADABLE = ("the sandbox is built by an unprivileged host uid, so a bind source must be "
               "readable, and its parents searchable, by others: chmod o+rx, or bind a copy")


@dataclass(frozen=True)
class Step:
    """One step of a sandbox's start, or of an exec's start."""

    # The check lines this step sets up, the first one the line to blame; () when it sets
    # up none alone (a failure there is a bug, or says nothing about one protection).
    protections: tuple[str, ...] = ()
    # errno -> what a setup error adds, in parentheses, after the kernel's words.
    hints: dict[int, str] = field(default_factory=dict)

    @property
    def fix(self) -> str | None:
        """The fix `check` prints for this step's first line; None for a step without one."""
        return fix(self.protections[0]) if self.protections else None

    def hint(self, err: int) -> str:
        return self.hints.get(err, "")


_MNT = ("mount-namespace",)
_AGENT_UID = ("unprivileged-agent-uid",)
_AGENT_USERNS = ("user-namespace", "unprivileged-agent-uid")
_IMAGE = ("image-overlay",)
_NOT_THE_CALLERS = ("for an unprivileged caller, init is the caller as root of the sandbox's "
                    "user namespace, so an image's tree must be the caller's own (chown -R), or "
                    "run Karotte as root, whose trees are idmapped")
_SECCOMP_SETUP = {errno.ENOSYS: _TOO_OLD, errno.EINVAL: _TOO_OLD}

# Every KS_* code of csrc/protocol.h, by name (tests/test_protocol.py checks that).
STEPS: dict[str, Step] = {
    # karotte_spawn (csrc/spawn.c)
    "spawn-thread": Step(),
    "spawn-cgroup": Step(CGROUP_LINES),  # the fix depends on the cgroup: the probe has it
    "spawn-owner": Step(),
    "spawn-clone3": Step(("clone3",)),
    # setup: the config (csrc/init/main.c)
    "config-message": Step(),
    "config-record": Step(),
    "cgroup-namespace": Step(("cgroup-namespace",)),
    "setgroups": Step(_AGENT_UID),
    "sysctl": Step(),
    "hostname": Step(("uts-namespace",)),
    "seccomp-support": Step(hints=_SECCOMP_SETUP),
    "setsid": Step(("new-session",)),
    "seccomp-load": Step(("seccomp",), _SECCOMP_SETUP),
    "workspace": Step(),
    "signalfd": Step(),
    "bounding-set": Step(("capabilities-dropped",)),
    "hide-init": Step(hints={errno.EPERM: _MOUNT_REFUSED}),
    # setup: the roots (csrc/init/mounts.c)
    "mount-private": Step(_MNT),
    "staging-tmpfs": Step(_MNT),
    "staging-dirs": Step(_MNT),
    "staging-pivot": Step(_MNT),
    "chdir-root": Step(),
    "newroot-tmpfs": Step(("mount-namespace", "disk-quota")),
    "detach-host": Step(_MNT),
    "chdir-newroot": Step(),
    "pivot-root": Step(_MNT),
    "detach-staging": Step(_MNT),
    # setup: the mount plan (csrc/init/mounts.c)
    "mkdir": Step(hints={errno.EACCES: _NOT_THE_CALLERS}),
    "bind-source": Step(hints={errno.EACCES: _UNREADABLE}),
    "bind-target": Step(),
    "bind": Step(),
    "mount-setattr": Step(("mount-setattr",), {**_SECCOMP_SETUP, errno.EPERM: _MOUNT_REFUSED}),
    "tmpfs": Step(("mount-namespace", "disk-quota")),
    "mount-proc": Step(hints={errno.EPERM: _MOUNT_REFUSED}),
    "mount-devpts": Step(hints={errno.EPERM: _MOUNT_REFUSED}),
    "ptmx": Step(),
    "symlink": Step(),
    "dir": Step(),
    "file": Step(),
    "mount-op": Step(),
    "overlay-lower": Step(_IMAGE, {errno.EACCES: _UNREADABLE}),
    "overlay-upper": Step(_IMAGE),
    "overlay": Step(_IMAGE, {errno.EPERM: _MOUNT_REFUSED}),
    # setup: the network (csrc/init/net.c)
    "loopback": Step(("network-namespace",)),
    # exec: the request (csrc/init/serve.c)
    "exec-slots": Step(),
    "exec-request": Step(),
    "pty": Step(),
    "pipe": Step(),
    "fork": Step(),
    # exec: the agent's child (csrc/init/agent.c)
    "oom-score": Step(),
    "sigmask": Step(),
    "ctty": Step(),
    "close-fds": Step(("closed-fds",)),
    "rlimit": Step(("rlimits",)),
    "agent-userns": Step(_AGENT_USERNS),
    "agent-uid-map": Step(_AGENT_USERNS),
    "agent-gid-map": Step(_AGENT_USERNS),
    "setresgid": Step(_AGENT_UID),
    "setresuid": Step(_AGENT_UID),
    "chdir": Step(),
    "no-new-privs": Step(("no-new-privs",)),
    "execve": Step(),
    "agent-caps": Step(("capabilities-dropped",)),
}

# What to do when the step that sets up a line failed, by line; DEFAULT_FIX for the rest.
FIXES: dict[str, str] = {
    "mount-setattr": f"karotte-init needs mount_setattr (Linux "
                     f"{'.'.join(map(str, MOUNT_SETATTR_KERNEL))}+): upgrade the kernel, or "
                     f"run outside a container whose seccomp profile denies it",
    "clone3": "the spawn needs clone3 with CLONE_PIDFD (Linux 5.3+, CLONE_INTO_CGROUP "
              "5.7+): upgrade the kernel, or run outside a container whose seccomp profile "
              "denies clone3",
    "pidfd": "the spawn needs pidfds (Linux 5.3+): upgrade the kernel",
    "seccomp": "the kernel must be built with CONFIG_SECCOMP_FILTER",
    "image-overlay": "sandboxes on an image need overlayfs in a user namespace (Linux 5.11+; "
                     "an idmapped lower for a root caller, 5.19+; a tmpfs upper with user "
                     "xattrs, 6.6+) and no AppArmor or seccomp policy that forbids mounts "
                     "there: upgrade the kernel, or run on the host itself, or use "
                     "image='host'",
}
DEFAULT_FIX = ("a kernel or container policy refused this step; run `karotte-sandbox "
               "check` on the host itself, or as root")

_UNKNOWN = Step()


def step(name: str | None) -> Step:
    """The row of a step name; a step this table does not know (None, or an init newer
    than this module) names no line."""
    return STEPS.get(name, _UNKNOWN) if name is not None else _UNKNOWN


def fix(protection: str) -> str:
    """The fix `check` prints for a line whose step failed."""
    if protection not in PROTECTIONS:
        raise ValueError(f"{protection!r} is not a line of `karotte-sandbox check`")
    return FIXES.get(protection, DEFAULT_FIX)
