"""Host-wide kernel state that one sandbox sets and another, or a later one, observes.

A sender sandbox leaves marks in state that every sandbox shares (which pages of a
read-only bound file are in the host's page cache, how full its workspace is); a
receiver sandbox probes for them. Through each probe the policy denies, the receiver
gets the policy's errno for every page and learns nothing, while the same probe run on
the host without the filter (its disk reads slowed, so that a read the probe starts
cannot win the race) reads the marks exactly: the marks are there, and the probe would
carry them. LINK-CACHE-01 has the sender's sandbox closed before the receiver's is
made (a check run before a timed run); LINK-SIBLING-01 has both alive at once.

The channels that stay open (timing the reads, pagemap after fault-around, futexes and
inotify on /usr) are measured by scripts/bench_side_channels.py, not here: no test
depends on timing. docs/side-channels.md has the whole audit.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from karotte.sandbox import Sandbox
from karotte.seccomp import SYSCALL_NUMBERS
from karotte.spec import Bind, MiB, SandboxSpec

from conftest import load_script, make_cold, needs_sandbox, py, slow_disk_reads

pytestmark = needs_sandbox()

bench = load_script("bench_side_channels")

PAGES = 64
_rng = random.Random(7)
BITS = [_rng.randint(0, 1) for _ in range(PAGES)]
assert 0 in BITS and 1 in BITS
MARKED = [page for page, bit in enumerate(BITS) if bit]


@pytest.fixture
def shared_dir():
    """A directory on disk (not tmpfs: its pages can be cold) holding `blob`, 64 pages
    that no one may have cached, for binds into sandboxes."""
    top = tempfile.mkdtemp(prefix="karotte-test-link-")
    try:
        os.chmod(top, 0o755)
        blob = os.path.join(top, "blob")
        with open(blob, "wb") as f:
            f.write(os.urandom(PAGES * 4096))
            f.flush()
            os.fsync(f.fileno())  # clean pages, which the host's own DONTNEED drops
        os.chmod(blob, 0o666)  # writable through a writable bind, for the kernel's checks
        make_cold(blob)
        yield top
    finally:
        shutil.rmtree(top)


def _spec_for(top: str, writable: bool) -> SandboxSpec:
    return SandboxSpec(binds=(Bind(top, "/data", writable=writable),))


def _host_truth(top: str) -> list[str]:
    """Each page's residency, by cachestat from the host (this process made the file)."""
    return [str(bench.cached_pages(os.path.join(top, "blob"), page, 1)) for page in range(PAGES)]


# Runs the receiver's program (argv[2:]) after its imports, in the block cgroup whose
# cgroup.procs is argv[1].
_SLOWED = """
import ctypes, errno, json, mmap, os, struct, sys, time
procs = sys.argv.pop(1)
with open(procs, "w") as f:
    f.write(str(os.getpid()))
exec(compile(sys.argv.pop(1), "<receiver>", "exec"))
"""


