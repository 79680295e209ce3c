"""Result records that cross layers and processes (plain data, standard library only).

ExecResult is also what a grader running inside its own sandbox gets back for the
agent's program, so this module must import nothing that needs the native layer.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

# Why an episode ended, the closed set of Outcome.reason (listed for users in
# docs/examples.md, "What an outcome's reason says"). All but "graded" score the bottom.
REASONS = frozenset({
    "graded",  # grade() returned a finite reward within the environment's reward_range
    "gave_up",  # the agent called give_up()
    "budget_exhausted",  # max_turns tool calls or max_seconds used up
    "kill_unconfirmed",  # the agent's sandbox was not confirmed empty: nothing was read
    "scanner_rejected_required_output",  # a violation at, in or on the way to a deliverable
    "grader_crashed", "grader_timeout", "grader_out_of_memory",  # the grader did not report
    "invalid_reward", "non_finite_reward", "reward_out_of_range",  # it reported no usable one
    "infra_error",  # the infrastructure failed (Outcome.infra_error says how): not a score
})

# What the custody scan rejected, the closed set of Violation.kind (karotte/scan.py
# finds them; docs/scan.md lists them for users).
VIOLATION_KINDS = frozenset({
    "symlink", "fifo", "socket", "block-device", "char-device", "unknown-type",
    "hardlink", "setuid", "setgid", "sticky", "sparse", "file-too-large",
    "total-too-large", "too-many-entries", "too-deep", "name-too-long", "paths-too-long",
    "scan-timeout", "unreadable", "changed-during-scan", "invalid-name",
    # the overlay's upper only (karotte/changes.py)
    "overlay-metadata", "unmapped-owner",
})


EXEC_REACHES = 100  # of one exec's reaches an ExecResult holds; the rest counted in dropped
REACH_TEXT_LIMIT = 300  # bytes of JSON of a held Reach's host and of its detail


@dataclass(frozen=True)
class Reach:
    """One destination the agent asked for through the egress proxy, and what came of it
    (karotte/egress/proxy.py writes them; docs/egress.md)."""

    via: str  # "connect" (a tunnel), "http" (a plain request) or "upstream:NAME"
    host: str
    port: int
    allowed: bool  # the check's decision
    reason: str  # of karotte.egress.REASONS: "ok", why it was refused, or why it was cut
    bytes_sent: int  # agent -> destination
    bytes_received: int  # destination -> agent
    detail: str = ""


@dataclass(frozen=True)
class EgressRecord:
    """What a sandbox (or one exec of it) reached, in the order the proxy saw it."""

    reaches: tuple[Reach, ...] = ()
    dropped: int = 0  # reaches past the cap, counted, not held

    @property
    def refused(self) -> tuple[Reach, ...]:
        return tuple(r for r in self.reaches if not r.allowed)

    @property
    def total(self) -> int:
        """Every reach the record saw, held or dropped."""
        return len(self.reaches) + self.dropped

    def bounded(self, limit: int) -> EgressRecord:
        """At most `limit` reaches held, the rest counted in dropped, and the host and
        detail of each cut to REACH_TEXT_LIMIT bytes of JSON (REC-BOUND-01)."""
        kept = self.reaches[:limit]
        return EgressRecord(tuple(replace(r, host=capped(r.host, REACH_TEXT_LIMIT),
                                          detail=capped(r.detail, REACH_TEXT_LIMIT))
                                  for r in kept), self.total - len(kept))

    def to_dict(self) -> dict:
        return {"reaches": [r.__dict__.copy() for r in self.reaches], "dropped": self.dropped}

    @classmethod
    def from_dict(cls, data: dict) -> EgressRecord:
        return cls(tuple(Reach(**r) for r in data["reaches"]), int(data["dropped"]))


@dataclass(frozen=True)
class IpRule:
    """One allowed destination of the ip mode, as the nftables set holds it."""

    entry: str  # the allow-list entry it came from ("db.example:5432")
    network: str  # "10.0.0.5/32"
    ports: tuple[int, ...] | None  # None: any port


@dataclass(frozen=True)
class IpReach:
    """What the ip mode's rules counted for one remote end (karotte/egress/ip.py): an
    address, protocol and port the sandbox sent to, with one reason of
    karotte.egress.REASONS. "ok": allowed, `packets` and `bytes` what the sandbox sent,
    `received_*` the replies it got. Refused: "ip_literal" (not listed),
    "internal_address" (the host's own addresses), "connections", "bytes_per_second" or
    "bytes_total" (past the policy's EgressLimits), the packets refused or dropped, either
    way for the last two. Bytes are of whole IP packets, headers included."""

    address: str  # "10.0.0.5"
    port: int
    protocol: str  # "tcp" or "udp"
    allowed: bool
    reason: str
    packets: int
    bytes: int
    received_packets: int = 0
    received_bytes: int = 0

    @property
    def key(self) -> tuple[str, int, str, str]:
        return self.address, self.port, self.protocol, self.reason


@dataclass(frozen=True)
class IpRecord:
    """What the nftables rules of one sandbox in the ip mode counted (of one exec: what
    they counted from its start to its end). reaches: allowed ones first, then refused,
    each by address; the rules keep at most ENDS_KEPT remote ends per reason
    (karotte/egress/ip.py) and a record holds at most its bound, the rest counted in
    `dropped`; the totals count every packet, past both. refused_*: every packet refused
    or dropped, either way, forged sources too."""

    interface: str
    sandbox_address: str
    rules: tuple[IpRule, ...]
    reaches: tuple[IpReach, ...]
    refused_packets: int
    refused_bytes: int
    sent_packets: int = 0  # allowed, from the sandbox
    sent_bytes: int = 0
    received_packets: int = 0  # allowed replies, to the sandbox
    received_bytes: int = 0
    dropped: int = 0  # reaches past the bound, counted, not held

    _TOTALS = ("refused_packets", "refused_bytes", "sent_packets", "sent_bytes",
               "received_packets", "received_bytes")

    @property
    def refused(self) -> tuple[IpReach, ...]:
        return tuple(r for r in self.reaches if not r.allowed)

    @property
    def total(self) -> int:
        """Every reach the record saw, held or dropped."""
        return len(self.reaches) + self.dropped

    def since(self, earlier: IpRecord) -> IpRecord:
        """What the counters added from `earlier` (a record of the same sandbox) to this
        one: the reaches whose counts grew, by how much, and the totals' growth."""
        before = {r.key: r for r in earlier.reaches}
        grown = []
        for r in self.reaches:
            b = before.get(r.key)
            if b is not None:
                r = replace(r, packets=r.packets - b.packets, bytes=r.bytes - b.bytes,
                            received_packets=r.received_packets - b.received_packets,
                            received_bytes=r.received_bytes - b.received_bytes)
            if r.packets or r.received_packets:
                grown.append(r)
        return replace(self, reaches=tuple(grown), dropped=0, **{
            name: getattr(self, name) - getattr(earlier, name) for name in self._TOTALS})

    def bounded(self, limit: int) -> IpRecord:
        """At most `limit` reaches held, the rest counted in dropped (REC-BOUND-01; every
        text of a reach is an address, a port or a name of the rules)."""
        return replace(self, reaches=self.reaches[:limit], dropped=self.total - min(
            limit, len(self.reaches)))

    def to_dict(self) -> dict:
        out = {f: getattr(self, f) for f in ("interface", "sandbox_address")}
        out["rules"] = [{"entry": r.entry, "network": r.network,
                         "ports": list(r.ports) if r.ports is not None else None}
                        for r in self.rules]
        out["reaches"] = [r.__dict__.copy() for r in self.reaches]
        out.update({name: getattr(self, name) for name in self._TOTALS + ("dropped",)})
        return out

    @classmethod
    def from_dict(cls, data: dict) -> IpRecord:
        rules = tuple(IpRule(r["entry"], r["network"],
                             tuple(r["ports"]) if r["ports"] is not None else None)
                      for r in data["rules"])
        return cls(data["interface"], data["sandbox_address"], rules,
                   tuple(IpReach(**r) for r in data["reaches"]),
                   **{name: int(data[name]) for name in cls._TOTALS + ("dropped",)})


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
    error_step: str | None = None  # where it could not: a step of karotte.steps.STEPS
    # With a network policy: what the sandbox reached from this exec's start to its end
    # (at most EXEC_REACHES, docs/egress.md "The record of each exec"); None with "none"
    egress: EgressRecord | None = None
    # In the ip mode: what its rules counted from this exec's start to its end (at most
    # EXEC_REACHES held, docs/egress.md "The ip mode's record"); None in the other modes
    egress_ip: IpRecord | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def json_size(text: str) -> int:
    """Bytes of text's JSON form, as json.dumps writes it (ASCII, quotes included)."""
    return len(json.dumps(text))


_PLAIN = re.compile(rb"[\x20-\x5b\x5d-\x7e]*")  # printable ASCII except the backslash


def escape(raw: bytes) -> str:
    r"""A path as safe text for logs: printable UTF-8 stays, every other byte (control
    characters, invalid UTF-8, the backslash itself) becomes \xNN. One form per path."""
    if _PLAIN.fullmatch(raw):
        return raw.decode("ascii")
    out = []
    for ch in raw.decode("utf-8", "surrogateescape"):
        if ch != "\\" and ch.isprintable():  # lone surrogates (bad bytes) are not printable
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
    return "".join(out)


def capped(text: str, limit: int) -> str:
    """text, or its head and a note of how long it was, such that the JSON form of the
    result is at most `limit` bytes. Records keep agent-made text (paths, commands, logs)
    through this, so that their size never depends on what the agent wrote
    (REC-BOUND-01). Measured as JSON because that is where text grows: a byte that is not
    printable ASCII takes up to six."""
    if len(text) * 12 + 2 <= limit or json_size(text) <= limit:  # 12: an astral character
        return text
    note = f"[karotte: cut, {len(text)} characters in all]"
    room = limit - json_size(note)
    lo, hi = 0, min(len(text), room)
    while lo < hi:  # the longest head that fits: JSON size grows with the head
        mid = (lo + hi + 1) // 2
        if json_size(text[:mid]) - 2 <= room:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + note


@dataclass(frozen=True)
class Violation:
    """One rejected entry or one budget that stopped the walk."""

    path: str  # relative to the workspace root, escaped (see escape); "." is the root; in
    # a filesystem diff (karotte/changes.py) absolute: "/etc/x", "/" the root
    kind: str  # one of VIOLATION_KINDS
    rule: str  # the invariant, e.g. "D4 budget: max_file_size=67108864"
    detail: str = ""

    def __post_init__(self):
        if self.kind not in VIOLATION_KINDS:
            raise ValueError(f"Violation kind {self.kind!r} is not one of VIOLATION_KINDS")


@dataclass(frozen=True)
class ScannedFile:
    """A regular file that passed and was copied."""

    path: str  # relative, escaped (absolute in a filesystem diff)
    raw: bytes  # relative, the exact bytes of the names joined by b"/" (in a diff too)
    size: int  # bytes copied (the st_size that was checked)
    mode: int  # the copy's permission bits: 0o644, or 0o755 if the agent set any x bit (in a
    # diff: the agent's own, less setuid, setgid and sticky, which are rejected)


@dataclass(frozen=True)
class ScanResult:
    files: tuple[ScannedFile, ...]  # accepted regular files, in walk order
    dirs: tuple[str, ...]  # accepted directories (escaped), in walk order
    # in walk order: every one at a deliverable or on the way to one, and the first
    # VIOLATIONS_KEPT inside deliverable directories and elsewhere
    violations: tuple[Violation, ...]
    complete: bool  # False if a budget (depth, entries, size, paths, time) cut the walk short
    seconds: float
    violations_dropped: int = 0  # found, but over VIOLATIONS_KEPT: counted, not held
    # A filesystem diff only (karotte/changes.py), absolute escaped paths in walk order:
    deleted: tuple[str, ...] = ()  # whiteouts: what the agent deleted of the image
    replaced: tuple[str, ...] = ()  # opaque directories: the image's contents there are gone
