"""Shared fixtures: real sandboxes, and a check that a test left nothing on the host."""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import functools
import importlib.util
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from karotte import cgroups
from karotte.errors import KarotteError
from karotte.sandbox import Sandbox
from karotte.userns import uid_base
from karotte.seccomp import SYSCALL_NUMBERS
from karotte.spec import MiB, SandboxSpec

PYTHON_IN_SANDBOX = "/usr/bin/python3"  # the host's system Python, bound read-only

# A syscall probe run inside the sandbox with ctypes: argv[1] is a JSON list of
# [name, nr, args]; prints a JSON object of each name's errno name, or OK.
SYSCALL_PROBE = """
import ctypes, errno, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long  # an address (mmap) is no int
out = {}
for name, nr, args in json.loads(sys.argv[1]):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    out[name] = "OK" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
print(json.dumps(out))
"""


def _nr(name: str) -> int:
    return SYSCALL_NUMBERS[name][platform.machine()]


# RES-BPFJIT-01: each call that has the kernel JIT-compile a BPF program into the host-wide
# budget (net.core.bpf_jit_limit), for SYSCALL_PROBE. The program pointer is NULL and the
# socket fd -1, so that where a call is allowed the kernel refuses it (EFAULT, EBADF)
# before it loads anything: EPERM can only come from the seccomp filter.
BPF_JIT_CALLS = [
    ("seccomp_filter", _nr("seccomp"), [1, 0, 0]),  # SECCOMP_SET_MODE_FILTER
    ("seccomp_filter_listener", _nr("seccomp"), [1, 8, 0]),  # ... FLAG_NEW_LISTENER
    ("prctl_seccomp_filter", _nr("prctl"), [22, 2, 0, 0, 0]),  # PR_SET_SECCOMP, MODE_FILTER
    ("so_attach_filter", _nr("setsockopt"), [-1, 1, 26, 0, 16]),  # SOL_SOCKET, ...
    ("so_attach_reuseport_cbpf", _nr("setsockopt"), [-1, 1, 51, 0, 16]),
    ("so_attach_bpf", _nr("setsockopt"), [-1, 1, 50, 0, 4]),
    ("so_attach_reuseport_ebpf", _nr("setsockopt"), [-1, 1, 52, 0, 4]),
]


def karotte_cgroups(creator: int | None = None) -> set[str]:
    """karotte-* cgroup directories made by the process `creator` (default: this one;
    other test runs may share the machine), less the empty ones this process keeps for
    reuse (which must hold no task)."""
    found = set(cgroups.find_created_by(creator))
    if creator not in (None, os.getpid()):
        return found
    pooled = cgroups.pooled_paths()
    for path in pooled:
        with open(os.path.join(path, "cgroup.procs")) as f:
            assert f.read() == "", f"a pooled cgroup holds tasks: {path}"
    return found - pooled


def needs_sandbox():
    """A skip mark for tests that need a working sandbox on this host, naming why not."""
    try:
        Sandbox().close()
        why = None
    except KarotteError as exc:
        why = str(exc)
    return pytest.mark.skipif(why is not None,
                              reason=f"Karotte cannot create a sandbox here: {why}")


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@contextlib.contextmanager
def only_fds_to_spare(spare: int):
    """Within: exactly `spare` free fd numbers left to this process. Every free number
    below the limit is filled (there may be none), then the limit is raised by exactly
    `spare`; the old limit comes back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(open_fds())
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
    filler = []
    try:
        while True:
            try:
                filler.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + spare, hard))
        for fd in range(top + 1):
            fcntl.fcntl(fd, fcntl.F_GETFD)  # raises if a number below the old limit is free
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def shared_dir():
    """A host directory that others may read (pytest's tmp_path is private to root)."""
    path = tempfile.mkdtemp(prefix="karotte-test-bind-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def sandbox_processes() -> set[int]:
    """The processes of this test run's sandboxes: descendants of this process that are
    a karotte-init or run under a sandbox's ids. (Counting all host processes would also
    count the host's own churn, and other test runs on a shared machine.)"""
    base = uid_base()
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name() == "karotte-init" or max(proc.uids()) >= base:
                found.add(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def child_inits() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True)
            if c.name() == "karotte-init"]


# Mounts that the host makes on its own while tests run: a login's runtime dir, the
# binfmt_misc automount. Karotte mounts nothing there.
HOST_MOUNT_CHURN = ("/run/user/", "/proc/sys/fs/binfmt_misc")


def host_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f
                if not line.split()[4].startswith(HOST_MOUNT_CHURN)]


