"""What `karotte-sandbox check` prints: one Protection per line, as text or JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..protections import PROTECTIONS


@dataclass(frozen=True)
class Protection:
    """One line of `karotte-sandbox check`."""

    name: str  # stable id, e.g. "pid-namespace"
    enforced: bool  # this host enforces it: the probe sandbox showed it in force
    default: bool  # part of Karotte's default protections; missing -> `check` exits 1
    how: str  # how it is enforced (or, when it is not, how Karotte would enforce it)
    why_not: str | None = None  # the cause, when not enforced
    fix: str | None = None  # what to do about it, when not enforced


@dataclass(frozen=True)
class HostReport:
    """What `karotte-sandbox check` prints: one Protection per line, plus host facts."""

    protections: tuple[Protection, ...]
    kernel: str  # uname release
    cgroup_version: int | None  # the backend cgroups.detect() picks; None: neither works
    running_as_root: bool
    uid: int = 0  # the caller's effective uid
    userns_sysctls: dict[str, str | None] = field(default_factory=dict)  # None: no such file
    seconds: float = 0.0  # how long the probe took

    @property
    def missing_defaults(self) -> tuple[Protection, ...]:
        return tuple(p for p in self.protections if p.default and not p.enforced)

    def get(self, name: str) -> Protection:
        for p in self.protections:
            if p.name == name:
                return p
        raise KeyError(f"no protection named {name!r}; known: {', '.join(PROTECTIONS)}")


def _status(p: Protection) -> str:
    if p.enforced:
        return "ok"
    return "MISSING" if p.default else "off"


def render_text(report: HostReport) -> str:
    """One aligned line per protection: status, name, how (or why not and the fix)."""
    cg = f"cgroup v{report.cgroup_version}" if report.cgroup_version else "no usable cgroups"
    who = "root" if report.running_as_root else f"uid {report.uid} (unprivileged)"
    sysctls = ", ".join(f"{k}={'absent' if v is None else v}"
                        for k, v in report.userns_sysctls.items())
    lines = [f"Karotte host check: kernel {report.kernel}, {cg}, running as {who}",
             f"user namespaces: {sysctls}", ""]
    width = max(len(p.name) for p in report.protections)
    first_with: dict[tuple[str, str], str] = {}  # one cause often takes several lines
    for p in report.protections:
        if p.enforced:
            detail = p.how
        elif (p.why_not, p.fix) in first_with:
            detail = f"same cause and fix as {first_with[(p.why_not, p.fix)]}"
        else:
            first_with[(p.why_not, p.fix)] = p.name
            detail = f"{p.why_not} -- fix: {p.fix}"
        lines.append(f"{_status(p):<8} {p.name:<{width}}  {detail}")
    lines.append("")
    missing = report.missing_defaults
    defaults = sum(p.default for p in report.protections)
    if missing:
        lines.append(f"{len(missing)} of {defaults} default protections are MISSING: "
                     f"{', '.join(p.name for p in missing)}")
    else:
        lines.append(f"all {defaults} default protections are enforced "
                     f"(checked in {report.seconds:.2f} s)")
    off = [p.name for p in report.protections if not p.default and not p.enforced]
    if off:
        lines.append(f"caveats (not default protections): {', '.join(off)}")
    return "\n".join(lines)


def to_json(report: HostReport) -> str:
    """The report as one JSON object; protections keep the order of the text output."""
    out = asdict(report)
    out["missing_defaults"] = [p.name for p in report.missing_defaults]
    return json.dumps(out, indent=2)
