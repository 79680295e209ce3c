"""Host probe: what this machine can enforce, and for what it cannot, why and the fix.

``probe()`` does not reason from kernel versions and config files alone: it creates a
small real sandbox, runs a Python one-liner inside it as the agent, and compares what
the agent sees (its namespaces, ``/proc/self/status``, mounts, rlimits, the errno of
syscalls the seccomp policy denies) with what the host sees (its own namespaces, the
sandbox cgroup's limit files, the host uid that owns a file the agent wrote). A
protection is reported as enforced only when that evidence shows it in force.

If the sandbox cannot be created, the protections named by the error are reported
missing with the error's message, and the ones that could not be tested say so.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import pwd
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import cgroups
from .errors import CgroupError, HostUnsupported, KarotteError
from .protections import CGROUP_LINES, NAMESPACES, PROTECTIONS
from .spec import MiB, SandboxSpec
from .userns import AGENT_UID, DEFAULT_UID_BASE, userns_blocker, userns_cause, userns_owner

PYTHON = "/usr/bin/python3"  # bound into every sandbox with /usr
MARK = ".karotte-probe"  # written by the agent in /workspace; its host owner is measured
HIDDEN = ("/etc/shadow", "/var", "/run", "/sys", "/boot")  # host paths the plan never binds
SYSCTLS = ("kernel/apparmor_restrict_unprivileged_userns", "kernel/unprivileged_userns_clone",
           "user/max_user_namespaces")
MOUNT_SETATTR_KERNEL = (5, 12)
PIDFD_KERNEL = (5, 3)  # pidfd_open; CLONE_PIDFD is 5.2
CLONE3_KERNEL = (5, 3)
CLONE_INTO_CGROUP_KERNEL = (5, 7)

# The sandbox the probe builds: small, and with limits that differ from the defaults and
# from each other, so that a value read back proves which setting it came from.
PROBE_SPEC = SandboxSpec(memory=96 * MiB, pids=24, cpus=0.5, timeout=10.0, disk=6 * MiB,
                         inodes=300, tmp_size=5 * MiB, home_size=3 * MiB, nofile=77,
                         hostname="karotte-probe",
                         # measured and reported on its own line instead of refused
                         allow_degraded=frozenset({"cgroup-swap"}))

_BUG = "this is a bug in Karotte, not in the host: report it with `karotte-sandbox check --json`"

# Steps of karotte-init (csrc/init.c) and of the spawn, as their errors name them, and
# the protection each one sets up. An error at any other step names no single line.
_STEPS = (
    ("clone3", ("clone3",)),
    ("mount_setattr", ("mount-setattr",)),
    ("unshare the cgroup namespace", ("cgroup-namespace",)),
    ("sethostname", ("uts-namespace",)),
    ("lo flags", ("network-namespace",)),
    ("bring lo up", ("network-namespace",)),
    ("loopback", ("network-namespace",)),
    ("make / private", ("mount-namespace",)),
    ("staging", ("mount-namespace",)),
    ("pivot_root", ("mount-namespace",)),
    ("detach the", ("mount-namespace",)),
    ("tmpfs", ("mount-namespace", "disk-quota")),
    ("load seccomp filter", ("seccomp",)),
    ("no_new_privs", ("no-new-privs",)),
    ("setrlimit", ("rlimits",)),
    ("setresuid", ("unprivileged-agent-uid",)),
    ("setresgid", ("unprivileged-agent-uid",)),
    ("supplementary groups", ("unprivileged-agent-uid",)),
    ("agent's user namespace", ("user-namespace", "unprivileged-agent-uid")),
    ("agent's uid_map", ("user-namespace", "unprivileged-agent-uid")),
    ("agent's gid_map", ("user-namespace", "unprivileged-agent-uid")),
    ("setsid", ("new-session",)),
    ("close fds", ("closed-fds",)),
)


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


# --------------------------------------------------------------------------- host facts

def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _kernel_version(release: str) -> tuple[int, int]:
    parts = release.split("-")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _syscall_errno(name: str, *args) -> int:
    """errno of a harmless, invalid call to a syscall (0 if it succeeded). ENOSYS means
    the kernel lacks it, or a seccomp profile around this process denies it."""
    from .seccomp import SYSCALL_NUMBERS

    nr = SYSCALL_NUMBERS[name].get(platform.machine())
    if nr is None:
        return errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    ctypes.set_errno(0)
    return 0 if libc.syscall(nr, *args) >= 0 else ctypes.get_errno()


@dataclass(frozen=True)
class _Host:
    kernel: str
    version: tuple[int, int]
    root: bool
    euid: int
    sysctls: dict[str, str | None]
    cgroup_version: int | None
    own_ns: dict[str, str]
    clone3_errno: int  # clone3(NULL, 0): EINVAL where it exists
    mount_setattr_errno: int  # mount_setattr(-1, NULL, 0, NULL, 0): EINVAL where it exists
    pidfd_errno: int  # pidfd_open(self): 0 where it works


def _host() -> _Host:
    release = os.uname().release
    try:
        version: int | None = cgroups.detect().version
    except (HostUnsupported, CgroupError, OSError):
        version = None  # the cgroup lines say why, from the sandbox's own attempt
    own_ns = {}
    for ns in NAMESPACES.values():
        try:
            own_ns[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            own_ns[ns] = "?"
    try:
        os.close(os.pidfd_open(os.getpid()))
        pidfd = 0
    except OSError as exc:
        pidfd = exc.errno
    return _Host(
        kernel=release, version=_kernel_version(release), root=os.geteuid() == 0,
        euid=os.geteuid(),
        sysctls={name.replace("/", "."): _read(f"/proc/sys/{name}") for name in SYSCTLS},
        cgroup_version=version, own_ns=own_ns,
        clone3_errno=_syscall_errno("clone3", None, 0),
        mount_setattr_errno=_syscall_errno("mount_setattr", -1, None, 0, None, 0),
        pidfd_errno=pidfd)


# --------------------------------------------------------------------------- the sandbox

# Runs as the agent, under /usr/bin/python3 -I -S. argv[1]: JSON with the syscalls to
# try and the host paths that must stay hidden. Prints one JSON object.
_INSIDE = r"""
import ctypes, json, os, resource, sys
arg = json.loads(sys.argv[1])
out = {"pid": os.getpid(), "sid": os.getsid(0)}
fds = {}
for name in os.listdir("/proc/self/fd"):
    try:
        fds[name] = os.readlink("/proc/self/fd/" + name)
    except OSError:
        pass  # the fd that listed the directory, closed by now
