"""The network part of the sandbox plan.

Every sandbox has a network namespace of its own (karotte/native.py). With network "none",
the only value SandboxSpec accepts, init brings its loopback up and nothing else: no
interface, no route out. The other parts of network policy: SandboxSpec validates
`network` (karotte/spec.py), the seccomp policy allows only UNIX, IPv4 and IPv6 sockets
(karotte/seccomp.py), init brings lo up (bring_up_loopback in csrc/init/net.c), and
`karotte-sandbox check` judges the network-namespace line (karotte/probe/verdicts.py).
"""
from __future__ import annotations

from . import protocol as p
from .spec import SandboxSpec


def add_network_plan(msg: p.Message, spec: SandboxSpec) -> None:
    """Append the network plan to a CONFIG message: for "none", bring loopback up."""
    if spec.network != "none":  # SandboxSpec refuses any other value
        raise ValueError(f"no network plan for network={spec.network!r}")
    msg.record(p.T_LOOPBACK)