def _probe_on_host(method: str, top: str) -> list[str]:
    """The receiver's program run on the host, without Karotte's filter, with its disk
    reads slowed: a probe that starts the read of a cold page (RWF_NOWAIT does) must not
    see that read finish, or it would read the page as cached."""
    blob = os.path.join(top, "blob")
    with slow_disk_reads(blob) as procs:
        run = subprocess.run([sys.executable, "-I", "-c", _SLOWED, procs, bench.RECEIVER_CACHE,
                              method, blob, json.dumps(list(range(PAGES))), bench._numbers()],
                             capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["results"]


def _marks(sender: Sandbox, top: str) -> None:
    bench.send_marks(sender, "/data/blob", MARKED)
    # The sender could set the state: exactly its pages are now in the host's cache.
    assert _host_truth(top) == [str(bit) for bit in BITS]


def _receive(receiver: Sandbox, method: str) -> list[str]:
    return bench.receive_marks(receiver, method, "/data/blob", list(range(PAGES)))["results"]


# (probe, errno the policy gives, whether the bind must be writable for the kernel's own
# checks to let the call through: cachestat of a file the caller may not write is refused
# by Linux 6.18 itself, which would hide what the policy does)
DENIED_PROBES = [
    pytest.param("nowait", "EOPNOTSUPP", False, id="preadv2_rwf_nowait"),
    pytest.param("cachestat", "EPERM", True, id="cachestat"),
]


@pytest.mark.parametrize(("method", "policy_errno", "writable"), DENIED_PROBES)
def test_LINK_CACHE_01_a_later_sandbox_reads_no_page_cache_mark_through_a_denied_probe(
        no_leaks, shared_dir, method, policy_errno, writable):
    spec = _spec_for(shared_dir, writable)
    with Sandbox(spec) as sender:
        _marks(sender, shared_dir)
    with Sandbox(spec) as receiver:  # made after the sender's sandbox is gone
        assert _receive(receiver, method) == [policy_errno] * PAGES
    assert _probe_on_host(method, shared_dir) == [str(bit) for bit in BITS]


@pytest.mark.parametrize(("method", "policy_errno", "writable"), DENIED_PROBES)
def test_LINK_SIBLING_01_a_live_sandbox_reads_no_page_cache_mark_through_a_denied_probe(
        no_leaks, shared_dir, method, policy_errno, writable):
    spec = _spec_for(shared_dir, writable)
    with Sandbox(spec) as sender, Sandbox(spec) as receiver:
        _marks(sender, shared_dir)
        assert _receive(receiver, method) == [policy_errno] * PAGES
    assert _probe_on_host(method, shared_dir) == [str(bit) for bit in BITS]


def test_LINK_CACHE_01_mincore_reads_every_page_of_a_file_the_agent_may_not_write_as_cached(
        no_leaks, shared_dir):
    # mincore stays allowed: for a file the caller may not write by its permissions
    # (all of the host's /usr: root's, mode 644 or 755), the kernel reports every page
    # resident. For a file it may write, even through a read-only bind, it reports the
    # truth, which shows the marks are there to be read.
    blob = os.path.join(shared_dir, "blob")
    spec = _spec_for(shared_dir, writable=False)
    with Sandbox(spec) as sender:
        _marks(sender, shared_dir)
    os.chmod(blob, 0o644)
    with Sandbox(spec) as receiver:
        assert _receive(receiver, "mincore") == ["1"] * PAGES
    os.chmod(blob, 0o666)
    with Sandbox(spec) as receiver:
        assert _receive(receiver, "mincore") == [str(bit) for bit in BITS]


def test_LINK_CACHE_01_map_populate_nonblock_maps_no_cached_page(no_leaks, shared_dir):
    # MAP_POPULATE | MAP_NONBLOCK once mapped only the pages already cached, which
    # pagemap would show; the kernel now maps none of them.
    spec = _spec_for(shared_dir, writable=False)
    with Sandbox(spec) as sender:
        _marks(sender, shared_dir)
    with Sandbox(spec) as receiver:
        assert _receive(receiver, "populate") == ["0"] * PAGES
        # The marks are there for a probe that maps them: fault-around after a fault on
        # the first page of each 16-page window (which that fault maps itself).
        around = [bit for page, bit in enumerate(_receive(receiver, "pagemap")) if page % 16]
        assert around == [str(bit) for page, bit in enumerate(BITS) if page % 16]


USTAT = r"""
import ctypes, errno, json, sys
libc = ctypes.CDLL(None, use_errno=True)
class Ustat(ctypes.Structure):
    _fields_ = [("tfree", ctypes.c_long), ("tinode", ctypes.c_ulong), ("fname", ctypes.c_char * 6),
                ("fpack", ctypes.c_char * 6)]
nr, dev = int(sys.argv[1]), int(sys.argv[2])
u = Ustat()
ctypes.set_errno(0)
rc = libc.syscall(ctypes.c_long(nr), ctypes.c_ulong(dev), ctypes.byref(u))
print(json.dumps([u.tfree, u.tinode] if rc == 0 else errno.errorcode[ctypes.get_errno()]))
"""


@pytest.mark.skipif(SYSCALL_NUMBERS["ustat"].get(os.uname().machine) is None,
                    reason="ustat exists only on x86_64 among Karotte's architectures")
def test_LINK_SIBLING_01_ustat_of_another_sandboxs_workspace_is_denied(no_leaks):
    # ustat(dev) reads any mounted filesystem's free blocks by device number, past the
    # mount namespace: the sender fills its workspace, the receiver would see it drop.
    nr = str(SYSCALL_NUMBERS["ustat"][os.uname().machine])

    def host_ustat(dev: int) -> list[int]:
        run = subprocess.run([sys.executable, "-I", "-c", USTAT, nr, str(dev)],
                             capture_output=True, text=True, timeout=60, check=True)
        return json.loads(run.stdout)

    with Sandbox() as sender, Sandbox() as receiver:
        dev = sender.exec(py("import os; print(os.stat('/workspace').st_dev)"))
        dev = int(dev.stdout)
        before = host_ustat(dev)
        seen_before = receiver.exec(py(USTAT) + [nr, str(dev)])
        fill = sender.exec(["/bin/sh", "-c", "head -c 16777216 /dev/zero > /workspace/fill"])
        assert fill.exit_code == 0, fill.stderr
        seen_after = receiver.exec(py(USTAT) + [nr, str(dev)])
        after = host_ustat(dev)
    assert (json.loads(seen_before.stdout), json.loads(seen_after.stdout)) == ("EPERM", "EPERM")
    assert after[0] < before[0] - 16 * MiB // 4096 // 2  # the host sees the blocks go


IPC_MAKE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0x4B41524F, 4096, 0o1666) >= 0  # IPC_CREAT
attr = (ctypes.c_long * 8)(0, 1, 16, 0)  # mq_flags, mq_maxmsg 1, mq_msgsize 16: a small queue
fd = libc.mq_open(b"/karotte-link", os.O_CREAT | os.O_RDWR, 0o666, attr)
assert fd >= 0, ctypes.get_errno()
print("made")
"""

IPC_FIND = r"""
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
found = {}
ctypes.set_errno(0)
found["shm"] = "found" if libc.shmget(0x4B41524F, 0, 0) >= 0 else errno.errorcode[ctypes.get_errno()]
ctypes.set_errno(0)
fd = libc.mq_open(b"/karotte-link", 0)
found["mq"] = "found" if fd >= 0 else errno.errorcode[ctypes.get_errno()]
print(json.dumps(found))
"""


def test_LINK_SIBLING_01_ipc_objects_are_private_to_a_sandbox(no_leaks):
    with Sandbox() as sender, Sandbox() as receiver:
        made = sender.exec(py(IPC_MAKE))
        assert made.stdout == b"made\n", made.stderr
        in_sender = sender.exec(py(IPC_FIND))  # a later process of the same sandbox
        in_receiver = receiver.exec(py(IPC_FIND))
    assert json.loads(in_sender.stdout) == {"shm": "found", "mq": "found"}
    assert json.loads(in_receiver.stdout) == {"shm": "ENOENT", "mq": "ENOENT"}


LISTEN = r"""
import os, socket, sys, time
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0karotte-link-test")
srv.listen(8)
if os.fork() == 0:  # a process of the same sandbox reaches the name
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect("\0karotte-link-test")
    os._exit(0)
