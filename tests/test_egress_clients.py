"""Real clients through the egress proxy to real servers on 127.0.0.1: curl, urllib, a
raw socket, pip from a local index, git clone over smart HTTP; allowed and refused.

The servers listen on loopback, so each allow-list lists 127.0.0.1 with the server's
port, which is what an internal address needs (karotte/egress/policy.py)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from egress_servers import GitHandler, Gateway, file_server, http_server, make_wheel

pytestmark = pytest.mark.skipif(not shutil.which("curl") or not shutil.which("git"),
                                reason="curl and git are needed (apt install curl git)")

NAMES = {"files.test": ["127.0.0.1"], "pypi.test": ["127.0.0.1"], "git.test": ["127.0.0.1"],
         "evil.test": ["127.0.0.1"]}


@pytest.fixture
def gateway():
    with Gateway(NAMES) as gw:
        yield gw


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    with file_server(tmp_path_factory.mktemp("files"),
                     {"hello.txt": "hello from files.test\n"}) as server:
        yield server


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    with file_server(tmp_path_factory.mktemp("tls"), {"hello.txt": "hello over tls\n"},
                     tls_names=["files.test", "evil.test"]) as server:
        yield server


def curl(proxy, *args):
    return subprocess.run(["curl", "-sS", "--max-time", "20", "-x", proxy, *args],
                          capture_output=True, text=True, env={"PATH": os.environ["PATH"]})


def allowing(server, name):
    return [f"{name}:{server.port}", f"127.0.0.1:{server.port}"]


# --- curl -------------------------------------------------------------------------

def test_curl_fetches_an_allowed_name_and_is_refused_another(gateway, files):
    session, proxy, _ = gateway.serve(allowing(files, "files.test"))
    ok = curl(proxy, "-f", f"http://files.test:{files.port}/hello.txt")
    assert ok.returncode == 0 and ok.stdout == "hello from files.test\n"
    refused = curl(proxy, "-i", f"http://evil.test:{files.port}/hello.txt")
    assert "403 Forbidden" in refused.stdout and "X-Karotte-Egress: not_allowed" in refused.stdout
    first, second = session.record().reaches
    assert (first.via, first.host, first.port, first.allowed, first.reason) == (
        "http", "files.test", files.port, True, "ok")
    assert first.bytes_received > len("hello from files.test\n") and first.bytes_sent > 0
    assert (second.host, second.allowed, second.reason) == ("evil.test", False, "not_allowed")


def test_curl_tunnels_tls_to_an_allowed_name_and_is_refused_another(gateway, tls_files):
    session, proxy, _ = gateway.serve(allowing(tls_files, "files.test"))
    ok = curl(proxy, "-f", "--cacert", tls_files.cert,
              f"https://files.test:{tls_files.port}/hello.txt")
    assert ok.returncode == 0 and ok.stdout == "hello over tls\n", ok.stderr
    refused = curl(proxy, "--cacert", tls_files.cert,
                   f"https://evil.test:{tls_files.port}/hello.txt")
    assert refused.returncode != 0 and "403" in refused.stderr
    tunnel, refusal = session.record().reaches
    assert (tunnel.via, tunnel.allowed, tunnel.reason) == ("connect", True, "ok")
    assert tunnel.bytes_received > 1000  # the server's certificate came back
    assert (refusal.via, refusal.reason) == ("connect", "not_allowed")


# --- urllib -----------------------------------------------------------------------

def opener(proxy):
    return urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy,
                                                                    "https": proxy}))


def test_urllib_fetches_and_posts_through_the_proxy_and_reads_a_refusal(gateway, files):
    _, proxy, _ = gateway.serve(allowing(files, "files.test"))
    url = f"http://files.test:{files.port}"
    with opener(proxy).open(f"{url}/hello.txt", timeout=20) as reply:
        assert reply.read() == b"hello from files.test\n"
    body = os.urandom(300_000)
    with opener(proxy).open(urllib.request.Request(f"{url}/upload", data=body), timeout=20) as r:
        import hashlib
        assert r.read().decode() == hashlib.sha256(body).hexdigest()
    with pytest.raises(urllib.error.HTTPError) as info:
        opener(proxy).open(f"http://evil.test:{files.port}/hello.txt", timeout=20)
    assert info.value.code == 403 and info.value.headers["X-Karotte-Egress"] == "not_allowed"
    assert "add it to the sandbox's allow-list" in info.value.read().decode()


def test_urllib_over_https_verifies_the_real_server_through_the_tunnel(gateway, tls_files):
    _, proxy, _ = gateway.serve(allowing(tls_files, "files.test"))
    context = ssl.create_default_context(cafile=tls_files.cert)
    handlers = [urllib.request.ProxyHandler({"https": proxy}),
                urllib.request.HTTPSHandler(context=context)]
    with urllib.request.build_opener(*handlers).open(
            f"https://files.test:{tls_files.port}/hello.txt", timeout=20) as reply:
        assert reply.read() == b"hello over tls\n"


# --- a raw socket -----------------------------------------------------------------

def raw_exchange(proxy, data, read_until_close=True):
    host, port = proxy.rsplit(":", 1)
    with socket.create_connection((host[len("http://"):], int(port)), timeout=20) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_a_raw_socket_speaks_absolute_form_http_through_the_proxy(gateway, files):
    _, proxy, _ = gateway.serve(allowing(files, "files.test"))
    reply = raw_exchange(proxy, (f"GET http://files.test:{files.port}/hello.txt HTTP/1.1\r\n"
                                 f"Host: files.test:{files.port}\r\nConnection: close\r\n\r\n"
                                 ).encode())
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello from files.test\n")
    refused = raw_exchange(proxy, b"GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 403") and b"X-Karotte-Egress: not_allowed" in refused


# --- pip --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    (root / "simple" / "egress-probe").mkdir(parents=True)
    wheel = os.path.basename(make_wheel(str(root / "simple" / "egress-probe"),
                                        "egress_probe", "1.2.3"))
    (root / "simple" / "egress-probe" / "index.html").write_text(
        f'<html><body><a href="{wheel}">{wheel}</a></body></html>\n')
    with http_server(directory=str(root)) as server:
        yield server


def pip_install(proxy, index_url, target):
    env = {"PATH": os.environ["PATH"], "PIP_CONFIG_FILE": os.devnull, "HOME": str(target),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    return subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir",
                           "--retries", "0", "--timeout", "10", "--proxy", proxy,
                           "--index-url", index_url, "--trusted-host", index_url.split("/")[2],
                           "--target", str(target), "egress-probe"],
                          capture_output=True, text=True, env=env, timeout=120)


def test_pip_installs_from_an_allowed_index_and_not_from_another(gateway, index, tmp_path):
    session, proxy, _ = gateway.serve(allowing(index, "pypi.test"))
    done = pip_install(proxy, f"http://pypi.test:{index.port}/simple/", tmp_path / "ok")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ok" / "egress_probe.py").read_text() == "VALUE = '1.2.3'\n"
    assert {(r.host, r.allowed) for r in session.record().reaches} == {("pypi.test", True)}
    refused = pip_install(proxy, f"http://evil.test:{index.port}/simple/", tmp_path / "no")
    assert refused.returncode != 0 and not (tmp_path / "no" / "egress_probe.py").exists()
    assert ("evil.test", False, "not_allowed") in {
        (r.host, r.allowed, r.reason) for r in session.record().reaches}


# --- git --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def git_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("git")
    work = root / "work"
    env = {"PATH": os.environ["PATH"], "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1"}
    git = lambda *a, cwd=root: subprocess.run(["git", *a], cwd=cwd, env=env, check=True,
                                              capture_output=True)
    git("init", "-q", "-b", "main", str(work))
    (work / "README").write_text("cloned through the proxy\n")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m",
        "first", cwd=work)
    git("add", "README", cwd=work)
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "readme", cwd=work)
    git("clone", "-q", "--bare", str(work), str(root / "repo.git"))
    with http_server(GitHandler, root=str(root)) as server:
        yield server


def git_clone(proxy, url, dest):
    env = {"PATH": os.environ["PATH"], "HOME": str(dest.parent), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(["git", "-c", f"http.proxy={proxy}", "clone", "-q", url, str(dest)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_git_clones_over_smart_http_from_an_allowed_host_only(gateway, git_server, tmp_path):
    session, proxy, _ = gateway.serve(allowing(git_server, "git.test"))
    done = git_clone(proxy, f"http://git.test:{git_server.port}/repo.git", tmp_path / "a")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a" / "README").read_text() == "cloned through the proxy\n"
    assert any(m == "POST" and "git-upload-pack" in p for m, p, _ in git_server.seen)
    refused = git_clone(proxy, f"http://evil.test:{git_server.port}/repo.git", tmp_path / "b")
    assert refused.returncode != 0 and "403" in refused.stderr
    assert not (tmp_path / "b").exists()
    assert {r.reason for r in session.record().reaches if r.host == "evil.test"} == {
        "not_allowed"}


# --- a named upstream -------------------------------------------------------------

def test_an_upstream_is_plain_http_inside_and_tls_with_credentials_outside(gateway, tls_files):
    secret = "Bearer sk-never-in-the-sandbox"
    session, _, ups = gateway.serve(
        [f"127.0.0.1:{tls_files.port}"],
        {"model": {"url": f"https://files.test:{tls_files.port}/v1", "ca_file": tls_files.cert,
                   "headers": {"Authorization": secret}}})
    agent = subprocess.run(["curl", "-sS", "-f", "-H", "Authorization: Bearer agent-guess",
                            f"{ups['model']}/echo-headers"], capture_output=True, text=True)
    assert agent.returncode == 0, agent.stderr
    method, path, headers = tls_files.seen[-1]
    assert (method, path) == ("GET", "/v1/echo-headers")
    assert headers["Authorization"] == secret and headers["Host"] == f"files.test:{tls_files.port}"
    assert "agent-guess" not in json.dumps(headers)
    (reach,) = session.record().reaches
    assert (reach.via, reach.host, reach.port, reach.allowed) == (
        "upstream:model", "files.test", tls_files.port, True)


def test_an_upstream_whose_certificate_does_not_verify_is_not_reached(gateway, tls_files):
    session, _, ups = gateway.serve([f"127.0.0.1:{tls_files.port}"], {
        "model": {"url": f"https://files.test:{tls_files.port}", "headers": {"X-Key": "k"}}})
    before = len(tls_files.seen)
    out = subprocess.run(["curl", "-sS", "-i", f"{ups['model']}/hello.txt"],
                         capture_output=True, text=True)
    assert "502 Bad Gateway" in out.stdout and "connect_failed" in out.stdout
    assert "CERTIFICATE_VERIFY_FAILED" in out.stdout and len(tls_files.seen) == before
    (reach,) = session.record().reaches
    assert (reach.allowed, reach.reason) == (True, "connect_failed")


def test_EGRESS_ECHO_01_a_trace_to_an_upstream_is_refused_so_its_echo_holds_no_credential(
        gateway, tls_files):
    # TRACE's answer is the request as the upstream got it: with the key the host added.
    secret = "Bearer sk-never-in-the-sandbox"
    session, _, ups = gateway.serve(
        [f"127.0.0.1:{tls_files.port}"],
        {"model": {"url": f"https://files.test:{tls_files.port}/v1", "ca_file": tls_files.cert,
                   "headers": {"Authorization": secret}}})
    before = len(tls_files.seen)
    for method in ("TRACE", "track"):
        out = subprocess.run(["curl", "-sS", "-i", "-X", method, f"{ups['model']}/x"],
                             capture_output=True, text=True)
        assert "X-Karotte-Egress: bad_request" in out.stdout and secret not in out.stdout
    assert len(tls_files.seen) == before
    assert [r.reason for r in session.record().reaches] == ["bad_request", "bad_request"]