out["fds"] = fds
out["ns"] = {n: os.readlink("/proc/self/ns/" + n) for n in arg["ns"]}
out["status"] = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
out["uid_map"] = " ".join(open("/proc/self/uid_map").read().split())
out["procs"] = sorted(int(d) for d in os.listdir("/proc") if d.isdigit())
try:
    out["init_comm"] = open("/proc/1/comm").read().strip()
except OSError:
    out["init_comm"] = None
out["hostname"] = os.uname().nodename
out["netdevs"] = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
out["cgroups"] = [l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().splitlines()]
out["mountinfo"] = open("/proc/self/mountinfo").read().splitlines()
vfs = {}
for line in out["mountinfo"]:
    point = line.split()[4]
    try:
        s = os.statvfs(point)
        vfs[point] = [s.f_frsize * s.f_blocks, s.f_files]
    except OSError:
        pass
out["statvfs"] = vfs
out["rlimits"] = {n: resource.getrlimit(getattr(resource, n)) for n in arg["rlimits"]}
out["visible"] = [p for p in arg["hidden"] if os.path.lexists(p)]
try:
    os.kill(1, 0)
    out["signal_init"] = 0
except OSError as e:
    out["signal_init"] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
res = {}
for name, nr, args in arg["syscalls"]:
    ctypes.set_errno(0)
    res[name] = 0 if libc.syscall(nr, *args) >= 0 else ctypes.get_errno()
