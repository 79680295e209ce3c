"""A host tool's network by allow-list: an image build's apt reaches Debian's archive
only, through the same host-side check as a sandbox's agent (docs/egress.md, "Image
builds").

mmdebstrap unshares no network namespace of its own, so its apt, and every maintainer
script it runs, would have the host's whole network. BuildNetwork gives it one: a
worker thread unshares a fresh network namespace (network namespaces are per thread, so
the rest of the process stays where it was), brings its loopback up and listens there at
127.0.0.1:3128, and every command it runs is forked from that thread, into that
namespace. The only way out is the listener, which an EgressProxy of the build's own (or
the caller's) serves with one EgressPolicy: no route, no resolver, DNS carries nothing, and what the build
reached is an EgressRecord. Root only: a thread cannot unshare a network namespace
without CAP_SYS_ADMIN, and a process with threads cannot unshare a user namespace.

    with BuildNetwork(archive_policy()) as build:
        done = build.run([mmdebstrap, *build.apt_options(), "bookworm", out], capture_output=True)
    build.record()
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from .egress.policy import EgressPolicy, parse_policy
from .egress.server import EgressProxy, EgressSession
from .errors import KarotteError
from .results import EgressRecord

CLONE_NEWNET = 0x40000000  # linux/sched.h
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1  # linux/sockios.h, linux/if.h
ARCHIVE = ("deb.debian.org", "security.debian.org")  # ports 80 and 443
EXTRA_ENV = "KAROTTE_BUILD_ALLOW"  # more entries, comma-separated (a mirror, its address)
PORT = 3128  # in the build's namespace, as in a sandbox's (karotte/net.py)
PROXY = f"http://127.0.0.1:{PORT}"
NO_PROXY = "localhost,127.0.0.1,::1"


def archive_policy(extra: Sequence[str] = ()) -> EgressPolicy:
    """Debian's archive, and the entries of `extra` and of $KAROTTE_BUILD_ALLOW (a
    mirror). The addresses this host's resolver gives the archive's names now are listed
    too: where it maps them to a mirror or cache on a private or reserved address (this
    host's own setup, not the build's), the check would refuse them otherwise."""
    more = [e.strip() for e in os.environ.get(EXTRA_ENV, "").split(",") if e.strip()]
    return parse_policy([*ARCHIVE, *_addresses(ARCHIVE), *extra, *more])


def _addresses(names: Sequence[str]) -> list[str]:
    found = set()
    for name in names:
        try:
            found.update(info[4][0] for info in socket.getaddrinfo(name, 80,
                                                                   type=socket.SOCK_STREAM))
        except OSError:
            continue  # it does not resolve here: apt says so, through the proxy
    return [f"[{a}]" if ":" in a else a for a in sorted(found)]


class BuildNetwork:
    """Commands in a network namespace of their own whose only way out is the proxy."""

    def __init__(self, policy: EgressPolicy, proxy: EgressProxy | None = None):
        """proxy: the EgressProxy that serves it (one with its own resolver, say); None:
        one of the build's own, for as long as it runs."""
        if os.geteuid() != 0:
            raise KarotteError("a build's network namespace needs root (CAP_SYS_ADMIN): run "
                               "the build as root, or without an allow-list")
        self.policy = policy
        self._proxy, self._own = proxy or EgressProxy(), proxy is None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="karotte-build-net")
        self._session: EgressSession | None = None

    def __enter__(self) -> BuildNetwork:
        try:
            listener = self._worker.submit(_enter_namespace).result()
            self._session = self._proxy.serve(self.policy, proxy=listener)
        except BaseException:
            self._end()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._session is not None:
            self._session.close(wait=True)
        self._end()

    def _end(self) -> None:
        self._worker.shutdown()  # the thread, and with it the namespace, ends
        if self._own:
            self._proxy.close()

    @staticmethod
    def apt_options() -> list[str]:
        """mmdebstrap's options that send its apt through the proxy."""
        return [f'--aptopt=Acquire::http::Proxy "{PROXY}"',
                f'--aptopt=Acquire::https::Proxy "{PROXY}"']

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run(argv, **kwargs) inside the namespace, with the proxy variables
        that curl, pip, git and apt read set over the caller's env (or this process's)."""
        env = {**(kwargs.pop("env", None) or os.environ), **_proxy_env()}
        return self._worker.submit(subprocess.run, list(argv), env=env, **kwargs).result()

    def record(self) -> EgressRecord:
        """What the commands reached, allowed or refused and why."""
        return self._session.record() if self._session is not None else EgressRecord()


def run_build(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """mmdebstrap's argv (options, then suite and target) run as subprocess.run would,
    its apt and hooks reaching only archive_policy() when this process is root; as
    another user, as it is (mmdebstrap's unshare mode has the host's network then)."""
    if os.geteuid() != 0:
        return subprocess.run(list(argv), **kwargs)
    with BuildNetwork(archive_policy()) as build:
        return build.run([argv[0], *build.apt_options(), *argv[1:]], **kwargs)


def _proxy_env() -> dict[str, str]:
    env = {}
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        env[name] = env[name.upper()] = PROXY
    env["no_proxy"] = env["NO_PROXY"] = NO_PROXY
    return env


def _enter_namespace() -> socket.socket:
    """In the worker thread: a fresh network namespace, its loopback up, the listener."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise KarotteError(f"cannot unshare a network namespace for the build: "
                           f"{os.strerror(err)}; run the build as root")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS,
                                                  struct.pack("16sH22x", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", PORT))
    listener.listen(64)
    return listener
