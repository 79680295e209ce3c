"""Host probe: what this machine can enforce, and for what it cannot, why and the fix.

``probe()`` does not reason from kernel versions and config files alone: it creates a
small real sandbox, runs a Python one-liner inside it as the agent, and compares what
the agent sees (its namespaces, ``/proc/self/status``, mounts, rlimits, the errno of
syscalls the seccomp policy denies) with what the host sees (its own namespaces, the
sandbox cgroup's limit files, the host uid that owns a file the agent wrote). A
protection is reported as enforced only when that evidence shows it in force.

If the sandbox cannot be created, the protections named by the error are reported
missing with the error's message, and the ones that could not be tested say so.
"""
from __future__ import annotations

import time

from ..protections import CGROUP_LINES, NAMESPACES, PROTECTIONS
from ..userns import userns_blocker, userns_owner
from .evidence import PROBE_SPEC, _host, _run_sandbox
from .report import HostReport, Protection, render_text, to_json
from .verdicts import judge


def probe() -> HostReport:
    """Test what this host enforces by building a small sandbox and looking inside it.

    Never raises for a host problem: what cannot be tested is reported missing, with
    the reason. Takes well under a second on a host that works.
    """
    start = time.monotonic()
    host = _host()
    run = _run_sandbox()
    protections = judge(host, run)
    return HostReport(protections=protections, kernel=host.kernel,
                      cgroup_version=host.cgroup_version, running_as_root=host.root,
                      uid=host.euid, userns_sysctls=host.sysctls, seconds=time.monotonic() - start)


__all__ = ["probe", "HostReport", "Protection", "PROTECTIONS", "CGROUP_LINES", "NAMESPACES",
           "PROBE_SPEC", "render_text", "to_json", "userns_blocker", "userns_owner"]