srv.settimeout(1)
srv.accept()
os.wait()
srv.settimeout(float(sys.argv[1]))
try:
    srv.accept()
    print("reached from outside")
except socket.timeout:
    print("only from inside")
"""

CONNECT = r"""
import errno, socket
try:
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect("\0karotte-link-test")
    print("connected")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


def test_LINK_SIBLING_01_abstract_unix_sockets_are_private_to_a_sandbox(no_leaks):
    # Abstract UNIX names belong to the network namespace, which is the sandbox's own.
    with Sandbox() as listener, Sandbox() as caller:
        heard = {}
        thread = threading.Thread(target=lambda: heard.update(r=listener.exec(py(LISTEN) + ["4"])))
        thread.start()
        time.sleep(1.5)
        tried = caller.exec(py(CONNECT))
        from_host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            from_host.connect("\0karotte-link-test")
            host = "connected"
        except OSError as e:
            host = e.strerror
        finally:
            from_host.close()
        thread.join()
    assert heard["r"].stdout == b"only from inside\n", heard["r"].stderr
    assert tried.stdout == b"ECONNREFUSED\n"
    assert host == "Connection refused"


def test_LINK_CACHE_01_reads_through_a_read_only_bind_leave_atime_unchanged(no_leaks):
    # relatime updates atime when it is older than mtime; a read-only mount never does.
    top = tempfile.mkdtemp(prefix="karotte-test-atime-")
    try:
        os.chmod(top, 0o755)
        path = os.path.join(top, "file")
        Path(path).write_text("marked by reading\n")
        os.chmod(path, 0o644)
        st = os.stat(path)
        os.utime(path, ns=(st.st_mtime_ns - 10**12, st.st_mtime_ns))  # atime before mtime
        old = os.stat(path).st_atime_ns
        with Sandbox(SandboxSpec(binds=(Bind(top, "/data"),))) as sb:
            r = sb.exec(["/bin/cat", "/data/file"])
        assert r.stdout == b"marked by reading\n"
        assert os.stat(path).st_atime_ns == old
        Path(path).read_text()  # the host's own read, through its relatime mount
        if os.stat(path).st_atime_ns == old:
            pytest.skip(f"{top} is on a filesystem mounted noatime: atime cannot carry a "
                        f"mark here either way")
    finally:
        shutil.rmtree(top)


@pytest.mark.parametrize("method", ["nowait", "cachestat"])
def test_LINK_CACHE_01_probes_of_the_hosts_usr_fail_with_the_policys_errno(no_leaks, method):
    # The same probes against the host's own /usr, which every sandbox shares.
    with Sandbox() as receiver:
        got = bench.receive_marks(receiver, method, "/usr/bin/python3", list(range(8)))
    assert got["results"] == [{"nowait": "EOPNOTSUPP", "cachestat": "EPERM"}[method]] * 8


def test_the_benchmark_reports_every_channel_and_nothing_through_the_denied_probes(tmp_path):
    # A smoke run of scripts/bench_side_channels.py: no speed is asserted, only that each
    # channel reports, and that the denied probes decode no bit.
    if os.geteuid() != 0:
        pytest.skip("the benchmark's census of cold pages needs root (cachestat of /usr)")
    out = tmp_path / "channels.json"
    run = subprocess.run([sys.executable, bench.__file__, "--bits", "32", "--runs", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == set(bench.CHANNELS)
    denied = {name: (s["median_decoded_bits"], s["failures"], s["median_information_per_bit"])
              for name, s in summary.items() if name in ("rwf-nowait", "cachestat")}
    assert denied == {"rwf-nowait": (0, ["EOPNOTSUPP"], 0.0), "cachestat": (0, ["EPERM"], 0.0)}