out["syscalls"] = res
os.close(os.open("/workspace/" + arg["mark"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
print(json.dumps(out))
"""

CLONE_NEWUSER = 0x10000000
ADDR_NO_RANDOMIZE = 0x0040000
RLIMITS = ("RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_CORE")


def _denied_calls() -> list[tuple[str, int, list]]:
    """Calls the default seccomp policy denies and that would succeed, or fail with
    another errno, without it: (label, number, args)."""
    from .seccomp import SYSCALL_NUMBERS

    arch = platform.machine()
    calls = [("unshare(CLONE_NEWUSER)", "unshare", [CLONE_NEWUSER]),
             ("personality(ADDR_NO_RANDOMIZE)", "personality", [ADDR_NO_RANDOMIZE]),
             ("clone3", "clone3", [None, 0])]
    return [(label, SYSCALL_NUMBERS[name][arch], args) for label, name, args in calls
            if SYSCALL_NUMBERS[name].get(arch) is not None]


@dataclass(frozen=True)
class _Failure:
    """Why some lines could not be shown in force: {line: (why_not, fix)}; the first
    entry is the root cause."""

    causes: dict[str, tuple[str, str]]

    @property
    def first(self) -> str:
        return next(iter(self.causes))


@dataclass
class _Evidence:
    """What the probe sandbox showed. Fields stay None where a step failed."""

    spec: SandboxSpec
    cgroup_failure: _Failure | None = None  # the sandbox ran without a cgroup, and why
    cgroup_version: int = 0
    limits: dict[str, str] = field(default_factory=dict)  # cgroup file name -> content
    kill_files: tuple[str, ...] = ()  # cgroup.kill, cgroup.freeze, freezer.state present
    unplaced: list[str] = field(default_factory=list)  # cgroup dirs init is missing from
    inside: dict | None = None
    inside_error: str | None = None
    agent_host_uid: int | None = None
    agent_host_gid: int | None = None
    userns_owner: int | None = None  # host uid that owns the sandbox's user namespace
    init_pidfd_errno: int | None = None
    kill_before: int | None = None  # tasks in the cgroup before kill_all()
    kill_after: int | None = None
    kill_error: str | None = None


def _cgroup_fix() -> str:
    parent = os.environ.get(cgroups.ENV_PARENT)
    if parent:
        return (f"{cgroups.ENV_PARENT}={parent} must name an existing cgroup that this user may "
                f"write (on v1: in each of the {', '.join(cgroups.V1_CONTROLLERS)} "
                f"hierarchies); create and delegate it, or unset {cgroups.ENV_PARENT}")
    return ("run as root, or in a delegated cgroup (`systemd-run --user --scope -p Delegate=yes "
            f"<command>`), or set {cgroups.ENV_PARENT} to a cgroup this user may write; on v1 "
            f"the {', '.join(cgroups.V1_CONTROLLERS)} hierarchies must be mounted, on v2 memory, "
            "pids and cpu must be enabled for that cgroup")


def _is_cgroup_error(exc: BaseException) -> bool:
    return isinstance(exc, CgroupError) or (isinstance(exc, HostUnsupported)
                                            and exc.protection == "cgroups")


def _failure(exc: BaseException) -> _Failure:
    message = str(exc) or type(exc).__name__
    if _is_cgroup_error(exc):
        return _Failure({name: (message, _cgroup_fix()) for name in CGROUP_LINES})
    if isinstance(exc, HostUnsupported) and exc.protection == "user-namespace":
        return _Failure({"user-namespace": (message, userns_cause(errno.EPERM)[1])})
    if isinstance(exc, HostUnsupported) and exc.protection in PROTECTIONS:
        return _Failure({exc.protection: (message, _step_fix(exc.protection))})
    for step, names in _STEPS:
        if step in message:
            return _Failure({name: (message, _step_fix(names[0])) for name in names})
    return _Failure({name: (message, _step_fix(name)) for name in PROTECTIONS})


def _step_fix(name: str) -> str:
    return {
        "mount-setattr": f"karotte-init needs mount_setattr (Linux "
                         f"{'.'.join(map(str, MOUNT_SETATTR_KERNEL))}+): upgrade the kernel, or "
                         f"run outside a container whose seccomp profile denies it",
        "clone3": "the spawn needs clone3 with CLONE_PIDFD (Linux 5.3+, CLONE_INTO_CGROUP "
                  "5.7+): upgrade the kernel, or run outside a container whose seccomp profile "
                  "denies clone3",
        "pidfd": "the spawn needs pidfds (Linux 5.3+): upgrade the kernel",
        "seccomp": "the kernel must be built with CONFIG_SECCOMP_FILTER",
    }.get(name, "a kernel or container policy refused this step; run `karotte-sandbox "
                "check` on the host itself, or as root")


def _find_file(paths: tuple[str, ...], name: str) -> str | None:
    for path in paths:
        candidate = os.path.join(path, name)
        if os.path.exists(candidate):
            return candidate
    return None


_LIMIT_FILES = {1: ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max",
                    "cpu.cfs_quota_us", "cpu.cfs_period_us"),
                2: ("memory.max", "memory.swap.max", "pids.max", "cpu.max")}
_KILL_FILES = ("cgroup.kill", "cgroup.freeze", "freezer.state")


def _create_sandbox():
    """(sandbox, None), or (sandbox without a cgroup, why the cgroup failed), or
    (None, why nothing could be created)."""
    try:
        from .sandbox import Sandbox
    except KarotteError as exc:  # the C extension is not built
        return None, _failure(exc)
    try:
        return Sandbox(PROBE_SPEC), None
    except (KarotteError, OSError, ValueError) as exc:
        if not _is_cgroup_error(exc):
            return None, _failure(exc)
        cgroup_failure = _failure(exc)
    # Without a cgroup every other protection can still be tested: do, and report the
    # cgroup lines with the reason they are missing.
    spec = replace(PROBE_SPEC, allow_degraded=PROBE_SPEC.allow_degraded | {"cgroups"})
    try:
        return Sandbox(spec), cgroup_failure
    except (KarotteError, OSError, ValueError) as exc:
        # What stopped the retry is what stops every sandbox here: it comes first.
        return None, _Failure({**_failure(exc).causes, **cgroup_failure.causes})


def _run_sandbox() -> _Evidence | _Failure:
    sb, failure = _create_sandbox()
    if sb is None:
        return failure
    ev = _Evidence(sb.spec, cgroup_failure=failure)
    with sb:
        cg = sb.cgroup
        try:
            if cg is not None:
                _read_cgroup(sb, cg, ev)
            try:
                os.close(os.pidfd_open(sb.init_pid))
                ev.init_pidfd_errno = 0
            except OSError as exc:
                ev.init_pidfd_errno = exc.errno
            ev.userns_owner = userns_owner(sb.init_pid)
            _run_inside(sb, ev)
            if cg is not None:
                _kill_with_background(sb, cg, ev)
        except (KarotteError, OSError) as exc:
            # The sandbox broke while being probed: what was not measured yet is missing.
            ev.inside_error = ev.inside_error or f"the probe sandbox failed: {exc}"
            ev.kill_error = ev.kill_error or f"the probe sandbox failed: {exc}"
    return ev


def _read_cgroup(sb, cg: cgroups.Cgroup, ev: _Evidence) -> None:
    ev.cgroup_version = cg.version
    # Read from the host, as the kernel holds them: not what Karotte meant to write.
    for name in _LIMIT_FILES[cg.version]:
        path = _find_file(cg.paths, name)
        if path is not None:
            ev.limits[name] = Path(path).read_text().strip()
    ev.kill_files = tuple(n for n in _KILL_FILES if _find_file(cg.paths, n))
    for path in cg.paths:
        if str(sb.init_pid) not in Path(path, "cgroup.procs").read_text().split():
            ev.unplaced.append(path)


def _kill_with_background(sb, cg: cgroups.Cgroup, ev: _Evidence) -> None:
    """A process left running in the background must die with the sandbox."""
    bg = sb.exec(["/bin/sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 &"])
    if not bg.ok:
        ev.kill_error = f"the background process could not start: {bg.error or bg.stderr!r}"
        return
    ev.kill_before = len(cg.pids())
    try:
        sb.kill_all()
        ev.kill_after = len(cg.pids())
    except (KarotteError, OSError) as exc:
        ev.kill_error = str(exc)


def _run_inside(sb, ev: _Evidence) -> None:
    if not os.path.exists(PYTHON):
        ev.inside_error = f"{PYTHON} is missing on the host; the in-sandbox checks run it"
        return
    arg = {"ns": sorted(NAMESPACES.values()), "rlimits": RLIMITS, "mark": MARK,
           "hidden": [p for p in HIDDEN if os.path.lexists(p)], "syscalls": _denied_calls()}
    result = sb.exec([PYTHON, "-I", "-S", "-c", _INSIDE, json.dumps(arg)])
    if not result.ok:
        ev.inside_error = (result.error or f"the probe exited with {result.exit_code} "
                           f"(signal {result.signal}): "
                           f"{result.stderr.decode(errors='replace').strip()[-500:]}")
        return
    try:
        ev.inside = json.loads(result.stdout)
    except ValueError:
        ev.inside_error = f"the probe printed no report: {result.stdout[:200]!r}"
        return
    try:
        st = os.stat(MARK, dir_fd=sb.workspace_fd, follow_symlinks=False)
        ev.agent_host_uid, ev.agent_host_gid = st.st_uid, st.st_gid
    except OSError as exc:
        ev.inside_error = f"the agent's file /workspace/{MARK} is not visible from the host: {exc}"


# --------------------------------------------------------------------------- verdicts

def _errname(err: int) -> str:
    return errno.errorcode.get(err, str(err)) if err else "success"


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


def _opts(mount_line: str) -> tuple[str, set[str], str]:
    """(mount point, per-mount options, fs type) of a /proc/self/mountinfo line."""
    head, _, tail = mount_line.partition(" - ")
    fields = head.split()
    return fields[4], set(fields[5].split(",")), tail.split()[0]


class _Judge:
    """Turns the evidence into one Protection per line."""

    def __init__(self, host: _Host, run: _Evidence | _Failure):
        self.host = host
        self.run = run
        self.ev = run if isinstance(run, _Evidence) else None
        self.inside = self.ev.inside if self.ev else None

    def line(self, name: str, ok: bool, how: str, why_not: str | None = None,
             fix: str | None = None) -> Protection:
        if ok:
            return Protection(name, True, PROTECTIONS[name], how)
        return Protection(name, False, PROTECTIONS[name], how, why_not or "not in force",
                          fix or _BUG)

    def untested(self, name: str, how: str) -> Protection | None:
        """The line for a protection the sandbox must show, if it could not."""
        failure = self.run if isinstance(self.run, _Failure) else None
        if self.ev is not None and name in CGROUP_LINES:
            failure = self.ev.cgroup_failure
        if failure is not None:
            if name in failure.causes:
                return self.line(name, False, how, *failure.causes[name])
            return self.line(name, False, how,
                             f"untested: no sandbox could be created on this host (the cause "
                             f"is on the {failure.first} line)",
                             f"fix {failure.first} first, then run `karotte-sandbox check` again")
        if self.inside is None and name not in CGROUP_LINES + ("pidfd", "clone3"):
            names = [n for step, ns in _STEPS if step in (self.ev.inside_error or "") for n in ns]
            if names and name not in names:
                return self.line(name, False, how, f"untested: the agent's command could not "
                                 f"start (the cause is on the {names[0]} line)",
                                 f"fix {names[0]} first")
            return self.line(name, False, how,
                             f"the in-sandbox probe failed: {self.ev.inside_error}",
                             _step_fix(names[0]) if names else _BUG)
        return None

    # -- namespaces

    def namespace(self, name: str) -> Protection:
        ns = NAMESPACES[name]
        how = f"own {ns} namespace (clone3 CLONE_NEW{ns.upper().replace('MNT', 'NS')})"
        missing = self.untested(name, how)
        if missing:
            return missing
        inside, host = self.inside["ns"][ns], self.host.own_ns[ns]
        if inside == host:
            return self.line(name, False, how, f"the agent shares the caller's {ns} "
                             f"namespace ({host})")
        extra, ok, why = getattr(self, f"_ns_{ns}")()
        how = f"own {ns} namespace ({inside}, the caller's is {host})" + (f"; {extra}" if extra
                                                                       else "")
        return self.line(name, ok, how, why)

    def _ns_user(self):
        return f"uid_map inside: {self.inside['uid_map']}", True, None

    def _ns_pid(self):
        procs, comm = self.inside["procs"], self.inside["init_comm"]
        ok = comm == "karotte-init" and set(procs) <= {1, self.inside["pid"]}
        return (f"the agent sees {len(procs)} processes, PID 1 is {comm}", ok,
                f"the agent sees processes {procs[:10]} and PID 1 is {comm!r}")

    def _ns_mnt(self):
        mounts = [_opts(line) for line in self.inside["mountinfo"]]
        root = next((m for m in mounts if m[0] == "/"), None)
        visible = self.inside["visible"]
        no_nosuid = [point for point, opts, _ in mounts if "nosuid" not in opts]
        problems = []
        if root is None or "ro" not in root[1]:
            problems.append("the root is writable")
        if visible:
            problems.append(f"host paths are visible: {', '.join(visible)}")
        if no_nosuid:
            problems.append(f"mounts without nosuid: {', '.join(no_nosuid)}")
        hidden = [p for p in HIDDEN if os.path.lexists(p)]
        return (f"read-only {root[2] if root else '?'} root, every mount nosuid, host "
                f"{', '.join(hidden)} not visible", not problems, "; ".join(problems))

    def _ns_net(self):
        devs = self.inside["netdevs"]
        return (f"interfaces: {', '.join(devs)}", devs == ["lo"],
                f"the agent sees the interfaces {', '.join(devs)}, not only lo")

    def _ns_ipc(self):
        return "", True, None

    def _ns_uts(self):
        name = self.inside["hostname"]
        return (f"hostname {name}", name == self.ev.spec.hostname,
                f"the hostname is {name!r}, not {self.ev.spec.hostname!r}")

    def _ns_cgroup(self):
        paths = sorted(set(self.inside["cgroups"]))
        return ("/proc/self/cgroup shows / in every hierarchy", paths == ["/"],
                f"the agent sees cgroup paths {', '.join(paths)}")

    # -- the agent's process

    def seccomp(self) -> Protection:
        how = "seccomp filter on every command (karotte.seccomp.DEFAULT_POLICY)"
        missing = self.untested("seccomp", how)
        if missing:
            return missing
        mode = self.inside["status"].get("Seccomp", "").strip()
        want = {"unshare(CLONE_NEWUSER)": errno.EPERM,
                "personality(ADDR_NO_RANDOMIZE)": errno.EPERM, "clone3": errno.ENOSYS}
        got = self.inside["syscalls"]
        calls = ", ".join(f"{label} -> {_errname(got[label])}" for label in got)
        wrong = [f"{label} -> {_errname(got[label])}, not {_errname(want[label])}"
                 for label in got if got[label] != want[label]]
        if mode != "2" or wrong:
            return self.line("seccomp", False, how, "; ".join(
                [f"Seccomp: {mode or '?'} in /proc/self/status"] + wrong))
        return self.line("seccomp", True, f"filter mode (Seccomp: 2); {calls}")

    def no_new_privs(self) -> Protection:
        how = "prctl(PR_SET_NO_NEW_PRIVS) before exec"
        missing = self.untested("no-new-privs", how)
        if missing:
            return missing
        value = self.inside["status"].get("NoNewPrivs", "").strip()
        return self.line("no-new-privs", value == "1", "NoNewPrivs: 1 in /proc/self/status",
                         f"NoNewPrivs: {value or '?'}")

    def capabilities(self) -> Protection:
        how = "bounding set and ambient caps dropped, then setresuid to a non-zero uid"
        missing = self.untested("capabilities-dropped", how)
        if missing:
            return missing
        caps = {k: self.inside["status"].get(k, "?").strip()
                for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
        held = {k: v for k, v in caps.items() if set(v) != {"0"}}
        return self.line("capabilities-dropped", not held,
                         "CapInh, CapPrm, CapEff, CapBnd and CapAmb all 0",
                         "the agent holds capabilities: " + ", ".join(f"{k} {v}" for k, v in
                                                                     held.items()))

    def _ids(self) -> tuple[list[str], list[str], str]:
        status = self.inside["status"]
        return (status.get("Uid", "").split(), status.get("Gid", "").split(),
                status.get("Groups", "").strip())

    def agent_uid(self) -> Protection:

        how = f"setresuid/setresgid {AGENT_UID} inside, no supplementary groups"
        missing = self.untested("unprivileged-agent-uid", how)
        if missing:
            return missing
        uids, gids, groups = self._ids()
        want = [str(AGENT_UID)] * 4
        host_uid = self.ev.agent_host_uid
        if uids != want or gids != want or groups not in ("", str(AGENT_UID)):
            return self.line("unprivileged-agent-uid", False, how,
                             f"the agent has Uid {' '.join(uids)}, Gid {' '.join(gids)}, "
                             f"Groups {groups or '-'}")
        if host_uid == 0:
            return self.line("unprivileged-agent-uid", False, how,
                             "files the agent writes belong to host root (uid 0)",
                             f"check KAROTTE_UID_BASE; {_BUG}")
        gid = self.ev.agent_host_gid
        if host_uid == self.host.euid:
            where = f"uid {host_uid}, the caller's own (see separate-host-uid)"
            binds = "writable binds (rw) are written as the caller too"
        else:
            where = f"uid {host_uid} ({host_uid:#x}), {_account(host_uid)}"
            binds = (f"so do files it writes through a writable bind (rw), whose source must "
                     f"let group {gid} write (chgrp {gid}; chmod g+rwxs)")
        return self.line("unprivileged-agent-uid", True,
                         f"uid and gid {AGENT_UID} inside, no groups; on the host the agent's "
                         f"files belong to {where}, group {gid}; {binds}")

    def separate_host_uid(self) -> Protection:

        name = "separate-host-uid"
        how = (f"as root, the sandbox's ids map to host {DEFAULT_UID_BASE:#x}.. "
               f"(KAROTTE_UID_BASE), and the agent is a host uid of its own per sandbox, from "
               f"{DEFAULT_UID_BASE + 65536:#x}..")
        host_uid = self.ev.agent_host_uid if self.ev else None
        if not self.host.root:
            seen = ""
            if host_uid is not None:
                seen = f" (measured: the agent's files belong to host uid {host_uid})"
            if self.inside and self.inside.get("signal_init") == 0:
                seen += ("; inside, the agent is also the same kernel uid as the sandbox's "
                         "init (kill(1, 0) succeeds)")
            return self.line(
                name, False, how,
                f"running as uid {self.host.euid}: an unprivileged caller can map only its own "
                f"uid, so the agent runs as host uid {self.host.euid}, the caller's own{seen}; "
                f"code that escaped the sandbox could reach every file and process of that uid",
                "run Karotte as root (the agent then gets a host uid that no account owns), or "
                "as a dedicated account that owns nothing else")
        missing = self.untested(name, how)
        if missing:
            return missing
        if host_uid in (0, self.host.euid):
            return self.line(name, False, how, f"the agent's files belong to host uid {host_uid}")
        return self.line(name, True, f"the agent's host uid {host_uid} ({host_uid:#x}) is not "
                         f"the caller's ({self.host.euid}) and is {_account(host_uid)}")

    def own_userns_owner(self) -> Protection:
        name = "own-userns-owner"
        how = ("as root, each sandbox's user namespace is created by a host uid of its own, "
               "and the agent runs as it, so per-user kernel counts made inside (inotify "
               "instances, message-queue bytes, queued signals, epoll watches, pipe buffers, "
               "fds in flight) are charged to it, not to the caller or other sandboxes")
        owner = self.ev.userns_owner if self.ev else None
        if not self.host.root:
            return self.line(
                name, False, how,
                f"running as uid {self.host.euid}: only the caller can create the sandbox's user "
                f"namespace, so what an agent takes of the per-user pools (inotify instances, "
                f"message queues, queued signals) is taken from uid {self.host.euid}'s; each "
                f"sandbox is capped, but many together can fill them",
                "run Karotte as root, or as a dedicated account whose per-user pools nothing "
                "else needs")
        missing = self.untested(name, how)
        if missing:
            return missing
        if owner is None:
            return self.line(name, False, how, "NS_GET_OWNER_UID on init's user namespace failed")
        if owner in (0, self.host.euid):
            return self.line(name, False, how, f"the sandbox's user namespace is owned by host "
                             f"uid {owner}, the caller's")
        agent = self.ev.agent_host_uid
        if agent != owner:
            return self.line(name, False, how, f"the agent's files belong to host uid {agent}, "
                             f"not to the namespace's owner {owner}: per-uid counts of all "
                             f"sandboxes are pooled")
        return self.line(name, True, f"the sandbox's user namespace is owned by host uid "
                         f"{owner} ({owner:#x}), the agent's own, not the caller's "
                         f"({self.host.euid}); that uid is {_account(owner)}")

    def new_session(self) -> Protection:
        how = "setsid() before exec: no controlling tty shared with the host"
        missing = self.untested("new-session", how)
        if missing:
            return missing
        sid, pid = self.inside["sid"], self.inside["pid"]
        return self.line("new-session", sid == pid, f"the agent's command leads its own session "
                         f"(sid {sid} = its pid)", f"the agent is in session {sid}, not its own "
                         f"({pid})")

    def closed_fds(self) -> Protection:
        how = "close_range(3, ~0) before exec"
        missing = self.untested("closed-fds", how)
        if missing:
            return missing
        extra = {fd: target for fd, target in self.inside["fds"].items() if int(fd) > 2}
        return self.line("closed-fds", not extra, "the agent's command starts with fds 0-2 only",
                         "the agent inherits fds " + ", ".join(f"{fd} ({t})" for fd, t in
                                                              sorted(extra.items())))

    def rlimits(self) -> Protection:
        spec = self.ev.spec if self.ev else PROBE_SPEC
        how = "setrlimit before exec: RLIMIT_FSIZE = disk, RLIMIT_NOFILE = nofile, RLIMIT_CORE = 0"
        missing = self.untested("rlimits", how)
        if missing:
            return missing
        got = {k: tuple(v) for k, v in self.inside["rlimits"].items()}
        want = {"RLIMIT_FSIZE": (spec.disk, spec.disk), "RLIMIT_NOFILE": (spec.nofile,
                                                                          spec.nofile),
                "RLIMIT_CORE": (0, 0)}
        wrong = [f"{k} is {got.get(k)}, asked {v}" for k, v in want.items() if got.get(k) != v]
        return self.line("rlimits", not wrong,
                         f"RLIMIT_FSIZE {_size(spec.disk)}, RLIMIT_NOFILE {spec.nofile}, "
                         f"RLIMIT_CORE 0 (soft = hard, read back inside)", "; ".join(wrong))

    def disk_quota(self) -> Protection:
        from .mounts import WORKSPACE, default_rootfs

        spec = self.ev.spec if self.ev else PROBE_SPEC
        how = ("every writable place of Karotte's is its own tmpfs with size= and nr_inodes=; "
               "a writable bind (rw) is the host's filesystem, outside it")
        missing = self.untested("disk-quota", how)
        if missing:
            return missing
        vfs = self.inside["statvfs"]
        devices = {f"/dev/{d}" for d in default_rootfs().devices}
        problems, places = [], []
        for point, opts, fstype in (_opts(line) for line in self.inside["mountinfo"]):
            if "ro" in opts or fstype in ("proc", "devpts") or point in devices:
                continue
            size, inodes = vfs.get(point, (0, 0))
            if fstype != "tmpfs" or not size or not inodes:
                problems.append(f"{point} is a writable {fstype} without a size and inode limit")
            else:
                places.append(f"{point} {_size(size)}")
        ws = vfs.get(WORKSPACE, (0, 0))
        if tuple(ws) != (spec.disk, spec.inodes):
            problems.append(f"{WORKSPACE} holds {_size(ws[0])} and {ws[1]} inodes, asked "
                            f"{_size(spec.disk)} and {spec.inodes}")
        return self.line("disk-quota", not problems,
                         f"{WORKSPACE} tmpfs {_size(ws[0])}, {ws[1]} inodes (statvfs inside); "
                         f"writable: {', '.join(places)}; a writable bind (rw) is outside "
                         f"this quota: only RLIMIT_FSIZE caps each of its files",
                         "; ".join(problems))

    # -- cgroups, read from the host

    def cgroup(self, name: str) -> Protection:
        version = (self.ev and self.ev.cgroup_version) or self.host.cgroup_version
        files = {
            "cgroup-memory": {1: "memory.limit_in_bytes", 2: "memory.max"},
            "cgroup-swap": {1: "memory.memsw.limit_in_bytes", 2: "memory.swap.max"},
            "cgroup-pids": {1: "pids.max", 2: "pids.max"},
            "cgroup-cpu": {1: "cpu.cfs_quota_us / cpu.cfs_period_us", 2: "cpu.max"},
            "cgroup-kill": {1: "freezer.state FROZEN, SIGKILL by pidfd, thaw",
                            2: "cgroup.kill (or cgroup.freeze, SIGKILL by pidfd)"},
        }[name]
        how = (f"cgroup v{version} {files[version]}" if version else
               f"cgroup v1 {files[1]}, or v2 {files[2]}")
        missing = self.untested(name, how)
        if missing:
            return missing
        return getattr(self, "_" + name.replace("-", "_"))(how)

    def _placed(self) -> str | None:
        if self.ev.unplaced:
            return f"init is not in {', '.join(self.ev.unplaced)}"
        return None

    def _cgroup_memory(self, how: str) -> Protection:
        spec, lim = self.ev.spec, self.ev.limits
        key = "memory.limit_in_bytes" if self.ev.cgroup_version == 1 else "memory.max"
        value = lim.get(key)
        if value != str(spec.memory) or self._placed():
            return self.line("cgroup-memory", False, how, self._placed() or
                             f"{key} is {value or 'missing'}, asked {spec.memory}")
        return self.line("cgroup-memory", True, f"cgroup v{self.ev.cgroup_version} {key} = "
                         f"{_size(spec.memory)} as asked (read on the host); init is in the "
                         f"cgroup")

    def _cgroup_swap(self, how: str) -> Protection:
        spec, lim = self.ev.spec, self.ev.limits
        if self.ev.cgroup_version == 1:
            key, want = "memory.memsw.limit_in_bytes", str(spec.memory)
            what = "= the memory limit: memory + swap may not exceed memory, so no swap"
            fix = ("boot with swapaccount=1 (cgroup v1 needs it for memory.memsw.*), or turn "
                   "swap off")
        else:
            key, want, what = "memory.swap.max", "0", "= 0"
            fix = "enable swap accounting (CONFIG_MEMCG_SWAP, no swapaccount=0), or turn swap off"
        value = lim.get(key)
        if value != want:
            swap = (_read("/proc/swaps") or "").splitlines()[1:]
            now = ("; swap is on now" if swap
                   else "; no swap is active now, so nothing is swapped today")
            return self.line("cgroup-swap", False, how,
                             f"{key} is {value or 'missing'}: the memory cgroup cannot forbid "
                             f"swap{now}", fix)
        return self.line("cgroup-swap", True, f"cgroup v{self.ev.cgroup_version} {key} {what}")

    def _cgroup_pids(self, how: str) -> Protection:
        value = self.ev.limits.get("pids.max")
        if value != str(self.ev.spec.pids) or self._placed():
            return self.line("cgroup-pids", False, how, self._placed() or
                             f"pids.max is {value or 'missing'}, asked {self.ev.spec.pids}")
        return self.line("cgroup-pids", True, f"cgroup v{self.ev.cgroup_version} pids.max = "
                         f"{self.ev.spec.pids} as asked (read on the host)")

    def _cgroup_cpu(self, how: str) -> Protection:
        lim = self.ev.limits
        quota = max(cgroups.MIN_QUOTA_US, round(self.ev.spec.cpus * cgroups.PERIOD_US))
        if self.ev.cgroup_version == 1:
            got = f"{lim.get('cpu.cfs_quota_us')} {lim.get('cpu.cfs_period_us')}"
            key = "cpu.cfs_quota_us cpu.cfs_period_us"
        else:
            got, key = lim.get("cpu.max", "None"), "cpu.max"
        want = f"{quota} {cgroups.PERIOD_US}"
        if got != want or self._placed():
            return self.line("cgroup-cpu", False, how, self._placed() or
                             f"{key} is {got}, asked {want}")
        return self.line("cgroup-cpu", True, f"cgroup v{self.ev.cgroup_version} {key} = {want} "
                         f"({self.ev.spec.cpus:g} CPU, read on the host)")

    def _cgroup_kill(self, how: str) -> Protection:
        ev = self.ev
        if ev.cgroup_version == 1:
            ok_files = "freezer.state" in ev.kill_files
            mech = "freezer.state FROZEN, SIGKILL by pidfd, thaw"
        else:
            ok_files = bool({"cgroup.kill", "cgroup.freeze"} & set(ev.kill_files))
            mech = ("cgroup.kill" if "cgroup.kill" in ev.kill_files
                    else "cgroup.freeze, SIGKILL by pidfd")
        if ev.kill_error or not ok_files or ev.kill_after != 0 or (ev.kill_before or 0) < 2:
            why = ev.kill_error or (
                f"no {' or '.join(_KILL_FILES)} in the sandbox's cgroup" if not ok_files else
                f"{ev.kill_after} of {ev.kill_before} tasks were left after kill_all()")
            return self.line("cgroup-kill", False, how, why)
        return self.line("cgroup-kill", True, f"cgroup v{ev.cgroup_version} {mech}: init and a "
                         f"background process ({ev.kill_before} tasks) killed, cgroup empty")

    # -- kernel interfaces the native layer needs

    def _refused(self, name: str, how: str, call: str, err: int,
                 need: tuple[int, int]) -> Protection:
        """The line for a kernel interface this process cannot use."""
        version = ".".join(map(str, need))
        cause = f"{call} fails with {errno.errorcode.get(err, err)} here"
        if self.host.version < need:
            return self.line(name, False, how, f"{cause}: kernel {self.host.kernel} is older "
                             f"than {version}", f"upgrade the kernel to {version} or later")
        return self.line(name, False, how,
                         f"{cause}, though kernel {self.host.kernel} has it (Linux {version}+): a "
                         f"seccomp profile or LSM around this process denies it, as container "
                         f"runtimes' default profiles do",
                         f"run Karotte on the host, or in a container whose seccomp profile "
                         f"allows {call}")

    def mount_setattr(self) -> Protection:
        how = "mount_setattr makes host binds read-only, nosuid, nodev"
        err = self.host.mount_setattr_errno
        if err in (errno.ENOSYS, errno.EPERM):
            return self._refused("mount-setattr", how, "mount_setattr", err, MOUNT_SETATTR_KERNEL)
        missing = self.untested("mount-setattr", how)
        if missing:
            return missing
        from .mounts import default_rootfs

        devices = {f"/dev/{d}" for d in default_rootfs().devices}
        bad = []
        binds = 0
        for point, opts, fstype in (_opts(line) for line in self.inside["mountinfo"]):
            if fstype in ("tmpfs", "proc", "devpts"):
                continue
            binds += 1
            want = {"nosuid"} if point in devices else {"ro", "nosuid", "nodev"}
            if not want <= opts:
                bad.append(f"{point} lacks {','.join(sorted(want - opts))}")
        if bad:
            return self.line("mount-setattr", False, how, "; ".join(bad))
        return self.line("mount-setattr", True, f"kernel {self.host.kernel}: all {binds} host "
                         f"binds are ro,nosuid,nodev (device nodes nosuid), as mountinfo "
                         f"shows inside")

    def pidfd(self) -> Protection:
        how = "init and cgroup tasks are signalled by pidfd, never by a recycled pid"
        if self.host.pidfd_errno:
            return self._refused("pidfd", how, "pidfd_open", self.host.pidfd_errno, PIDFD_KERNEL)
        missing = self.untested("pidfd", how)
        if missing:
            return missing
        if self.ev.init_pidfd_errno:
            return self.line("pidfd", False, how, f"pidfd_open(init) fails with "
                             f"{errno.errorcode.get(self.ev.init_pidfd_errno)}")
        return self.line("pidfd", True, "pidfd_open works; init was spawned with CLONE_PIDFD "
                         "and is held by a pidfd")

    def clone3(self) -> Protection:
        how = "one clone3 with every CLONE_NEW* flag and CLONE_PIDFD"
        if self.host.clone3_errno in (errno.ENOSYS, errno.EPERM):
            return self._refused("clone3", how, "clone3", self.host.clone3_errno, CLONE3_KERNEL)
        missing = self.untested("clone3", how)
        if missing:
            return missing
        if self.ev.unplaced:
            return self.line("clone3", False, how, self._placed())
        if self.ev.cgroup_failure is not None:
            place = "no cgroup to place init in (see cgroup-memory)"
        elif self.ev.cgroup_version == 2:
            need = ".".join(map(str, CLONE_INTO_CGROUP_KERNEL))
            place = f"CLONE_INTO_CGROUP (Linux {need}+) put init in its cgroup"
        else:
            place = ("on cgroup v1 the clone3 ran in a thread that had moved itself into the "
                     "sandbox's cgroups, so init started in them")
        return self.line("clone3", True, f"clone3 spawned init in every namespace; {place}")

    def all(self) -> tuple[Protection, ...]:
        out = []
        for name in PROTECTIONS:
            if name in NAMESPACES:
                out.append(self.namespace(name))
            elif name in CGROUP_LINES:
                out.append(self.cgroup(name))
            else:
                out.append(getattr(self, {
                    "seccomp": "seccomp", "no-new-privs": "no_new_privs",
                    "capabilities-dropped": "capabilities", "unprivileged-agent-uid": "agent_uid",
                    "separate-host-uid": "separate_host_uid", "new-session": "new_session",
                    "own-userns-owner": "own_userns_owner",
                    "closed-fds": "closed_fds", "disk-quota": "disk_quota", "rlimits": "rlimits",
                    "mount-setattr": "mount_setattr", "pidfd": "pidfd", "clone3": "clone3",
                }[name])())
        return tuple(out)


def _account(uid: int) -> str:
    try:
        return f"the host account {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return "owned by no host account"


# --------------------------------------------------------------------------- API

def probe() -> HostReport:
    """Test what this host enforces by building a small sandbox and looking inside it.

    Never raises for a host problem: what cannot be tested is reported missing, with
    the reason. Takes well under a second on a host that works.
    """
    start = time.monotonic()
    host = _host()
    run = _run_sandbox()
    protections = _Judge(host, run).all()
    return HostReport(protections=protections, kernel=host.kernel,
                      cgroup_version=host.cgroup_version, running_as_root=host.root,
                      uid=host.euid, userns_sysctls=host.sysctls, seconds=time.monotonic() - start)


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


__all__ = ["Protection", "HostReport", "PROTECTIONS", "probe", "render_text", "to_json",
           "userns_blocker"]
