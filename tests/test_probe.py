"""`karotte-sandbox check` on the real host: what it reports is what a real sandbox showed.

No mocks. Each missing protection below is produced by a real failure: a cgroup parent
that does not exist, a caller without a delegated cgroup, an unprivileged caller, and
Karotte's check run inside a Karotte sandbox, whose seccomp policy denies clone3 and
mount_setattr the way a container's seccomp profile would.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

from karotte import cgroups, probe, steps
from karotte.probe import PROBE_SPEC, PROTECTIONS
from karotte.errors import HostUnsupported, SandboxError
from karotte.protections import CGROUP_LINES
from karotte.probe.evidence import _Evidence, _failure, _host, _run_sandbox
from karotte.probe.verdicts import VERDICTS, judge
from karotte.sandbox import AGENT_UID, DEFAULT_UID_BASE, Sandbox
from karotte.spec import Bind, MiB, SandboxSpec

from conftest import NOBODY, delegated_v1_cgroup

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CGROUP_LINES = ("cgroup-memory", "cgroup-swap", "cgroup-pids", "cgroup-cpu", "cgroup-kill")
FIELDS = {"name", "enforced", "default", "how", "why_not", "fix"}

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="this host is checked as root "
                                "(and root is needed to switch to uid 65534)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAROTTE_")}
    env.update(extra)
    return env


def check(*args: str, as_nobody: bool = False, **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "karotte.cli.sandbox", "check", *args]
    if as_nobody:
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    return subprocess.run(argv, env=_env(**env), capture_output=True, text=True, timeout=60,
                          cwd="/")


def check_json(**kw) -> tuple[int, dict]:
    r = check("--json", **kw)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def lines_of(report: dict) -> dict[str, dict]:
    return {p["name"]: p for p in report["protections"]}


def rows_of(text: str) -> dict[str, str]:
    """name -> its line in the text output; each protection has exactly one."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[1] in PROTECTIONS:
            assert words[1] not in out, f"{words[1]} has two lines"
            out[words[1]] = line
    return out


def status_column(text: str) -> dict[str, str]:
    return {name: line.split()[0] for name, line in rows_of(text).items()}


def _nobody_blocker() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to uid 65534"
    if not shutil.which("setpriv"):
        return "needs setpriv (util-linux) to run as uid 65534"
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        sys.executable, "-c", "import karotte.probe, karotte.native"],
                       env=_env(), capture_output=True, text=True, cwd="/")
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return (f"uid 65534 cannot run {sys.executable} with karotte importable (the venv and "
                f"the checkout must be readable by it): {tail}")
    return None


needs_nobody = pytest.mark.skipif(_nobody_blocker() is not None, reason=str(_nobody_blocker()))


@pytest.fixture(scope="module")
def root_report() -> probe.HostReport:
    if os.geteuid() != 0:
        pytest.skip("the expectations below are those of a root caller")
    return probe.probe()


@pytest.fixture
def delegated_parent():
    with delegated_v1_cgroup("probe-test") as parent:
        yield parent


# --------------------------------------------------------------------------- the table

def test_every_line_of_check_has_exactly_one_verdict_in_its_order():
    assert list(VERDICTS) == list(PROTECTIONS), (
        f"lines without a verdict: {sorted(set(PROTECTIONS) - set(VERDICTS))}; verdicts "
        f"without a line: {sorted(set(VERDICTS) - set(PROTECTIONS))}")


# --------------------------------------------------------------------------- this host

@needs_root
def test_on_this_root_host_every_default_protection_is_enforced_and_check_exits_0():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    status = status_column(r.stdout)
    assert set(status) == set(PROTECTIONS), "one line per protection"
    assert {name: s for name, s in status.items() if s != "ok"} == {}
    assert "default protections are enforced" in r.stdout
    header = r.stdout.splitlines()[:2]
    assert header[0].startswith(f"Karotte host check: kernel {os.uname().release}, cgroup v")
    assert header[0].endswith("running as root")
    assert header[1].startswith("user namespaces: kernel.apparmor_restrict_unprivileged_userns=")