@pytest.fixture
def no_leaks():
    """Asserts that the test left no sandbox cgroup, fd, init process or mount behind."""
    cgroups_before = karotte_cgroups()
    fds_before = open_fds()
    mounts_before = host_mounts()
    yield
    assert karotte_cgroups() - cgroups_before == set(), "sandbox cgroups left on the host"
    assert child_inits() == [], "karotte-init processes left running"
    leaked = open_fds() - fds_before
    assert leaked == set(), f"fds left open: {[os.readlink(f'/proc/self/fd/{fd}') for fd in leaked if os.path.exists(f'/proc/self/fd/{fd}')]}"
    assert host_mounts() == mounts_before, "the host's mount table changed"


@pytest.fixture
def sandbox(no_leaks):
    with Sandbox(SandboxSpec()) as sb:
        yield sb


# The limits of small_sandbox, for resource attacks.
SMALL_LIMITS = {"memory": 128 * MiB, "pids": 64, "disk": 64 * MiB, "inodes": 4096,
                "tmp_size": 32 * MiB, "timeout": 20}


@pytest.fixture
def small_sandbox(no_leaks):
    """A sandbox with small limits, for resource attacks."""
    with Sandbox(SandboxSpec(**SMALL_LIMITS)) as sb:
        yield sb


def py(code: str) -> list[str]:
    """argv running a Python snippet inside the sandbox."""
    return [PYTHON_IN_SANDBOX, "-I", "-c", code]


def run_karotte_sandbox(*args: str, input: bytes | None = None,
                        timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "karotte.cli.sandbox", *args], input=input,
                          capture_output=True, timeout=timeout)


# --------------------------------------------------------------------------- images

# Debian trees made by mmdebstrap, shared by test runs. Not under /tmp: the cgroup v2 VM
# lane hides the host's /tmp, but sees the rest of the host's / (read-only), so the lane
# copies these from here (docs/cgroup2-vm-lane.md).
IMAGE_CACHE = "/var/tmp/karotte-test-images"
IN_VM_LANE = os.environ.get("KAROTTE_VM_LANE") == "1"

# What the attack tests run on an image beyond bookworm's essential set (which has bash,
# dash, coreutils, grep and util-linux: fallocate, setsid, unshare).
ATTACK_PACKAGES = ("python3",)


def _tree_name(variant: str, packages: tuple[str, ...]) -> str:
    return f"bookworm-{variant}" + (f"+{','.join(packages)}" if packages else "")


def _cached(key: str, under: str) -> list[str]:
    """The complete trees of key under a cache directory, oldest first."""
    if not os.path.isdir(under):
        return []
    return sorted(os.path.join(under, n) for n in os.listdir(under)
                  if n.startswith(key + "-") and n[len(key) + 1:].isdigit())


