"""The protections Karotte sets up, by the names `karotte-sandbox check` gives its lines.

One closed set: `HostUnsupported` names what it takes away with them, and
`SandboxSpec.allow_degraded` accepts only them.
"""

# Every line of `check`, in order: name -> part of the default protections.
PROTECTIONS: dict[str, bool] = {
    "user-namespace": True,
    "pid-namespace": True,
    "mount-namespace": True,
    "network-namespace": True,
    "ipc-namespace": True,
    "uts-namespace": True,
    "cgroup-namespace": True,
    "seccomp": True,
    "no-new-privs": True,
    "capabilities-dropped": True,
    "unprivileged-agent-uid": True,
    "separate-host-uid": False,
    "own-userns-owner": False,
    "new-session": True,
    "closed-fds": True,
    "cgroup-memory": True,
    "cgroup-swap": True,
    "cgroup-pids": True,
    "cgroup-cpu": True,
    "cgroup-kill": True,
    "disk-quota": True,
    "rlimits": True,
    "mount-setattr": True,
    "pidfd": True,
    "clone3": True,
    # A capability of the host, not a protection of every sandbox: sandboxes on an image
    # (SandboxSpec.image) need it, and fail closed without it.
    "image-overlay": False,
}
CGROUP_LINES = ("cgroup-memory", "cgroup-swap", "cgroup-pids", "cgroup-cpu", "cgroup-kill")
# What a sandbox without a cgroup goes without: allow_degraded=NO_CGROUP accepts that.
NO_CGROUP = frozenset(CGROUP_LINES)
NAMESPACES = {"user-namespace": "user", "pid-namespace": "pid", "mount-namespace": "mnt",
              "network-namespace": "net", "ipc-namespace": "ipc", "uts-namespace": "uts",
              "cgroup-namespace": "cgroup"}