@needs_root
def test_check_json_carries_every_field_of_every_protection():
    rc, report = check_json()
    assert rc == 0
    assert {"protections", "kernel", "cgroup_version", "running_as_root", "uid",
            "userns_sysctls", "missing_defaults", "seconds"} <= set(report)
    assert report["kernel"] == os.uname().release
    assert report["cgroup_version"] == cgroups.detect().version
    assert report["running_as_root"] is True and report["uid"] == 0
    assert set(report["userns_sysctls"]) == {"kernel.apparmor_restrict_unprivileged_userns",
                                             "kernel.unprivileged_userns_clone",
                                             "user.max_user_namespaces"}
    assert [p["name"] for p in report["protections"]] == list(PROTECTIONS)
    for p in report["protections"]:
        assert set(p) == FIELDS, p
        assert p["default"] is PROTECTIONS[p["name"]]
        assert p["enforced"] is True and p["how"]
        assert p["why_not"] is None and p["fix"] is None
    assert report["missing_defaults"] == []


def _expected_evidence() -> dict[str, list[str]]:
    """What each line must say it measured on this host, as a root caller."""
    s = PROBE_SPEC
    v1 = cgroups.detect().version == 1
    quota = round(s.cpus * cgroups.PERIOD_US)
    return {
        "user-namespace": [f"uid_map inside: 0 {DEFAULT_UID_BASE} {AGENT_UID}"],
        "pid-namespace": ["the agent sees 2 processes", "PID 1 is karotte-init"],
        "mount-namespace": ["read-only tmpfs root", "every mount nosuid", "not visible"],
        "network-namespace": ["interfaces: lo"],
        "ipc-namespace": ["own ipc namespace"],
        "uts-namespace": [f"hostname {s.hostname}"],
        "cgroup-namespace": ["/proc/self/cgroup shows / in every hierarchy"],
        "seccomp": ["Seccomp: 2", "unshare(CLONE_NEWUSER) -> EPERM",
                    "personality(ADDR_NO_RANDOMIZE) -> EPERM", "clone3 -> ENOSYS"],
        "no-new-privs": ["NoNewPrivs: 1"],
        "capabilities-dropped": ["CapInh, CapPrm, CapEff, CapBnd and CapAmb all 0"],
        "unprivileged-agent-uid": [f"uid and gid {AGENT_UID} inside, no groups",
                                   "owned by no host account"],
        # which uid (one per sandbox): test_each_sandbox_s_agent_has_a_host_uid_of_its_own
        "separate-host-uid": ["the agent's host uid", "not the caller's (0)"],
        "own-userns-owner": ["user namespace is owned by host uid", "the agent's own",
                             "not the caller's (0)", "owned by no host account"],
        "new-session": ["its own session"],
        "closed-fds": ["fds 0-2 only"],
        "cgroup-memory": [("memory.limit_in_bytes" if v1 else "memory.max")
                          + f" = {s.memory // MiB} MiB", "init is in the cgroup"],
        "cgroup-swap": ["memory.memsw.limit_in_bytes" if v1 else "memory.swap.max = 0"],
        "cgroup-pids": [f"pids.max = {s.pids}"],
        "cgroup-cpu": [f"{quota} {cgroups.PERIOD_US}"],
        "cgroup-kill": ["freezer.state" if v1 else "cgroup.kill", "background process",
                        "cgroup empty"],
        "disk-quota": [f"/workspace tmpfs {s.disk // MiB} MiB, {s.inodes} inodes",
                       f"/tmp {s.tmp_size // MiB} MiB"],
        "rlimits": [f"RLIMIT_FSIZE {s.disk // MiB} MiB", f"RLIMIT_NOFILE {s.nofile}",
                    "RLIMIT_CORE 0", "soft = hard"],
        "mount-setattr": ["host binds are ro,nosuid,nodev", "device nodes nosuid"],
        "pidfd": ["pidfd_open works", "held by a pidfd"],
        "clone3": ["clone3 spawned init in every namespace",
                   "init started in them" if v1 else "CLONE_INTO_CGROUP"],
        "image-overlay": ["/ is an overlay (userxattr), rw,nosuid,nodev",
                          "absent from the tree on the host",
                          f"a tmpfs of {s.disk // MiB} MiB and {s.inodes} inodes"],
    }


@pytest.mark.parametrize("name", list(PROTECTIONS))
def test_each_line_says_what_the_probe_sandbox_showed(root_report, name):
    line = root_report.get(name)
    assert line.enforced, f"{name}: {line.why_not}"
    for evidence in _expected_evidence()[name]:
        assert evidence in line.how, f"{name}: {evidence!r} not in {line.how!r}"


def test_namespace_lines_compare_the_agents_namespace_with_the_callers(root_report):
    for name, ns in probe.NAMESPACES.items():
        own = os.readlink(f"/proc/self/ns/{ns}")
        assert f"the caller's is {own}" in root_report.get(name).how


