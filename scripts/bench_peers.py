"""The sandboxes Karotte is measured against in bench_sandbox.py's lifecycle case: each
creates a sandbox, runs /bin/true in it and destroys it, as a subprocess of the driver,
with the mounts, ids, limits and seccomp filter Karotte's defaults have.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time

import benchlib  # noqa: F401 - before karotte: it puts this checkout's karotte on sys.path
from karotte import mounts
from karotte import sandbox as ksandbox
from karotte.seccomp import compile_policy
from karotte.spec import SandboxSpec

TRUE = "/bin/true"


class PeerFailed(Exception):
    """A peer sandbox tool ran but did not succeed; the message is its own words."""

def _rootfs_layout() -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """What Karotte's default mount plan shows of the host: ([(kind, path)] of the
    userland (symlink target or bind), host /etc entries that exist, generated /etc
    file names). Peers get the same, so they build as many mounts as Karotte does."""
    rootfs = mounts.default_rootfs()
    userland = []
    for path in rootfs.userland:
        if os.path.islink(path):
            userland.append(("symlink", path))
        elif os.path.isdir(path):
            userland.append(("bind", path))
    host_etc = [n for n in rootfs.host_etc if os.path.exists(f"/etc/{n}")]
    generated = [name for name, _ in rootfs.etc_files] + ["hostname", "hosts"]
    return userland, host_etc, generated


class Competitor:
    """One way to create a sandbox, run /bin/true in it and destroy it."""

    name = ""
    describe = ""

    def prepare(self) -> str | None:
        """Set up; the reason it cannot run here, or None."""
        return None

    def run_once(self) -> int:
        """One timed run: wall-clock nanoseconds. PeerFailed if it did not succeed."""
        raise NotImplementedError

    def cleanup(self) -> None:
        pass


class SubprocessPeer(Competitor):
    """A peer run as `subprocess.run(argv)` from this driver."""

    tool = ""

    def __init__(self):
        self.path: str | None = None
        self.argv: list[str] = []
        self.pass_fds: tuple[int, ...] = ()

    def prepare(self) -> str | None:
        self.path = shutil.which(self.tool)
        if self.path is None:
            return f"{self.tool} not found on PATH"
        return None

    def _run(self, argv: list[str], pass_fds=()) -> int:
        t0 = time.perf_counter_ns()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, pass_fds=pass_fds)
        t1 = time.perf_counter_ns()
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            raise PeerFailed(f"`{shlex.join(argv)}` exited {proc.returncode}: "
                             f"{err or '(no stderr)'}")
        return t1 - t0

    def run_once(self) -> int:
        return self._run(self.argv, self.pass_fds)


class NoSandbox(SubprocessPeer):
    name = "no sandbox (control)"
    describe = "subprocess.run(['/bin/true']): the driver's own fork+exec+wait cost"

    def prepare(self) -> str | None:
        self.path = TRUE
        self.argv = [TRUE]
        return None


class Unshare(SubprocessPeer):
    name = "unshare (floor)"
    tool = "unshare"
    describe = "unshare -Urpfmn --mount-proc /bin/true: namespaces and /proc only"

    def prepare(self) -> str | None:
        why = super().prepare()
        if why:
            return why
        self.argv = [self.path, "-Urpfmn", "--mount-proc", TRUE]
        return None


class Bwrap(SubprocessPeer):
    name = "bwrap"
    tool = "bwrap"
    describe = ("bwrap --unshare-all --unshare-user --die-with-parent, Karotte's mounts "
                "(ro /usr, merged-usr symlinks, host /etc entries ro, --proc, --dev, tmpfs "
                "/tmp /workspace /home/agent), uid 1000, Karotte's seccomp filter")

    def __init__(self):
        super().__init__()
        self._filter_path: str | None = None
        self._seccomp = True

    def prepare(self) -> str | None:
        why = super().prepare()
        if why:
            return why
        userland, host_etc, generated = _rootfs_layout()
        argv = [self.path, "--unshare-all", "--unshare-user", "--die-with-parent",
                "--uid", "1000", "--gid", "1000", "--hostname", "karotte"]
        for kind, path in userland:
            if kind == "symlink":
                argv += ["--symlink", os.readlink(path), path]
            else:
                argv += ["--ro-bind", path, path]
        # Karotte writes passwd, group, nsswitch.conf, resolv.conf, hostname and hosts
        # as files of its own; bwrap binds the host's instead (a mount each, as Karotte).
        for name in sorted(set(host_etc) | set(generated)):
            argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                 "--tmpfs", "/workspace", "--tmpfs", "/home/agent", "--dir", "/root"]
        try:
            filt = compile_policy()
            fd, self._filter_path = tempfile.mkstemp(prefix="karotte-bench-seccomp-")
            os.write(fd, filt)
            os.close(fd)
        except Exception as exc:  # noqa: BLE001 - reported, bwrap runs without it
            self._seccomp = False
            self.describe += f" (without seccomp: {exc})"
        self.argv = argv
        return None

    def run_once(self) -> int:
        if not self._seccomp:
            return self._run(self.argv + [TRUE])
        # bwrap reads the filter to EOF, so each run gets a fresh open file description.
        fd = os.open(self._filter_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return self._run(self.argv + ["--seccomp", str(fd), TRUE], pass_fds=(fd,))
        finally:
            os.close(fd)

    def cleanup(self) -> None:
        if self._filter_path:
            os.unlink(self._filter_path)


class Runc(SubprocessPeer):
    name = "runc"
    tool = "runc"
    describe = ("runc run of an OCI bundle: read-only empty rootfs with Karotte's binds "
                "and tmpfs, user namespace (0 -> 0x70000000, 65536 ids), uid 1000, "
                "Karotte's cgroup limits; no seccomp profile")

    def __init__(self):
        super().__init__()
        self.dir: str | None = None
        self._seq = 0

    def prepare(self) -> str | None:
        why = super().prepare()
        if why:
            return why
        self.dir = tempfile.mkdtemp(prefix="karotte-bench-runc-")
        # The sandbox's root is a mapped uid that owns nothing: it must traverse the bundle.
        os.chmod(self.dir, 0o755)
        rootfs = os.path.join(self.dir, "rootfs")
        os.mkdir(rootfs)
        for mountpoint in ("proc", "dev"):  # the root is read-only: runc cannot make them
            os.mkdir(os.path.join(rootfs, mountpoint))
        userland, host_etc, generated = _rootfs_layout()
        mnts = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "mode=755", "size=1024k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "nodev", "mode=1777", "size=262144k"]},
        ]
        for kind, path in userland:
            if kind == "symlink":
                os.symlink(os.readlink(path), rootfs + path)
            else:
                os.makedirs(rootfs + path)
                mnts.append({"destination": path, "type": "bind", "source": path,
                             "options": ["rbind", "ro", "nosuid", "nodev"]})
        os.makedirs(rootfs + "/etc")
        for name in sorted(set(host_etc) | set(generated)):
            src = f"/etc/{name}"
            if not os.path.exists(src):
                continue
            if os.path.isdir(src):
                os.makedirs(rootfs + src)
            else:
                open(rootfs + src, "w").close()
            mnts.append({"destination": src, "type": "bind", "source": src,
                         "options": ["rbind", "ro", "nosuid", "nodev"]})
        for path, size in (("/tmp", "262144k"), ("/workspace", "1048576k"),
                           ("/home/agent", "65536k")):
            os.makedirs(rootfs + path)
            mnts.append({"destination": path, "type": "tmpfs", "source": "tmpfs",
                         "options": ["nosuid", "nodev", "mode=1777", f"size={size}"]})
        os.makedirs(rootfs + "/root")
        spec = SandboxSpec()
        base = ksandbox.DEFAULT_UID_BASE
        config = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False, "user": {"uid": 1000, "gid": 1000},
                "args": [TRUE], "env": ["PATH=/usr/bin:/bin"], "cwd": "/",
                "capabilities": {"bounding": [], "effective": [], "permitted": [],
                                 "ambient": []},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": spec.nofile, "soft": spec.nofile}],
                "noNewPrivileges": True,
            },
            "root": {"path": "rootfs", "readonly": True},
            "hostname": spec.hostname,
            "mounts": mnts,
            "linux": {
                "uidMappings": [{"containerID": 0, "hostID": base, "size": 65536}],
                "gidMappings": [{"containerID": 0, "hostID": base, "size": 65536}],
                "namespaces": [{"type": t} for t in
                               ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")],
                "resources": {
                    "memory": {"limit": spec.memory, "swap": spec.memory},
                    "pids": {"limit": spec.pids},
                    "cpu": {"quota": round(spec.cpus * 100_000), "period": 100_000},
                },
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list",
                                "/proc/sched_debug"],
                "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                                  "/proc/sysrq-trigger"],
            },
        }
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        os.mkdir(os.path.join(self.dir, "state"))
        return None

    def run_once(self) -> int:
        self._seq += 1
        cid = f"kbench-{os.getpid()}-{self._seq}"
        argv = [self.path, "--root", os.path.join(self.dir, "state"), "run",
                "--bundle", self.dir, cid]
        try:
            return self._run(argv)
        except PeerFailed:
            # A failed run may leave its state and cgroup behind: remove them.
            subprocess.run([self.path, "--root", os.path.join(self.dir, "state"), "delete",
                            "--force", cid], capture_output=True)
            raise

    def cleanup(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
