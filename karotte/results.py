"""Result records that cross layers and processes (plain data, standard library only).

ExecResult is also what a grader running inside its own sandbox gets back for the
agent's program, so this module must import nothing that needs the native layer.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecResult:
    """How one command ended. Exactly one of exit_code and signal is set, unless the
    command could not start (error is set, exit_code 127)."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool  # more was written than SandboxSpec.output_limit
    stderr_truncated: bool
    timed_out: bool  # killed by Karotte at the timeout
    oom_killed: bool  # the kernel's OOM killer acted in the sandbox during the exec
    wall_seconds: float  # host monotonic clock, from request to exit report
    cpu_seconds: float  # user + system time of the command and the children it waited for
    peak_memory: int | None  # bytes, the cgroup's peak during the exec; None where the
    # kernel cannot reset the peak per exec (cgroup v2 before Linux 6.12) or no cgroup
    error: str | None = None  # why the command could not start

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out