def test_probe_finishes_and_leaves_nothing_behind(no_leaks):
    # A bound against a hang, not a speed test (the probe takes about 0.1 s on an idle
    # host; its agent runs with cpus=0.5, so load stretches it).
    probe.probe()  # first call pays for imports
    start = time.monotonic()
    report = probe.probe()
    assert time.monotonic() - start < 10.0
    assert 0 < report.seconds < 10.0


def test_render_text_has_one_aligned_line_per_protection(root_report):
    rows = rows_of(probe.render_text(root_report))
    assert list(rows) == list(PROTECTIONS)
    columns = {re.match(r"\S+\s+\S+\s+", row).end() for row in rows.values()}
    assert len(columns) == 1, "the how/why column starts at the same place on every line"


# --------------------------------------------------------------------------- missing ones

@needs_root
def test_a_missing_cgroup_parent_makes_check_fail_naming_each_cgroup_protection_and_a_fix():
    parent = f"/karotte-probe-test-missing-{os.getpid()}"
    rc, report = check_json(KAROTTE_CGROUP_PARENT=parent)
    assert rc == 1
    lines = lines_of(report)
    assert sorted(report["missing_defaults"]) == sorted(CGROUP_LINES)
    for name in CGROUP_LINES:
        line = lines[name]
        assert line["enforced"] is False and line["default"] is True
        assert "ENOENT" in line["why_not"] and parent in line["why_not"]
        assert f"KAROTTE_CGROUP_PARENT={parent}" in line["fix"]
        assert "unset KAROTTE_CGROUP_PARENT" in line["fix"]
    # The probe ran without a cgroup for the rest: those lines were still tested.
    assert all(p["enforced"] for n, p in lines.items() if n not in CGROUP_LINES)

    text = check(KAROTTE_CGROUP_PARENT=parent)
    assert text.returncode == 1
    status = status_column(text.stdout)
    assert {n for n, s in status.items() if s == "MISSING"} == set(CGROUP_LINES)
    assert "fix: KAROTTE_CGROUP_PARENT" in text.stdout
    rows = rows_of(text.stdout)
    for name in CGROUP_LINES[1:]:  # one cause, given in full once
        assert rows[name].endswith("same cause and fix as cgroup-memory")
    assert f"5 of {sum(PROTECTIONS.values())} default protections are MISSING" in text.stdout


@needs_nobody
def test_unprivileged_caller_is_told_the_agent_runs_as_its_own_host_uid(delegated_parent):
    r = check("--json", as_nobody=True, KAROTTE_CGROUP_PARENT=delegated_parent)
    assert r.returncode == 0, r.stdout + r.stderr  # a caveat, not a missing default
    report = json.loads(r.stdout)
    assert report["running_as_root"] is False and report["uid"] == NOBODY
    lines = lines_of(report)
    caveat = lines["separate-host-uid"]
    assert caveat["enforced"] is False and caveat["default"] is False
    assert f"host uid {NOBODY}, the caller's own" in caveat["why_not"]
    assert f"measured: the agent's files belong to host uid {NOBODY}" in caveat["why_not"]
    assert "run Karotte as root" in caveat["fix"]
    # Nested mode: the agent is the same kernel uid as init, and the caveat says so.
    assert "kill(1, 0) succeeds" in caveat["why_not"]
    agent = lines["unprivileged-agent-uid"]
    assert agent["enforced"] is True
    assert f"uid {NOBODY}, the caller's own" in agent["how"]
    assert "uid_map inside: 1000 0 1" in lines["user-namespace"]["how"]  # nested namespace

    owner = lines["own-userns-owner"]
    assert owner["enforced"] is False and owner["default"] is False
    assert f"taken from uid {NOBODY}'s" in owner["why_not"] and "run Karotte as root" in owner["fix"]

    text = check(as_nobody=True, KAROTTE_CGROUP_PARENT=delegated_parent)
    assert status_column(text.stdout)["separate-host-uid"] == "off"
    assert status_column(text.stdout)["own-userns-owner"] == "off"
    assert ("caveats (not default protections): separate-host-uid, own-userns-owner"
            in text.stdout)


@needs_nobody
def test_unprivileged_caller_without_a_delegated_cgroup_is_told_how_to_get_one():
    rc, report = check_json(as_nobody=True)
    assert rc == 1
    assert sorted(report["missing_defaults"]) == sorted(CGROUP_LINES)
    for name in CGROUP_LINES:
        line = lines_of(report)[name]
        assert "EACCES" in line["why_not"]
        assert "Delegate=yes" in line["fix"]


