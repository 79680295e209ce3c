"""The ip mode: a veth into the sandbox's network namespace, filtered by nftables on the host.

For root callers and protocols that are not HTTP (ssh, databases). Made before any agent
code runs (karotte/net.py, from Sandbox start, while init waits for its go):

- a veth pair: `kip<SLOT>` on the host, `eth0` in the sandbox, configured with pyroute2's
  IPRoute: on the host through this process's netlink socket, inside through a netlink
  socket opened in the sandbox's namespace (setns in a short thread) and handed to IPRoute
  by its fd, never pyroute2's NetNS helper process;
- addresses from RANGE, one /30 per slot: the host end .1, the sandbox .2, a default
  route through the host end. The slot is the interface name, which the kernel gives to
  one interface only, so concurrent sandboxes, of this process or any other, never share
  an address;
- a table of Karotte's own, `inet karotte-<pid>.<starttime>-<seq>-ip` (karotte/names.py),
  which touches no packet but this veth's and none of the host's other rules: packets
  from the sandbox to an allowed address and port (TCP or UDP) are accepted and
  masqueraded, replies come back, everything else is rejected and counted, and nothing
  reaches the host itself (input), whatever its address. The policy's EgressLimits are
  rules of the same table: `ct count` for max_connections, one named `limit` (a token
  bucket) for bytes_per_second and one named `quota` for max_bytes, each over both
  directions of all the sandbox's flows (docs/egress.md, "the limits");
- dynamic sets that count each remote end per reason, which record() reads and a
  Sandbox reads as each exec begins and ends (IpRecord.since), for ExecResult.egress_ip.

The allow-list is the proxy's grammar (karotte/egress/policy.py, mode="ip"); each name is
resolved once, on the host, at start, through the proxy's own check (check.py), so the
same guard refuses a name that resolves to loopback, link-local, private or metadata
addresses the list does not name. The sandbox gets no resolver: the agent uses addresses.

The kernel frees the veth with the namespace, when the sandbox's init is gone; the table
is the host's until it is deleted: by close(), or, after a SIGKILL of its creator, by
`karotte-sandbox gc`, which finds it by its name (find_stale, remove_stale), and a veth
whose namespace something still holds by the creator named in its alias.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import errno
import functools
import ipaddress
import json
import os
import random
import re
import socket
import threading
from collections.abc import Sequence

from .. import names
from ..results import IpReach, IpRecord, IpRule  # plain data: an ExecResult carries them
from .check import Resolver, check
from .policy import EgressConfigError, EgressLimits, EgressPolicy

# 16384 /30 slots in a block that is private (10/8) and rarely used by hosts, clouds or
# container runtimes (docker: 172.17/16 up; kubernetes: 10.96/12, 10.244/16).
RANGE = ipaddress.ip_network("10.213.0.0/16")
SLOTS = RANGE.num_addresses // 4
IFNAME_PREFIX = "kip"  # kip<SLOT>: IFNAMSIZ leaves no room for a names.leaf_name()
INSIDE_IFNAME = "eth0"
TABLE_TAG = "ip"
# Remote ends the rules name per reason, per sandbox (the totals count on past them). Each
# exec lists them twice, and a listing costs about 0.04 ms an element here (44 ms for a
# full set of 1024): the agent chooses how many there are, so few enough to stay cheap,
# and more than an Outcome holds (EPISODE_REACHES).
ENDS_KEPT = 256
MIN_BUCKET = 128 * 1024  # bytes: the pace's bucket holds at least two GSO packets
# Past max_bytes, TCP replies still reach the sandbox up to this much more (all its flows
# together), so that its next packet, refused with a reset, fails its connection at once
# rather than leaving it waiting for data the rules drop; then they are dropped too.
QUOTA_GRACE = 2**20
# The rules' dynamic sets of remote ends (address . protocol . port), each with counters,
# and the reason of karotte.egress.REASONS each one's reaches have.
REFUSED_SETS = (("refused_to", "ip_literal"), ("refused_host", "internal_address"),
                ("over_connections", "connections"), ("over_rate", "bytes_per_second"),
                ("over_bytes", "bytes_total"))
_TABLE = re.compile(r"^table inet (karotte-\S+)$", re.M)
_CLONE_NEWNET = 0x40000000
_NFT_CTX_OUTPUT_JSON = 1 << 4  # libnftables' enum nft_ctx_output_flags


def unavailable() -> str | None:
    """Why this process cannot use the ip mode, with the fix; None when it can."""
    if os.geteuid() != 0:
        return ("the ip mode needs root on the host (it makes a veth and nftables rules); "
                "run as root, or use the proxy mode (parse_policy(allow=[...])), which "
                "needs no privilege")
    if _nft_library() is None:
        return ("the ip mode needs libnftables (the nftables package): apt-get install "
                "nftables (scripts/setup installs it)")
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "the ip mode needs pyroute2: pip install 'karotte[ip]'"
    return None


def resolve_rules(policy: EgressPolicy, resolve: Resolver) -> tuple[IpRule, ...]:
    """The policy's destinations as addresses: each name resolved once, through check()
    (the allow-list, then the internal-address guard). EgressConfigError, naming the entry
    and the reason, for a name that check() refuses."""
    rules = []
    for rule in policy.rules:
        ports = None if rule.ports is None else tuple(sorted(rule.ports))
        entry = f"{rule.value}:{'*' if ports is None else ','.join(map(str, ports))}"
        if rule.kind == "network":
            rules.append(IpRule(entry, rule.value, ports))
            continue
        # every port of the entry: check() decides per port, and one may be listed
        addresses: dict[str, None] = {}
        for port in ports or (0,):
            verdict = asyncio.run(check(policy, rule.value, port, resolve))
            if not verdict.allowed:
                raise EgressConfigError(f"allow-list entry {entry}: {verdict.reason}"
                                        f"{': ' + verdict.detail if verdict.detail else ''}")
            addresses.update(dict.fromkeys(verdict.addresses))
        v4 = [a for a in addresses if ipaddress.ip_address(a).version == 4]
        if not v4:
            raise EgressConfigError(f"allow-list entry {entry}: {rule.value} has no IPv4 "
                                    "address, and the ip mode gives the sandbox IPv4 only")
        rules += [IpRule(entry, f"{a}/32", ports) for a in v4]
    return tuple(rules)


class IpLink:
    """One sandbox's veth and nftables table. Made by open(), removed by close()."""

    def __init__(self, slot: int, table: str, rules: tuple[IpRule, ...]):
        self.slot, self.table, self.rules = slot, table, rules
        base = RANGE.network_address + 4 * slot
        self.host_address, self.sandbox_address = str(base + 1), str(base + 2)
        self.interface = f"{IFNAME_PREFIX}{slot}"
        self._closed = False
        self._final: IpRecord | None = None  # the record as close() found it

    @classmethod
    def open(cls, policy: EgressPolicy, init_pid: int, resolve: Resolver) -> "IpLink":
        """Resolve the list, make the veth into init_pid's network namespace and load the
        rules, before init's go. If it raises, no table is left, and the veth goes with
        the namespace when the caller kills init (Sandbox start does)."""
        why = unavailable()
        if why:
            raise EgressConfigError(why)
        return _in_worker(cls._open, policy, init_pid, resolve)

    @classmethod
    def _open(cls, policy: EgressPolicy, init_pid: int, resolve: Resolver) -> "IpLink":
        rules = resolve_rules(policy, resolve)
        nsfd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            link = cls._make_veth(nsfd, names.leaf_name(TABLE_TAG), rules)
            try:
                link._check_replies_come_back()
                link._configure_inside(nsfd)
                _nft(link._ruleset(policy.limits))
            except BaseException:
                link.close()
                raise
        finally:
            os.close(nsfd)
        return link

    @classmethod
    def _make_veth(cls, nsfd: int, table: str, rules: tuple[IpRule, ...]) -> "IpLink":
        from pyroute2.netlink.exceptions import NetlinkError
        ipr = _host_iproute()
        for _ in range(64):
            link = cls(random.randrange(SLOTS), table, rules)
            try:
                ipr.link("add", ifname=link.interface, kind="veth",
                         peer={"ifname": INSIDE_IFNAME, "net_ns_fd": nsfd})
            except NetlinkError as exc:
                if exc.code == errno.EEXIST:
                    continue  # another sandbox's slot
                raise
            break
        else:
            raise EgressConfigError(f"no free slot for a veth in {RANGE} after 64 tries: "
                                    f"{SLOTS} sandboxes at once at most")
        index = ipr.link_lookup(ifname=link.interface)[0]
        # the alias names the creator, for gc: the interface name has no room
        ipr.link("set", index=index, ifalias=table)
        ipr.addr("add", index=index, address=link.host_address, prefixlen=30)
        ipr.link("set", index=index, state="up")
        _write_sysctl(f"ipv4/conf/{link.interface}/forwarding", "1")  # this interface only
        return link

    def _check_replies_come_back(self) -> None:
        """The replies to the sandbox arrive on the interface that leads to each
        destination, and the kernel forwards them only if that interface forwards: a
        named refusal now, not a connection that times out later. The host's settings
        are its own: this reads them and changes none."""
        if _read_sysctl("ipv4/conf/all/forwarding") == "1":
            return
        from pyroute2.netlink.exceptions import NetlinkError
        ipr = _host_iproute()
        for rule in self.rules:
            net = ipaddress.ip_network(rule.network)
            dst = str(net.network_address + (1 if net.num_addresses > 2 else 0))
            try:
                route = ipr.route("get", dst=dst)[0]
                if route["type"] != 1:  # RTN_UNICAST: local ones are refused anyway
                    continue
                ifname = ipr.get_links(route.get_attr("RTA_OIF"))[0].get_attr("IFLA_IFNAME")
            except NetlinkError:
                continue  # no route: the agent's connection fails like one to nowhere
            if _read_sysctl(f"ipv4/conf/{ifname}/forwarding") != "1":
                raise EgressConfigError(
                    f"allow-list entry {rule.entry}: the host reaches {dst} through {ifname}, "
                    f"which does not forward (net.ipv4.conf.{ifname}.forwarding=0), so no "
                    f"reply could come back to the sandbox; set it to 1 (sysctl -w "
                    f"net.ipv4.conf.{ifname}.forwarding=1, or net.ipv4.ip_forward=1)")

    def _configure_inside(self, nsfd: int) -> None:
        from pyroute2 import IPRoute
        fd = _netlink_socket_in(nsfd).detach()
        try:
            ns = IPRoute(fileno=fd)  # which closes fd when it closes
        except BaseException:
            os.close(fd)
            raise
        with ns:
            index = ns.link_lookup(ifname=INSIDE_IFNAME)[0]
            ns.addr("add", index=index, address=self.sandbox_address, prefixlen=30)
            ns.link("set", index=index, state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=self.host_address)

    def _ruleset(self, limits: EgressLimits) -> str:
        elements = ", ".join(
            f"{r.network} . {p}" for r in self.rules
            for p in (map(str, r.ports) if r.ports is not None else ("0-65535",)))
        iface, me = f'"{self.interface}"', self.sandbox_address
        refuse = 'counter name refused reject with icmpx type admin-prohibited'
        to, back = functools.partial(_note, end="d"), functools.partial(_note, end="s")
        dynamic = (f"type ipv4_addr . inet_proto . inet_service; size {ENDS_KEPT}; "
                   "flags dynamic; counter;")
        sets = "\n    ".join(f"set {name} {{ {dynamic} }}" for name in
                              ("sent", "received", *(n for n, _ in REFUSED_SETS)))
        # the limits, per sandbox: this table sees its packets only (docs/egress.md)
        objects, inbound = [], []
        allowed = [f"ct state new ct count over {limits.max_connections} goto over_connections"]
        if limits.bytes_per_second is not None:
            rate = limits.bytes_per_second
            burst = f" burst {MIN_BUCKET - rate} bytes" if rate < MIN_BUCKET else ""
            objects.append(f"limit pace {{ rate over {rate} bytes/second{burst} }}")
            allowed.append("limit name pace goto over_rate_out")
            inbound.append("limit name pace goto over_rate_in")
        if limits.max_bytes is not None:
            objects.append(f"quota total {{ over {limits.max_bytes} bytes }}")
            allowed.append("quota name total goto over_bytes_out")
            inbound.append("quota name total goto over_bytes_in")
        rules = "\n        ".join
        return f"""
table inet {self.table} {{
    counter refused {{ }}
    counter sent_total {{ }}
    counter received_total {{ }}
    quota grace {{ over {QUOTA_GRACE} bytes }}
    {"; ".join(objects)}
    set allow {{
        type ipv4_addr . inet_service; flags interval
        {f"elements = {{ {elements} }}" if elements else ""}
    }}
    {sets}
    chain forward {{
        type filter hook forward priority filter - 1; policy accept;
        iif {iface} jump outbound
        oif {iface} ct state established,related jump inbound
        oif {iface} {refuse}
    }}
    chain outbound {{
        ip saddr != {me} {refuse}
        meta l4proto {{ tcp, udp }} ip daddr . th dport @allow goto allowed
        ct state established,related accept
        {to("refused_to")}
        {refuse}
    }}
    chain allowed {{
        {rules(allowed)}
        counter name sent_total
        {to("sent")}
        accept
    }}
    chain inbound {{
        {rules(inbound)}
        counter name received_total
        {back("received")}
        accept
    }}
    chain over_connections {{
        {to("over_connections")}
        {refuse}
    }}
    chain over_rate_out {{
        {to("over_rate")}
        counter name refused drop
    }}
    chain over_rate_in {{
        {back("over_rate")}
        counter name refused drop
    }}
    chain over_bytes_out {{
        {to("over_bytes")}
        meta l4proto tcp counter name refused reject with tcp reset
        {refuse}
    }}
    chain over_bytes_in {{
        {back("over_bytes")}
        meta l4proto != tcp counter name refused drop
        quota name grace counter name refused drop
        accept
    }}
    chain input {{
        type filter hook input priority filter - 1; policy accept;
        iif {iface} {to("refused_host")}
        iif {iface} {refuse}
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {me} oif != {iface} masquerade
    }}
}}
"""

    def record(self) -> IpRecord:
        """What the rules counted so far (one listing of the table); after close(), what
        they had counted as it closed."""
        if self._final is not None:
            return self._final
        out = json.loads(_nft(f"list table inet {self.table}", as_json=True))["nftables"]
        sets = {o["set"]["name"]: {tuple(e["elem"]["val"]["concat"]): e["elem"]["counter"]
                                   for e in o["set"].get("elem", [])}
                for o in out if "set" in o and o["set"]["name"] != "allow"}
        counters = {o["counter"]["name"]: o["counter"] for o in out if "counter" in o}
        sent, received, none = sets["sent"], sets["received"], {"packets": 0, "bytes": 0}
        reaches = [IpReach(address, port, protocol, True, "ok", out_["packets"],
                           out_["bytes"], in_["packets"], in_["bytes"])
                   for address, protocol, port in {**sent, **received}
                   for out_, in_ in [(sent.get((address, protocol, port), none),
                                      received.get((address, protocol, port), none))]]
        reaches.sort(key=_order)
        refused = [IpReach(address, port, protocol, False, reason, c["packets"], c["bytes"])
                   for name, reason in REFUSED_SETS
                   for (address, protocol, port), c in sets[name].items()]
        refused.sort(key=_order)
        total = {name: counters[name] for name in ("refused", "sent_total", "received_total")}
        return IpRecord(self.interface, self.sandbox_address, self.rules,
                        tuple(reaches + refused), total["refused"]["packets"],
                        total["refused"]["bytes"], total["sent_total"]["packets"],
                        total["sent_total"]["bytes"], total["received_total"]["packets"],
                        total["received_total"]["bytes"])

    def close(self) -> None:
        """Keep the record, then remove the table; the veth goes with the sandbox's
        namespace, which the kernel frees, both ends together, once init is gone (the
        caller kills it). Deleting the veth here would wait out an RCU grace period: 27 ms
        of each teardown, measured. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._final = self.record()
        except EgressConfigError:
            pass  # not loaded yet: nothing counted
        finally:
            try:
                _nft(f'delete table inet {self.table}')
            except EgressConfigError:
                pass  # not loaded yet


def _note(name: str, end: str) -> str:
    """The rule that counts a packet in the set `name` by its remote end: the destination
    of what the sandbox sends (end "d"), the source of what comes back to it ("s")."""
    return (f"meta l4proto {{ tcp, udp }} add @{name} "
            f"{{ ip {end}addr . meta l4proto . th {end}port }}")


def _order(reach: IpReach) -> tuple:
    return (reach.reason, ipaddress.ip_address(reach.address), reach.protocol, reach.port)


def _delete_link_once(interface: str, alias: str) -> None:
    """_delete_link through an IPRoute of this call alone (gc: see _links_once)."""
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        _delete_link(interface, alias, ipr)


def _delete_link(interface: str, alias: str, ipr=None) -> None:
    """Delete the host end (which deletes the peer) if it is still the one named alias."""
    from pyroute2.netlink.exceptions import NetlinkError
    ipr = ipr or _host_iproute()
    found = ipr.link_lookup(ifname=interface)
    if not found:
        return  # gone with the sandbox's namespace
    if ipr.get_links(found[0])[0].get_attr("IFLA_IFALIAS") != alias:
        return  # the slot is another sandbox's now
    try:
        ipr.link("del", index=found[0])
    except NetlinkError as exc:
        if exc.code != errno.ENODEV:
            raise


def find_stale() -> list[tuple[str, tuple[str, ...]]]:
    """(name, [what it names]) of each table and veth whose creator is gone: the table
    "inet NAME" and the interfaces whose alias is NAME."""
    if unavailable():
        return []
    found: dict[str, list[str]] = {}
    for name in _TABLE.findall(_nft("list tables inet", keep=False)):
        if _is_stale(name):
            found.setdefault(name, []).append(f"nft table inet {name}")
    for link in _in_worker(_links_once):
        ifname, alias = link.get_attr("IFLA_IFNAME"), link.get_attr("IFLA_IFALIAS")
        if ifname.startswith(IFNAME_PREFIX) and alias and _is_stale(alias):
            found.setdefault(alias, []).append(f"interface {ifname}")
    return [(name, tuple(items)) for name, items in found.items()]


def _links_once() -> list:
    """The host's links, through an IPRoute of this call alone: gc, which runs rarely and
    in processes that make no sandbox of this mode, keeps no netlink socket open."""
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        return list(ipr.get_links())


def _is_stale(name: str) -> bool:
    try:
        return not names.creator_alive(name)
    except ValueError:
        return False  # not named by names.leaf_name(): not ours to judge


def remove_stale(name: str, items: Sequence[str]) -> None:
    """Remove what find_stale() listed under name."""
    for item in items:
        if item.startswith("nft table inet "):
            _nft(f'delete table inet {name}', keep=False)
        elif item.startswith("interface "):
            _in_worker(_delete_link_once, item[len("interface "):], name)


# -- the host's netlink and nftables, one handle each per process

_worker = None  # (pid, the executor whose one thread makes every netlink call)
_worker_lock = threading.Lock()
_host = None  # (pid, IPRoute), used only by that thread
_nft_lock = threading.Lock()
_nft_ctx: dict = {}  # as_json -> (pid, context)
_lib = None


def _in_worker(fn, *args):
    """fn(*args) in this process's netlink thread. pyroute2's IPRoute runs an event loop of
    its own for each call, which it cannot in a thread that runs one already (a coroutine
    making a Sandbox), and keeps its transport per thread: so every netlink call of this
    module is made by one thread, which runs no other loop, one call at a time."""
    global _worker
    with _worker_lock:
        if _worker is None or _worker[0] != os.getpid():  # a forked child makes its own
            _worker = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="karotte-netlink"))
        executor = _worker[1]
    return executor.submit(fn, *args).result()


def _host_iproute():
    global _host
    from pyroute2 import IPRoute
    if _host is None or _host[0] != os.getpid():
        _host = (os.getpid(), IPRoute())
    return _host[1]


def _netlink_socket_in(nsfd: int) -> socket.socket:
    """A NETLINK_ROUTE socket of the namespace nsfd: made by a thread that joins it and
    ends, so no thread of this process stays in the sandbox's namespace."""
    out: list = []

    def run() -> None:
        try:
            if _libc().setns(nsfd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into the sandbox's network namespace: "
                                   f"{os.strerror(err)}")
            out.append(socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 0))
        except BaseException as exc:
            out.append(exc)
    thread = threading.Thread(target=run, name="karotte-netns")
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _nft_library():
    global _lib
    if _lib is None:
        path = ctypes.util.find_library("nftables")
        if path is None:
            return None
        lib = ctypes.CDLL(path)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        for fn in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def _nft(commands: str, as_json: bool = False, keep: bool = True) -> str:
    """Run nft commands in one transaction through libnftables (a subprocess costs ms);
    their output (as JSON: as_json), or EgressConfigError with nft's message. The context
    (and its netlink socket) is kept for the process's next sandbox, unless keep is False
    (gc, which runs rarely and makes no sandbox)."""
    lib = _nft_library()
    with _nft_lock:
        if not keep or as_json not in _nft_ctx or _nft_ctx[as_json][0] != os.getpid():
            ctx = lib.nft_ctx_new(0)
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            if as_json:
                lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_JSON)
            if keep:
                _nft_ctx[as_json] = (os.getpid(), ctx)
        else:
            ctx = _nft_ctx[as_json][1]
        try:
            rc = lib.nft_run_cmd_from_buffer(ctx, commands.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode()
        finally:
            if not keep:
                lib.nft_ctx_free(ctx)
    if rc != 0:
        raise EgressConfigError(f"nftables refused the ip mode's rules: {err.strip()}")
    return out


def _read_sysctl(name: str) -> str:
    with open(f"/proc/sys/net/{name}") as f:
        return f.read().strip()


def _write_sysctl(name: str, value: str) -> None:
    with open(f"/proc/sys/net/{name}", "w") as f:
        f.write(value)
