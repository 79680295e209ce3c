"""The network part of the sandbox plan, and the sandbox's side of egress.

Every sandbox has a network namespace of its own (karotte/native.py). With network "none"
(the default) init brings its loopback up and nothing else: no interface, no route out.
With an EgressPolicy (karotte/egress/policy.py) init also makes, on that loopback and
before any agent code runs, the listeners of the host-side proxy: the forward proxy at
127.0.0.1:3128 and each named upstream at 127.0.0.1:3129, 3130, ... (in the policy's
order), on a loopback that carries TCP segments of 512 KiB from Linux 6.6 (BIG TCP: the
proxy's side of every agent connection runs there). It hands their fds to the host with
KP_READY (bring_up_loopback and ready_fds in csrc/init/net.c) and keeps no copy; the
host's EgressProxy serves them with one check for every request (docs/egress.md). The
namespace still has no route out and no resolver, so the proxy is the only way out, and
DNS carries nothing.

With an EgressPolicy of mode "ip" (root only) the sandbox gets a veth instead, made before
init's go: an address, a default route to the host, and nftables rules on the host that
let out only the listed addresses and ports (karotte/egress/ip.py); no listeners, no
proxy variables, still no resolver.

The other parts of network policy: SandboxSpec validates `network` (karotte/spec.py), the
seccomp policy allows only UNIX, IPv4 and IPv6 sockets (karotte/seccomp.py), and
`karotte-sandbox check` judges the network-namespace line (karotte/probe/verdicts.py).
"""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence

from . import protocol as p
from .egress.check import Resolver, system_resolver
from .egress.ip import IpLink
from .egress.policy import EgressConfigError, EgressPolicy
from .egress.server import EgressProxy, EgressSession
from .spec import SandboxSpec

PROXY_PORT = 3128
FIRST_UPSTREAM_PORT = 3129
MAX_UPSTREAMS = 3  # MAX_LISTEN of csrc/init/init.h, less the forward proxy
NO_PROXY = "localhost,127.0.0.1,::1"  # the sandbox's own loopback, and the upstreams

_lock = threading.Lock()
_proxy: EgressProxy | None = None
_ip_resolve: Resolver = system_resolver


def _proxied(spec: SandboxSpec) -> EgressPolicy | None:
    policy = spec.network
    return policy if isinstance(policy, EgressPolicy) and policy.mode == "proxy" else None


def listen_ports(spec: SandboxSpec) -> list[int]:
    """The ports init listens on inside the sandbox: none for "none" and the ip mode."""
    policy = _proxied(spec)
    if policy is None:
        return []
    if len(policy.upstreams) > MAX_UPSTREAMS:
        raise EgressConfigError(f"a sandbox has at most {MAX_UPSTREAMS} named upstreams, "
                                f"not {len(policy.upstreams)}: serve the others behind one")
    return [PROXY_PORT] + [FIRST_UPSTREAM_PORT + i for i in range(len(policy.upstreams))]


def add_network_plan(msg: p.Message, spec: SandboxSpec) -> None:
    """Append the network plan to a CONFIG message: loopback up, then the listeners."""
    msg.record(p.T_LOOPBACK, b"".join(port.to_bytes(4, "little")
                                      for port in listen_ports(spec)))


def proxy_env(spec: SandboxSpec) -> dict[str, str]:
    """What common clients read to use the proxy (curl, pip, git, npm, urllib,
    requests), and KAROTTE_UPSTREAM_<NAME> for each upstream: none for "none" and the
    ip mode."""
    policy = _proxied(spec)
    if policy is None:
        return {}
    url = f"http://127.0.0.1:{PROXY_PORT}"
    env = {}
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        env[name] = env[name.upper()] = url
    env["no_proxy"] = env["NO_PROXY"] = NO_PROXY
    env["npm_config_proxy"] = env["npm_config_https_proxy"] = url
    env["PIP_PROXY"] = url
    for i, up in enumerate(policy.upstreams):
        env[f"KAROTTE_UPSTREAM_{up.name.upper()}"] = (
            f"http://127.0.0.1:{FIRST_UPSTREAM_PORT + i}")
    return env


def egress_proxy() -> EgressProxy:
    """This process's proxy, started on first use."""
    global _proxy
    with _lock:
        # a forked child inherits the object but not the thread that runs its loop
        if _proxy is None or _proxy.pid != os.getpid():
            _proxy = EgressProxy()
        return _proxy


def use_egress_proxy(proxy: EgressProxy | None) -> EgressProxy | None:
    """Serve the sandboxes made from now on with proxy (one with its own resolver, say);
    None: the default again. Returns the one it replaces."""
    global _proxy
    with _lock:
        old, _proxy = _proxy, proxy
        return old


def start_egress(spec: SandboxSpec, fds: Sequence[int]) -> EgressSession | None:
    """Serve the listeners init handed over (KP_READY's fds after the workspace's); takes
    the fds over, closing them if it cannot."""
    policy = spec.network
    ports = listen_ports(spec)
    if len(fds) != len(ports):
        for fd in fds:
            os.close(fd)
        if not ports:
            return None
        raise ValueError(f"karotte-init handed over {len(fds)} listeners, not {len(ports)}")
    if not ports:
        return None
    socks = [socket.socket(fileno=fd) for fd in fds]
    try:
        return egress_proxy().serve(policy, proxy=socks[0], upstreams={
            up.name: sock for up, sock in zip(policy.upstreams, socks[1:])})
    except BaseException:
        for sock in socks:
            sock.close()
        raise


def use_ip_resolver(resolve: Resolver | None) -> Resolver:
    """Resolve the ip mode's names with resolve from now on (a static table, say); None:
    the host's resolver again. Returns the one it replaces."""
    global _ip_resolve
    with _lock:
        old, _ip_resolve = _ip_resolve, resolve or system_resolver
        return old


def start_ip(spec: SandboxSpec, init_pid: int) -> IpLink | None:
    """The ip mode's veth and rules for the sandbox of init_pid, before its init's go (no
    agent code has run); None for the other modes."""
    policy = spec.network
    if not (isinstance(policy, EgressPolicy) and policy.mode == "ip"):
        return None
    return IpLink.open(policy, init_pid, _ip_resolve)