def _run_check_in_a_sandbox() -> subprocess.CompletedProcess | str:
    """`karotte-sandbox check --json` run as the agent of a sandbox, the checkout bound in."""
    site = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": f"{PROJECT}:{site}"}
    spec = SandboxSpec(memory=256 * MiB, binds=(Bind(PROJECT, PROJECT),))
    if not site.startswith(PROJECT + "/"):
        spec = SandboxSpec(memory=256 * MiB, binds=(Bind(PROJECT, PROJECT), Bind(site, site)))
    with Sandbox(spec) as sb:
        imports = sb.exec(["/usr/bin/python3", "-c", "import karotte.probe, karotte.native"],
                          env=env, cwd="/")
        if not imports.ok:
            return ("the sandbox's /usr/bin/python3 cannot import karotte from the checkout: "
                    + imports.stderr.decode(errors="replace").strip()[-300:])
        return sb.exec(["/usr/bin/python3", "-m", "karotte.cli.sandbox", "check", "--json"],
                       env=env, cwd="/")


@needs_root
def test_in_a_container_whose_seccomp_denies_clone3_check_names_clone3_and_mount_setattr():
    r = _run_check_in_a_sandbox()
    if isinstance(r, str):
        pytest.skip(r)
    assert r.exit_code == 1, r.stderr
    lines = lines_of(json.loads(r.stdout))
    for name, call, err in (("clone3", "clone3", "ENOSYS"),
                            ("mount-setattr", "mount_setattr", "EPERM")):
        line = lines[name]
        assert line["enforced"] is False
        assert f"{call} fails with {err} here" in line["why_not"]
        assert "a seccomp profile or LSM around this process denies it" in line["why_not"]
        assert f"whose seccomp profile allows {call}" in line["fix"]
    assert all(not lines[name]["enforced"] for name in CGROUP_LINES)  # no cgroupfs there
    # No sandbox can be made there, so nothing else was shown in force: each says why.
    for name, line in lines.items():
        if PROTECTIONS[name] and name not in CGROUP_LINES + ("clone3", "mount-setattr"):
            assert line["enforced"] is False
            assert "untested: no sandbox could be created on this host (the cause is on the " \
                   "clone3 line)" == line["why_not"], name


def test_an_agent_file_the_host_cannot_measure_fails_its_lines_instead_of_crashing_check():
    # The probe's agent writes a file whose host owner is measured; if that stat fails,
    # the uid lines must say so, not format a missing uid.
    run = _run_sandbox()
    assert isinstance(run, _Evidence) and run.inside is not None
    run.agent_host_uid = run.agent_host_gid = None
    run.inside_error = "the agent's file /workspace/.karotte-probe is not visible from the host"
    lines = {p.name: p for p in judge(_host(), run)}
    assert not lines["unprivileged-agent-uid"].enforced
    assert "not visible from the host" in lines["unprivileged-agent-uid"].why_not
    if os.geteuid() == 0:
        assert not lines["separate-host-uid"].enforced
        assert "not visible from the host" in lines["separate-host-uid"].why_not


def test_a_failed_step_blames_the_lines_of_its_code_not_words_in_its_message():
    # The step code decides: a path that happens to contain "tmpfs" or "staging" used to
    # blame the mount namespace and the disk quota for an unreadable bind source.
    unreadable = _failure(SandboxError(
        "sandbox setup failed at 'bind source /srv/tmpfs-staging': Permission denied",
        step="bind-source"))
    assert list(unreadable.causes) == list(PROTECTIONS)  # a bind sets up no line alone
    loopback = _failure(SandboxError("sandbox setup failed at 'load seccomp filter': x",
                                     step="loopback"))
    assert list(loopback.causes) == ["network-namespace"]
    assert loopback.causes["network-namespace"][1] == steps.fix("network-namespace")


def test_a_host_unsupported_fails_every_line_it_names_and_only_a_cgroup_loss_blames_cgroups():
    lines = ("separate-host-uid", "own-userns-owner")
    assert list(_failure(HostUnsupported(lines, "a bad uid range")).causes) == list(lines)
    swap = _failure(HostUnsupported("cgroup-swap", "no memsw files"))
    assert list(swap.causes) == ["cgroup-swap"]
    assert list(_failure(HostUnsupported(CGROUP_LINES, "no cgroup")).causes) == list(CGROUP_LINES)
