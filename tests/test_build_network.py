"""A build's network by allow-list (karotte/build_network.py): host commands, mmdebstrap
among them, in a network namespace of their own whose only way out is the host-side
egress proxy. Servers on the host's 127.0.0.1 with the test's own resolver table; the
mmdebstrap test reaches Debian's archive, and nothing else."""
from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tarfile

import pytest

from egress_servers import http_server
from karotte.build_network import ARCHIVE, BuildNetwork, archive_policy
from karotte.egress import EgressProxy, parse_policy, static_resolver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a build's network namespace "
                                "needs root (CAP_SYS_ADMIN)")


@pytest.fixture
def mirror(tmp_path):
    (tmp_path / "Release").write_text("Suite: test\n")
    with EgressProxy(static_resolver({"mirror.test": ["127.0.0.1"],
                                      "evil.test": ["127.0.0.1"]})) as egress, \
            http_server(directory=str(tmp_path)) as server:
        server.proxy = egress
        yield server


def sh(build, script):
    return build.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)


def test_a_build_reaches_its_allow_list_through_the_proxy_and_nothing_else(mirror):
    port = mirror.port
    policy = parse_policy([f"mirror.test:{port}", f"127.0.0.1:{port}"])
    with BuildNetwork(policy, mirror.proxy) as build:
        ok = sh(build, f"curl -sSf http://mirror.test:{port}/Release")
        refused = sh(build, f"curl -s -o /dev/null -w '%{{http_code}}' http://evil.test:{port}/")
        # a client that ignores the proxy: the host's loopback is not this namespace's
        direct = sh(build, f"curl -sS --noproxy '*' --max-time 5 http://127.0.0.1:{port}/Release")
        links = sh(build, "ip -o link; ip route")
        assert socket.create_connection(("127.0.0.1", port)).close() is None  # host: still there
    assert ok.stdout == "Suite: test\n"
    assert refused.stdout == "403"
    assert direct.returncode == 7 and "Suite" not in direct.stdout
    assert links.stdout.split()[1] == "lo:" and "link/loopback" in links.stdout
    assert len(links.stdout.splitlines()) == 1  # one interface, no route
    assert [(r.host, r.allowed, r.reason) for r in build.record().reaches] == [
        ("mirror.test", True, "ok"), ("evil.test", False, "not_allowed")]


def test_the_namespace_is_the_worker_threads_only(mirror):
    mine = os.readlink("/proc/thread-self/ns/net")
    with BuildNetwork(parse_policy([]), mirror.proxy) as build:
        theirs = sh(build, "readlink /proc/self/ns/net").stdout.strip()
        assert os.readlink("/proc/thread-self/ns/net") == mine
    assert theirs != mine


@pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap is not installed")
def test_EGRESS_BUILD_01_mmdebstrap_and_its_hooks_reach_only_debians_archive(tmp_path):
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo("deb.debian.org", 80)}
    except OSError as exc:
        pytest.skip(f"Debian's archive does not resolve here: {exc}")
    out = tmp_path / "bookworm.tar"
    policy = archive_policy()  # lists what the archive resolves to here: a reserved address
    assert all(policy.lists_address(ipaddress.ip_address(a), 80) for a in addresses)
    with BuildNetwork(policy) as build:
        done = build.run(["mmdebstrap", "--quiet", "--variant=essential", "--mode=unshare",
                          *build.apt_options(),
                          "--customize-hook=curl -s -o /dev/null --max-time 5 "
                          "http://karotte-unlisted.invalid/ || true",
                          "bookworm", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    with tarfile.open(out) as tar:
        assert any(name.endswith("bin/dpkg") for name in tar.getnames())
    reaches = build.record().reaches
    allowed = [r for r in reaches if r.allowed]
    assert allowed and {r.host for r in allowed} <= set(ARCHIVE)
    assert sum(r.bytes_received for r in allowed) > 10_000_000  # the packages came this way
    assert [(r.host, r.reason) for r in reaches if not r.allowed] == [
        ("karotte-unlisted.invalid", "not_allowed")]
