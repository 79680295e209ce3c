"""A command's environment and working directory in a sandbox: Karotte's defaults, then
the image config's (SandboxSpec.image, karotte/imageroot.py), then the caller's."""
from __future__ import annotations

import math
import os
from typing import Mapping

from . import imageroot, mounts, net
from .spec import SandboxSpec

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": mounts.HOME,
    "USER": "agent",
    "LOGNAME": "agent",
    "SHELL": "/bin/bash",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    # The CPUs to plan for (nproc, OpenMP, BLAS): the spec's bandwidth rounded up, set by
    # exec_env(). cpu_count() and /proc/cpuinfo still show every host CPU: the limit is
    # bandwidth on all of them, not a few CPUs.
    "OMP_NUM_THREADS": "1",
}


def exec_env(spec: SandboxSpec, env: Mapping[str, str] | None,
             root: imageroot.ImageRoot | None = None) -> dict[str, str]:
    """The environment of a command: DEFAULT_ENV with OMP_NUM_THREADS for the spec's CPUs
    (never more than the host has), then the image config's Env (on an image), then the
    egress proxy's variables (karotte/net.py), then the caller's env; each may replace any
    of what comes before it."""
    cpus = min(math.ceil(spec.cpus), len(os.sched_getaffinity(0)))
    return {**DEFAULT_ENV, "OMP_NUM_THREADS": str(cpus), **(root.env if root else {}),
            **net.proxy_env(spec),  # over an image's own proxy settings, which lead nowhere
            **(env or {})}


def exec_cwd(cwd: str | None, root: imageroot.ImageRoot | None = None) -> str:
    """The working directory of a command: the caller's, else the image config's
    WorkingDir (on an image), else /workspace."""
    return cwd or (root.workdir if root is not None and root.workdir else mounts.WORKSPACE)
