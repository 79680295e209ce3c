"""The egress proxy in a process of its own (karotte/egress/process.py): the same checks,
records across the pair, and no proxy left when its trainer dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from egress_servers import http_server, listener
from karotte import net
from karotte.egress import EgressProcess, parse_policy
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

NAMES = {"files.test": ["127.0.0.1"], "evil.test": ["127.0.0.1"]}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "hello.txt").write_text("hello\n")
    with http_server(directory=str(tmp_path)) as server:
        yield server


def curl(proxy, url):
    return subprocess.run(["curl", "-sS", "--max-time", "20", "-x", proxy, url],
                          capture_output=True, text=True)


def test_a_proxy_process_checks_and_records_like_the_thread(files):
    with EgressProcess(NAMES) as egress:
        front = listener()
        proxy = f"http://127.0.0.1:{front.getsockname()[1]}"
        session = egress.serve(parse_policy([f"files.test:{files.port}",
                                             f"127.0.0.1:{files.port}"]), proxy=front)
        assert front.fileno() == -1  # the child holds the listener now
        assert curl(proxy, f"http://files.test:{files.port}/hello.txt").stdout == "hello\n"
        assert "not_allowed" in curl(proxy, f"http://evil.test:{files.port}/").stdout
        assert [(r.host, r.reason) for r in session.record().reaches] == [
            ("files.test", "ok"), ("evil.test", "not_allowed")]
        session.close()
        assert len(session.record().reaches) == 2  # kept after the close
        assert curl(proxy, f"http://files.test:{files.port}/hello.txt").returncode != 0


def test_a_proxy_process_serves_a_sandbox(files):
    old = net.use_egress_proxy(EgressProcess(NAMES))
    try:
        spec = SandboxSpec(network=parse_policy([f"files.test:{files.port}",
                                                 f"127.0.0.1:{files.port}"]))
        with Sandbox(spec) as sb:
            r = sb.exec(["curl", "-sS", f"http://files.test:{files.port}/hello.txt"])
            assert r.stdout == b"hello\n", r.stderr
            assert sb.egress_record().reaches[0].allowed
    finally:
        net.use_egress_proxy(old).close()


def test_EGRESS_ORPHAN_01_a_proxy_process_ends_with_its_trainer_however_it_dies():
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from karotte.egress import EgressProcess
        egress = EgressProcess()
        print(egress.child_pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    child = int(trainer.stdout.readline())
    assert psutil.pid_exists(child)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the proxy process outlived its trainer")


def test_an_error_in_the_proxy_process_is_raised_in_the_trainer():
    with EgressProcess() as egress:
        with pytest.raises(KeyError):
            egress._call("record", 12345)
