"""Evidence: the host's own facts, and what a small real sandbox shows from inside.

A sandbox that cannot be created (or cannot get a cgroup) is evidence too: ``_Failure``
holds the cause and fix of each line it takes away.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import pwd
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import cgroups, steps
from ..errors import CgroupError, HostUnsupported, KarotteError
from ..namespaces import CLONE_NEWUSER
from ..protections import CGROUP_LINES, NAMESPACES, NO_CGROUP, PROTECTIONS
from ..seccomp import SYSCALL_NUMBERS
from ..spec import MiB, SandboxSpec
from ..userns import userns_cause, userns_owner

PYTHON = "/usr/bin/python3"  # bound into every sandbox with /usr
BUSYBOX = "/bin/busybox"  # static (busybox-static): the whole tree of the probe's image
IMAGE_MARK = "/var/tmp/karotte-probe-image"  # written by the agent in the image's own dir
IMAGE_TREE = ["bin", "bin/busybox", "var", "var/tmp"]  # the probe's image, as made
MARK = ".karotte-probe"  # written by the agent in /workspace; its host owner is measured
HIDDEN = ("/etc/shadow", "/var", "/run", "/sys", "/boot")  # host paths the plan never binds
SYSCTLS = ("kernel/apparmor_restrict_unprivileged_userns", "kernel/unprivileged_userns_clone",
           "user/max_user_namespaces")
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


# --------------------------------------------------------------------------- host facts

def _read_or_none(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _account(uid: int) -> str:
    try:
        return f"the host account {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return "owned by no host account"


def _kernel_version(release: str) -> tuple[int, int]:
    parts = release.split("-")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _syscall_errno(name: str, *args) -> int:
    """errno of a harmless, invalid call to a syscall (0 if it succeeded). ENOSYS means
    the kernel lacks it, or a seccomp profile around this process denies it."""
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
        sysctls={name.replace("/", "."): _read_or_none(f"/proc/sys/{name}") for name in SYSCTLS},
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

ADDR_NO_RANDOMIZE = 0x0040000
RLIMITS = ("RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_CORE")


def _denied_calls() -> list[tuple[str, int, list]]:
    """Calls the default seccomp policy denies and that would succeed, or fail with
    another errno, without it: (label, number, args)."""
    arch = platform.machine()
    calls = [("unshare(CLONE_NEWUSER)", "unshare", [CLONE_NEWUSER]),
             ("personality(ADDR_NO_RANDOMIZE)", "personality", [ADDR_NO_RANDOMIZE]),
             ("clone3", "clone3", [None, 0])]
    return [(label, SYSCALL_NUMBERS[name][arch], args) for label, name, args in calls
            if SYSCALL_NUMBERS[name].get(arch) is not None]


def _mount_fields(mount_line: str) -> tuple[str, set[str], str]:
    """(mount point, per-mount options, fs type) of a /proc/self/mountinfo line."""
    head, _, tail = mount_line.partition(" - ")
    fields = head.split()
    return fields[4], set(fields[5].split(",")), tail.split()[0]


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
    inside_step: str | None = None  # where the in-sandbox probe's exec failed, if it did
    agent_host_uid: int | None = None
    agent_host_gid: int | None = None
    userns_owner: int | None = None  # host uid that owns the sandbox's user namespace
    init_pidfd_errno: int | None = None
    kill_before: int | None = None  # tasks in the cgroup before kill_all()
    kill_after: int | None = None
    kill_error: str | None = None
    image: _ImageEvidence | None = None  # the sandbox on an image (image-overlay)


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
        # Lazy on purpose: a missing C build becomes a reported failure, not a crash of check.
        from ..sandbox import Sandbox
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
    spec = replace(PROBE_SPEC, allow_degraded=PROBE_SPEC.allow_degraded | NO_CGROUP)
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
    ev.image = _run_image_sandbox(type(sb), sb.spec)
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
        ev.inside_step = result.error_step
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


# --------------------------------------------------------------------------- on an image

# Runs as the agent under busybox sh, on the probe's image: write to a world-writable
# directory of the image (not a mount of its own: the overlay) and read it back, then the root's mount line and its statfs (overlayfs reports its
# upper's: the tmpfs whose size is the disk limit).
_IMAGE_INSIDE = (f"echo karotte > {IMAGE_MARK} && busybox cat {IMAGE_MARK} && "
                 "busybox grep ' / / ' /proc/self/mountinfo && busybox stat -f -c '%S %b %c' /")


@dataclass
class _ImageEvidence:
    """What a sandbox on a tiny image (a tree holding busybox) showed."""

    failure: tuple[str, str] | None = None  # why it could not be shown, and the fix
    read_back: str | None = None  # what the agent read back of its write
    root_mount: str | None = None  # the mountinfo line of / inside
    statfs: tuple[int, int, int] | None = None  # f_frsize, f_blocks, f_files of / inside
    tree_after: list[str] | None = None  # the tree's paths on the host afterwards


def _run_image_sandbox(sandbox, spec: SandboxSpec) -> _ImageEvidence:
    """A sandbox (of the class `sandbox`, which _create_sandbox imported) on a dir: image
    of a tree made here (IMAGE_TREE, nothing else)."""
    if not os.path.exists(BUSYBOX):
        return _ImageEvidence(failure=(
            f"untested: {BUSYBOX} is missing; the probe's image is a tree holding it",
            "install a static busybox (Debian: apt-get install busybox-static)"))
    tree = tempfile.mkdtemp(prefix="karotte-probe-image-")
    try:
        os.chmod(tree, 0o755)
        os.mkdir(os.path.join(tree, "bin"), 0o755)
        shutil.copy(BUSYBOX, os.path.join(tree, "bin", "busybox"))
        os.makedirs(os.path.join(tree, "var", "tmp"))
        os.chmod(os.path.join(tree, "var", "tmp"), 0o1777)
        try:
            with sandbox(replace(spec, image=f"dir:{tree}")) as sb:
                result = sb.exec(["/bin/busybox", "sh", "-c", _IMAGE_INSIDE])
        except (KarotteError, OSError, ValueError) as exc:
            failure = _failure(exc)
            return _ImageEvidence(failure=failure.causes.get(
                "image-overlay", (f"the probe sandbox on an image failed: {exc}",
                                  steps.fix("image-overlay"))))
        ev = _ImageEvidence(tree_after=sorted(
            os.path.relpath(os.path.join(d, n), tree) for d, dirs, files in os.walk(tree)
            for n in dirs + files))
        lines = result.stdout.decode(errors="replace").splitlines()
        if not result.ok or len(lines) != 3:
            ev.failure = (f"the agent's command on the image failed: "
                          f"{result.error or result.stderr.decode(errors='replace')[-300:]!r}",
                          steps.fix("image-overlay"))
            return ev
        ev.read_back, ev.root_mount = lines[0], lines[1]
        frsize, blocks, files = (int(n) for n in lines[2].split())
        ev.statfs = (frsize, blocks, files)
        return ev
    finally:
        shutil.rmtree(tree, ignore_errors=True)


# --------------------------------------------------------------------------- failure causes

@dataclass(frozen=True)
class _Failure:
    """Why some lines could not be shown in force: {line: (why_not, fix)}; the first
    entry is the root cause."""

    causes: dict[str, tuple[str, str]]

    @property
    def first(self) -> str:
        return next(iter(self.causes))


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
                                            and NO_CGROUP <= set(exc.protections))


def _failure(exc: BaseException) -> _Failure:
    message = str(exc) or type(exc).__name__
    if _is_cgroup_error(exc):
        return _Failure({name: (message, _cgroup_fix()) for name in CGROUP_LINES})
    if isinstance(exc, HostUnsupported) and exc.protection == "user-namespace":
        return _Failure({"user-namespace": (message, userns_cause(errno.EPERM)[1])})
    if isinstance(exc, HostUnsupported):
        return _Failure({name: (message, steps.fix(name)) for name in exc.protections})
    row = steps.step(getattr(exc, "step", None))  # as init or the spawn reported it
    if row.protections:
        return _Failure({name: (message, row.fix) for name in row.protections})
    return _Failure({name: (message, steps.fix(name)) for name in PROTECTIONS})