def _mmdebstrap(dest: str, variant: str, packages: tuple[str, ...]) -> str | None:
    """Build a bookworm tree into dest; None, or why it could not."""
    if shutil.which("mmdebstrap") is None:
        return "mmdebstrap is not installed (apt-get install mmdebstrap)"
    tmp = dest + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    include = [f"--include={','.join(packages)}"] if packages else []
    r = subprocess.run(["mmdebstrap", "--quiet", f"--variant={variant}", *include, "bookworm",
                        tmp], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"mmdebstrap failed (is the Debian archive reachable?): {r.stderr.strip()[-300:]}"
    os.rename(tmp, dest)
    return None


@functools.cache
def build_debian_tree(variant: str, packages: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """(the tree, "") or (None, why not): a bookworm tree of mmdebstrap's variant with the
    packages, built once a day into IMAGE_CACHE; a lock file keeps two test runs from
    building it at once. Trees older than yesterday's are removed (a run that started
    yesterday may still be on one)."""
    if os.geteuid() != 0:
        return None, "mmdebstrap makes a root-owned tree as root only"
    key = _tree_name(variant, packages)
    os.makedirs(IMAGE_CACHE, exist_ok=True)
    os.chmod(IMAGE_CACHE, 0o755)
    dest = os.path.join(IMAGE_CACHE, f"{key}-{datetime.date.today():%Y%m%d}")
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(dest):
            why = _mmdebstrap(dest, variant, packages)
            if why:
                return None, why
        yesterday = f"{key}-{datetime.date.today() - datetime.timedelta(days=1):%Y%m%d}"
        for old in _cached(key, IMAGE_CACHE):
            if os.path.basename(old) < yesterday:  # another run may be removing it too
                shutil.rmtree(old, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old + ".lock")
    return dest, ""


@functools.cache
def _lane_copy(variant: str, packages: tuple[str, ...]) -> tuple[str | None, str]:
    """In the VM lane: the host's newest cached tree, copied into the guest's /tmp. The
    host's / is 9p there, which cannot be idmapped (an image's tree must be); the lane's
    /tmp is an ext4 of the guest's own, as a host's disk is."""
    key = _tree_name(variant, packages)
    cached = _cached(key, IMAGE_CACHE)
    if not cached:
        return None, (f"no {key} tree in the host's {IMAGE_CACHE}, and the VM lane has no "
                      "network to build one: run the image tests on the host first")
    dest = os.path.join(tempfile.gettempdir(), "karotte-test-images", os.path.basename(cached[-1]))
    if not os.path.isdir(dest):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        subprocess.run(["cp", "-a", cached[-1], dest + ".tmp"], check=True)
        os.rename(dest + ".tmp", dest)
    return dest, ""


def bookworm_tree(variant: str, packages: tuple[str, ...] = ()) -> str:
    """A bookworm tree for a test (see build_debian_tree); skips the test, naming why,
    where there is none."""
    tree, why = (_lane_copy if IN_VM_LANE else build_debian_tree)(variant, packages)
    if tree is None:
        pytest.skip(why)
    return tree


@pytest.fixture(scope="session")
def attack_tree() -> str:
    """A bookworm (mmdebstrap's apt variant) with what the attack tests run on an image."""
    return bookworm_tree("apt", ATTACK_PACKAGES)


@pytest.fixture(params=["host", pytest.param("image", marks=pytest.mark.cgroup2)])
def userland(request) -> str:
    """The SandboxSpec image a test runs on: the host's userland, or a Debian image (the
    tests then run the image's own python3, shell and tools: the host's are not there).
    The image half is in the cgroup v2 VM lane too."""
    if request.param == "host":
        return "host"
    if os.geteuid() != 0:
        pytest.skip("an unprivileged caller cannot run on a root-owned tree such as "
                    "mmdebstrap's (docs/image-sandbox.md)")
    return f"dir:{request.getfixturevalue('attack_tree')}"


# Forks until the pids limit stops it; prints the errno's name and how many children it made.
FORK_BOMB = """
import os, errno, time
kids = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60); os._exit(0)
        kids += 1
except OSError as e:
    print(errno.errorcode[e.errno], kids)
"""


def assert_measured(series: dict) -> None:
    """A benchmark's series (its JSON) was measured: samples, and stats that agree."""
    assert series["status"] == "ok", series
    samples = series["samples_ns"]
    assert samples and all(isinstance(s, int) and s > 0 for s in samples), series["name"]
    stats = series["stats"]
    assert stats["n"] == len(samples)
    for key in ("median_ms", "p10_ms", "p90_ms", "min_ms", "max_ms"):
        assert stats[key] > 0, (series["name"], key)
    assert stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"]


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is no package), loaded once a test run."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def drop_pages(path) -> None:
    """The host (not a sandbox: there it is a no-op, RES-PAGECACHE-01) drops the file's
    pages from its page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _whole_disk(dev: int) -> str:
    """"major:minor" of the disk that holds device `dev` (a partition's parent), which is
    what a block cgroup's limits name."""
    node = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)
    with open(os.path.join(node, "dev")) as f:
        return f.read().strip()


@contextlib.contextmanager
def slow_disk_reads(path):
    """A block cgroup whose reads of the disk that holds `path` are throttled to 4 KiB/s
    (yields its cgroup.procs path, which a process writes its pid to when it is ready to
    be slowed, after its own imports: page cache here may be small). A read that a
    process in it starts cannot complete within the same system call: preadv2(RWF_NOWAIT)
    of a cold page starts the page's read and then finds it not yet in, where on a fast
    virtual disk the read often wins that race and a cold page reads as cached. The limit
    is lifted on leaving, so the reads still queued go through, and the cgroup removed."""
    disk = _whole_disk(os.stat(path).st_dev)
    v1 = "/sys/fs/cgroup/blkio"
    if os.path.exists(os.path.join(v1, "blkio.throttle.read_bps_device")):
        top, limit = v1, "blkio.throttle.read_bps_device"
        setting, lifted = f"{disk} 4096", f"{disk} 0"
    else:
        top = "/sys/fs/cgroup"
        try:
            with open(os.path.join(top, "cgroup.subtree_control")) as f:
                has_io = "io" in f.read().split()
        except OSError:
            has_io = False
        if not has_io:
            pytest.skip("no block cgroup to slow the disk's reads: neither cgroup v1's "
                        "blkio nor cgroup v2's io controller enabled at the root")
        limit, setting, lifted = "io.max", f"{disk} rbps=4096", f"{disk} rbps=max"
    group = tempfile.mkdtemp(prefix="karotte-test-slowread-", dir=top)
    try:
        with open(os.path.join(group, limit), "w") as f:
            f.write(setting)
        try:
            yield os.path.join(group, "cgroup.procs")
        finally:
            with open(os.path.join(group, limit), "w") as f:
                f.write(lifted)
    finally:
        os.rmdir(group)


def make_cold(path) -> None:
    """Drops the file's (clean) pages from the host's cache, and skips the test unless
    none stayed, as read from the host by cachestat(2) (bench_side_channels.cached_pages)."""
    drop_pages(path)
    try:
        cached = load_script("bench_side_channels").cached_pages(path)
    except OSError as e:
        if e.errno != errno.ENOSYS:
            raise
        pytest.skip("this kernel has no cachestat (Linux 6.5+), with which the test reads "
                    "from the host which pages are cached")
    if cached:
        pytest.skip("the file's pages stayed cached after POSIX_FADV_DONTNEED on the host, "
                    "so no mark could be told from no mark")


NOBODY = 65534


@contextlib.contextmanager
def delegated_v1_cgroup(prefix: str):
    """Within: a cgroup that root hands to uid 65534 (NOBODY) in every v1 hierarchy, as
    systemd's Delegate=yes would; yields its path for KAROTTE_CGROUP_PARENT. Skips on a
    v2 host (v2 delegation is the VM lane's, tests/test_cgroup2_lane.py)."""
    backend = cgroups.detect()
    if backend.version != 1:
        pytest.skip("this delegation set-up is for cgroup v1 hosts; v2 delegation is the VM "
                    "lane's (tests/test_cgroup2_lane.py)")
    name = f"{prefix}-{os.getpid()}"
    dirs = sorted({os.path.join(m.point, name) for m in backend.hierarchies.values()})
    try:
        for d in dirs:
            os.mkdir(d)
            for entry in (d, os.path.join(d, "cgroup.procs"), os.path.join(d, "tasks")):
                os.chown(entry, NOBODY, NOBODY)
        yield "/" + name
    finally:
        for d in dirs:
            if not os.path.isdir(d):
                continue
            for child in os.listdir(d):
                if os.path.isdir(os.path.join(d, child)):
                    cgroups.remove_stale(os.path.join(d, child))
            os.rmdir(d)
