"""Attacks of docs/attacks.md that the sandbox layer alone must stop.

Each test plants the attack as the agent would (commands inside a real sandbox) and
asserts the entry's "must happen": the attack fails inside, the host is unaffected,
and nothing of the sandbox is left running.

Each attack that an agent can make on any root filesystem runs twice, through conftest's
`userland` fixture: on the host's userland and on a Debian image (an overlay root, whose
python3, shell and tools are the image's own). The few that stay on the host only say why.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import prctl
import psutil
import pytest
from pyroute2 import NetNS

from conftest import BPF_JIT_CALLS, FORK_BOMB, SMALL_LIMITS, SYSCALL_PROBE, _nr, py, sandbox_processes
from karotte import cgroups, hostdirs, native, userns
from karotte.errors import HostUnsupported
from karotte.protections import PROTECTIONS
from karotte.probe import userns_owner
from karotte.sandbox import DEFAULT_UID_BASE, Sandbox, ns_owner_ids
from karotte.spec import Bind, MiB, SandboxSpec


@pytest.fixture
def sandbox(userland, no_leaks):
    """conftest's sandbox, on each userland."""
    with Sandbox(SandboxSpec(image=userland)) as sb:
        yield sb


@pytest.fixture
def small_sandbox(userland, no_leaks):
    """conftest's small_sandbox, on each userland."""
    with Sandbox(SandboxSpec(image=userland, **SMALL_LIMITS)) as sb:
        yield sb


@pytest.mark.cgroup2
def test_on_the_image_the_attacks_run_the_images_own_programs(attack_tree, no_leaks):
    # The image half proves something only if its python3 and shell are the image's:
    # its root is the overlay, whose package database and Python packages are the tree's.
    with open(os.path.join(attack_tree, "var/lib/dpkg/status"), "rb") as f:
        status = f.read()
    with open("/var/lib/dpkg/status", "rb") as f:
        assert f.read() != status, "the host's packages must differ from the image's"
    with Sandbox(SandboxSpec(image=f"dir:{attack_tree}")) as sb:
        assert sb.exec(["cat", "/var/lib/dpkg/status"]).stdout == status
        r = sb.exec(py("import os, sys; print(sys.executable, os.listdir(os.path.dirname("
                       "os.__file__) + '/../python3/dist-packages'))"))
        exe, listing = r.stdout.decode().split(" ", 1)
        assert exe == "/usr/bin/python3", r.stderr
        assert sorted(eval(listing)) == sorted(
            os.listdir(os.path.join(attack_tree, "usr/lib/python3/dist-packages")))
        root = [line for line in sb.exec(["cat", "/proc/self/mountinfo"]).stdout.decode()
                .splitlines() if line.split()[4] == "/"]
        assert " - overlay " in root[0], root


def syscalls(sb: Sandbox, calls: list[tuple[str, int, list[int]]]) -> dict[str, str]:
    r = sb.exec(py(SYSCALL_PROBE) + [json.dumps(calls)])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def host_pids_of(sb: Sandbox) -> set[int]:
    return set(sb.cgroup.pids())


def assert_all_gone(pids: set[int]) -> None:
    survivors = [pid for pid in pids if psutil.pid_exists(pid)]
    assert survivors == [], f"survived the kill: {survivors}"


# --------------------------------------------------------------------------- RES


@pytest.mark.cgroup2
def test_RES_FORK_01_fork_bomb_hits_pids_max_and_kill_all_ends_it(small_sandbox):
    r = small_sandbox.exec(py(FORK_BOMB), timeout=20)
    code, kids = r.stdout.split()
    assert code == b"EAGAIN" and int(kids) < 64
    assert len(sandbox_processes()) <= 64 + 1  # the agent's 64 and init
    # the classic shell bomb, left running in the background
    small_sandbox.exec("bomb() { bomb | bomb & }; (bomb) >/dev/null 2>&1 &", timeout=5)
    time.sleep(0.5)
    pids = host_pids_of(small_sandbox)
    assert 0 < len(pids) <= 64
    small_sandbox.kill_all()
    assert not small_sandbox.cgroup.populated()
    assert_all_gone(pids)


def test_RES_FORK_01_other_sandboxes_are_unaffected_by_a_fork_bomb(userland, no_leaks):
    spec = SandboxSpec(image=userland, pids=32, timeout=10)
    with Sandbox(spec) as bomber, Sandbox(spec) as neighbour:
        bomber.exec("bomb() { bomb | bomb & }; (bomb) >/dev/null 2>&1 &", timeout=5)
        time.sleep(0.3)
        r = neighbour.exec(["sh", "-c", "for i in 1 2 3 4 5; do sleep 0.01 & done; wait; echo ok"])
        assert r.stdout == b"ok\n"


@pytest.mark.cgroup2
def test_RES_MEM_01_memory_bomb_is_oom_killed_inside_and_the_host_survives(small_sandbox):
    # Touch memory step by step: a single huge allocation may just fail with MemoryError.
    r = small_sandbox.exec(py("b = []\nwhile True: b.append(bytearray(16 << 20))"), timeout=20)
    assert r.signal == signal.SIGKILL and r.oom_killed
    assert r.peak_memory is None or r.peak_memory <= 128 * MiB
    r = small_sandbox.exec(py("import mmap; m = mmap.mmap(-1, 1 << 30); m.write(b'x' * (1 << 30))"),
                           timeout=20)
    assert r.signal == signal.SIGKILL and r.oom_killed
    assert small_sandbox.exec(["echo", "alive"]).stdout == b"alive\n"


@pytest.mark.cgroup2
def test_RES_MEM_01_tmpfs_and_shared_memory_count_against_the_memory_limit(userland,
                                                                           no_leaks):
    # /dev/shm alone would allow 256 MiB; memory.max of 96 MiB must stop it first.
    spec = SandboxSpec(image=userland, memory=96 * MiB, tmp_size=256 * MiB, timeout=20)
    with Sandbox(spec) as sb:
        sb.exec("dd if=/dev/zero of=/dev/shm/fill bs=1M count=200")
        size = int(sb.exec("stat -c %s /dev/shm/fill").stdout)
        assert 0 < size <= 96 * MiB


def test_RES_BPFJIT_01_the_agent_cannot_load_seccomp_or_socket_filters(sandbox):
    # Filters JIT-compiled into the host-wide budget would, once it is spent, stop every
    # new sandbox from loading its own filter. The same calls on the host are refused by
    # the kernel for their NULL program or fd -1, never with EPERM.
    calls = BPF_JIT_CALLS + [("bpf_prog_load", _nr("bpf"), [5, 0, 0])]
    res = syscalls(sandbox, calls)
    assert res == dict.fromkeys(res, "EPERM"), res
    host = subprocess.run([sys.executable, "-c", SYSCALL_PROBE, json.dumps(BPF_JIT_CALLS)],
                          capture_output=True, text=True, timeout=30, check=True)
    assert "EPERM" not in json.loads(host.stdout).values(), host.stdout
    # and the sandbox's own filter went in, so the next command still starts
    assert sandbox.exec(["grep", "^Seccomp_filters:", "/proc/self/status"]).stdout.split() == [
        b"Seccomp_filters:", b"1"]


def _cached_pages(path: str) -> tuple[int, int]:
    """(pages of path in the host's page cache, pages of path), by mmap and mincore(2)
    in this process (root owns the file, so mincore reports the truth)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(b & 1 for b in vec.raw), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


PAGE_CACHE_DROPPER = """
import mmap, os
fd = os.open('/data/blob', os.O_RDONLY)
for _ in range(20):
    os.pread(fd, 1 << 20, 0)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
m.madvise(21)  # MADV_PAGEOUT: reclaim the mapped pages now
print('dropped')
"""


def test_RES_PAGECACHE_01_the_agent_cannot_drop_the_hosts_cache_of_a_bound_file(userland,
                                                                                 no_leaks):
    # Read-only binds share the host's page cache: without the filter's no-op, DONTNEED
    # would evict the host's (and every sandbox's) cached /usr and make them read disk.
    # MADV_PAGEOUT succeeds but the kernel pages out only files the caller owns or may
    # write.
    shared = tempfile.mkdtemp(prefix="karotte-test-pagecache-")  # on disk, not tmpfs
    try:
        os.chmod(shared, 0o755)
        blob = os.path.join(shared, "blob")
        with open(blob, "wb") as f:
            f.write(os.urandom(4 * MiB))
            f.flush()
            os.fsync(f.fileno())  # clean pages: the kind DONTNEED can drop
        os.chmod(blob, 0o644)
        cached, pages = _cached_pages(blob)
        assert cached == pages
        with Sandbox(SandboxSpec(image=userland, binds=(Bind(shared, "/data"),))) as sb:
            r = sb.exec(py(PAGE_CACHE_DROPPER))
        assert (r.exit_code, r.stdout) == (0, b"dropped\n"), r.stderr
        assert _cached_pages(blob) == (pages, pages)
        # The measure sees an eviction: the same advice from the host drops the pages.
        fd = os.open(blob, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert _cached_pages(blob)[0] < pages // 2
    finally:
        shutil.rmtree(shared)


SOCKET_HOARD = r"""
import socket, sys
queued, keep = 0, []
if sys.argv[1] == "tcp":  # 48 loopback connections, each written full without reading
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)
    for _ in range(48):
        c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
        c.connect(srv.getsockname()); s, _ = srv.accept()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
        c.setblocking(False); keep += [c, s]
        while True:
            try:
                queued += c.send(b"x" * 65536)
            except OSError:
                break
else:  # 64 UDP sockets, each sent datagrams it never reads
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(64):
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30); r.bind(("127.0.0.1", 0))
        keep.append(r)
        for _ in range(200):
            tx.sendto(b"x" * 60000, r.getsockname())
    with open("/proc/self/net/udp") as f:  # rx_queue: the bytes each socket holds
        queued = sum(int(line.split()[4].split(":")[1], 16) for line in list(f)[1:])
print(queued >> 20)
"""


@pytest.mark.cgroup2
@pytest.mark.parametrize("kind", ["tcp", "udp"])
def test_RES_MEM_01_socket_buffers_count_against_the_memory_limit(userland, no_leaks, kind):
    # Kernel memory outside the cgroup's count is memory no limit bounds: cgroup v1
    # charged socket buffers to nobody (500 MiB queued from a 128 MiB sandbox, and a host
    # whose TCP memory is at its global cap stalls every connection, the trainer's too).
    with Sandbox(SandboxSpec(image=userland, memory=128 * MiB, timeout=30)) as sb:
        r = sb.exec(["python3", "-c", SOCKET_HOARD, kind])
        if not r.oom_killed:  # v2 counts them in memory.max: the hoarder may be killed
            assert r.exit_code == 0, r.stderr[-500:]
            assert int(r.stdout) < 160, f"{int(r.stdout)} MiB queued in {kind} sockets"


@pytest.mark.cgroup2
def test_FS_FILL_01_disk_fill_fails_inside_and_host_free_space_is_unchanged(small_sandbox):
    # The host's root and the file system where Karotte keeps its runtime files. The
    # tolerance is for the host's own writes meanwhile; a leak would be the 200 MiB below.
    host_fs = ("/", hostdirs.runtime_dir())
    free_before = [shutil.disk_usage(fs).free for fs in host_fs]
    r = small_sandbox.exec("dd if=/dev/zero of=/workspace/fill bs=1M count=200 2>&1; echo rc=$?")
    out = r.stdout.decode()
    assert "rc=0" not in out
    assert "No space left" in out or "File too large" in out
    r = small_sandbox.exec("fallocate -l 500G /workspace/huge 2>&1; echo rc=$?")
    assert b"rc=0" not in r.stdout
    r = small_sandbox.exec(py("""
import errno
try:
    with open('/tmp/sparse', 'wb') as f:
        f.seek(1 << 40); f.write(b'x')
except OSError as e:
    print(errno.errorcode[e.errno])
"""))
    assert r.stdout.strip() in (b"EFBIG", b"ENOSPC")
    r = small_sandbox.exec(py("""
import os, errno
n = 0
try:
    while True:
        open(f'/workspace/i{n}', 'w').close(); n += 1
except OSError as e:
    print(errno.errorcode[e.errno], n)
"""), timeout=30)
    code, n = r.stdout.split()
    assert code == b"ENOSPC" and int(n) < 4096  # the inode limit
    for fs, before in zip(host_fs, free_before):
        assert abs(shutil.disk_usage(fs).free - before) < 100 * MiB, fs


# --------------------------------------------------------------------------- PROC


@pytest.mark.cgroup2
@pytest.mark.parametrize("plant", [
    "( setsid bash -c 'exec -a \"[kworker/0:1]\" sh -c \"while :; do sleep 1; done\"' & ) "
    "</dev/null >/dev/null 2>&1",
    "python3 -c \"import os,time; os.fork() and os._exit(0); os.setsid(); "
    "os.fork() and os._exit(0); time.sleep(1e9)\" </dev/null >/dev/null 2>&1 &",
    "sh -c 'trap \"\" TERM HUP INT; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &",
    "sleep 1000 & kill -STOP $!",
], ids=["setsid", "double-fork", "ignores-sigterm", "stopped"])
def test_PROC_DAEMON_01_daemons_do_not_survive_kill_all(userland, no_leaks, plant):
    with Sandbox(SandboxSpec(image=userland)) as sb:
        r = sb.exec(["bash", "-c", plant], timeout=10)
        assert r.exit_code == 0, r.stderr
        time.sleep(0.2)
        pids = host_pids_of(sb) - {sb.init_pid}
        assert pids, "the daemon did not start"
        sb.kill_all()
        assert not sb.cgroup.populated()
        assert_all_gone(pids | {sb.init_pid})


def test_PROC_PTRACE_01_ptrace_process_vm_and_proc_mem_are_denied(sandbox):
    sandbox.exec("sleep 60 &")
    res = syscalls(sandbox, [
        ("ptrace_attach_init", 101, [16, 1, 0, 0]),  # PTRACE_ATTACH to pid 1
        ("ptrace_traceme", 101, [0, 0, 0, 0]),
        ("process_vm_readv", 310, [1, 0, 0, 0, 0, 0]),
        ("process_vm_writev", 311, [1, 0, 0, 0, 0, 0]),
    ])
    assert res == {k: "EPERM" for k in res}
    r = sandbox.exec(py("""
import errno, os
for p in ('/proc/1/mem', '/proc/1/environ', '/proc/1/root/', '/proc/1/exe', '/proc/1/fd/3'):
    try:
        os.open(p, os.O_RDONLY); print(p, 'OPEN')
    except OSError as e:
        print(p, errno.errorcode[e.errno])
"""))
    for line in r.stdout.decode().splitlines():
        assert not line.endswith("OPEN"), line


def test_PROC_LIMITS_01_agent_cannot_raise_limits_and_the_clock_is_held_outside(sandbox):
    r = sandbox.exec("ulimit -Hn 1000000 2>&1; echo rc=$?")
    assert b"rc=0" not in r.stdout
    r = sandbox.exec(py("""
import resource, errno
try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print('raised')
except (ValueError, OSError) as e:
    print('refused')
"""))
    assert r.stdout == b"refused\n"
    r = sandbox.exec("ls /sys/fs/cgroup 2>&1; echo max > /sys/fs/cgroup/pids.max 2>&1; echo rc=$?")
    assert b"rc=0" not in r.stdout
    t = time.monotonic()
    r = sandbox.exec("trap '' TERM INT HUP; sleep 30", timeout=0.5)
    assert r.timed_out and time.monotonic() - t < 5


# --------------------------------------------------------------------------- LEAK


def test_LEAK_PROC_01_proc_shows_only_the_sandbox_and_no_secrets(userland,
                                                                 no_leaks, monkeypatch):
    monkeypatch.setenv("KAROTTE_TEST_SECRET_TOKEN", "s3cr3t-value")
    with Sandbox(SandboxSpec(image=userland)) as sb:
        sb.exec("sleep 60 &")
        r = sb.exec(py("import os; print(sorted(int(p) for p in os.listdir('/proc') "
                       "if p.isdigit()))"))
        visible = json.loads(r.stdout)
        assert len(visible) == 3 and visible[0] == 1, visible  # init, the sleep, this python
        assert sb.exec(["cat", "/proc/1/cmdline"]).stdout == b"karotte-init\0"
        r = sb.exec("env; cat /proc/1/environ 2>&1; grep -r s3cr3t /proc/*/environ 2>/dev/null")
        assert b"s3cr3t" not in r.stdout and b"KAROTTE_TEST_SECRET" not in r.stdout


def test_LEAK_FS_01_host_files_outside_the_userland_are_invisible(userland,
                                                                  no_leaks, tmp_path):
    secret = tmp_path / "expected_answer.txt"
    secret.write_text("42")
    with Sandbox(SandboxSpec(image=userland)) as sb:
        r = sb.exec(["sh", "-c", "find / -xdev \\( -iname '*expected*' -o -iname '*answer*' "
                     "-o -iname 'solution*' \\) 2>/dev/null | grep -v ^/usr | head"])
        assert r.stdout == b""
        r = sb.exec(["sh", "-c", "ls /root /work /proc/1/root/ /proc/1/cwd/ 2>&1; "
                     "cat /proc/self/mountinfo"])
        assert str(tmp_path).encode() not in r.stdout
        assert b"/work/main" not in r.stdout
        assert b"pytest" not in r.stdout


@pytest.mark.cgroup2
def test_LEAK_NET_01_only_loopback_dns_fails_and_connect_is_unreachable_at_once(sandbox):
    r = sandbox.exec(py("""
import errno, socket, time
out = {}
t = time.monotonic()
for host in ('1.1.1.1', '172.17.0.1', '10.0.0.1'):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect((host, 80)); out[host] = 'connected'
    except OSError as e:
        out[host] = errno.errorcode.get(e.errno, str(e))
out['elapsed'] = time.monotonic() - t
try:
    socket.getaddrinfo('pypi.org', 443); out['dns'] = 'resolved'
except OSError:
    out['dns'] = 'failed'
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); c = socket.create_connection(s.getsockname())
out['loopback'] = 'ok'
print(out)
"""))
    out = eval(r.stdout)
    for host in ("1.1.1.1", "172.17.0.1", "10.0.0.1"):
        assert out[host] == "ENETUNREACH", out
    assert out["elapsed"] < 1 and out["dns"] == "failed" and out["loopback"] == "ok"
    with NetNS(f"/proc/{sandbox.init_pid}/ns/net") as ns:
        links = [link.get_attr("IFLA_IFNAME") for link in ns.get_links()]
    assert links == ["lo"]


# --------------------------------------------------------------------------- ESC


def test_ESC_TIOCSTI_01_terminal_injection_is_denied_on_pipes_and_on_a_pty(userland,
                                                                           no_leaks):
    probe = py("""
import errno, fcntl, termios
for name, cmd in (('TIOCSTI', termios.TIOCSTI), ('TIOCLINUX', 0x541C)):
    try:
        fcntl.ioctl(0, cmd, b'x'); print(name, 'OK')
    except OSError as e:
        print(name, errno.errorcode[e.errno])
""")
    with Sandbox(SandboxSpec(image=userland)) as sb:
        assert sb.exec(probe).stdout == b"TIOCSTI EPERM\nTIOCLINUX EPERM\n"
        term = sb.open_terminal(probe)
        try:
            out = b""
            try:
                while chunk := os.read(term.fd, 4096):  # EIO once the probe has exited
                    out += chunk
            except OSError:
                pass
            assert term.wait().exit_code == 0
            assert b"TIOCSTI EPERM" in out and b"TIOCLINUX EPERM" in out
        finally:
            term.close()


def test_ESC_PROCEXE_01_no_host_binary_is_reachable_through_proc_exe(sandbox):
    init_hash = hashlib.sha256(native.INIT_PATH.read_bytes()).hexdigest()
    r = sandbox.exec(["sh", "-c", "ls -l /proc/*/exe 2>&1; echo x >> /proc/1/exe; echo rc=$?"])
    out = r.stdout.decode()
    assert "karotte-init" not in out.split("rc=")[0].replace("/proc/1/exe", "")
    assert "rc=0" not in out
    assert hashlib.sha256(native.INIT_PATH.read_bytes()).hexdigest() == init_hash


def test_ESC_DOCKER_01_no_runtime_socket_and_no_route_to_one(sandbox):
    r = sandbox.exec(["sh", "-c", "ls -l /var/run/docker.sock /run/containerd/containerd.sock "
                     "/run/docker.sock 2>&1; echo rc=$?"])
    assert b"No such file" in r.stdout and b"rc=0" not in r.stdout


def test_ESC_IOURING_01_io_uring_is_denied(sandbox):
    res = syscalls(sandbox, [("io_uring_setup", 425, [8, 0]), ("io_uring_enter", 426, [0] * 6),
                             ("io_uring_register", 427, [0, 0, 0, 0])])
    assert set(res.values()) <= {"EPERM", "ENOSYS"}, res


def test_ESC_USERNS_01_nested_namespaces_cannot_be_created(sandbox):
    res = syscalls(sandbox, [
        ("unshare_user", 272, [0x10000000]),
        ("unshare_net", 272, [0x40000000]),
        ("unshare_mount", 272, [0x00020000]),
        ("clone_newuser", 56, [0x10000000 | 17, 0, 0, 0, 0]),
        ("clone3", 435, [0, 0]),
        ("setns", 308, [0, 0]),
    ])
    assert res.pop("clone3") == "ENOSYS"
    assert res == {k: "EPERM" for k in res}, res
    r = sandbox.exec("unshare -Ur id 2>&1; echo rc=$?")
    assert b"rc=0" not in r.stdout


def test_ESC_PERF_01_perf_event_open_is_denied(sandbox):
    assert syscalls(sandbox, [("perf_event_open", 298, [0, 0, -1, -1, 0])]) == {
        "perf_event_open": "EPERM"}


def test_ESC_UFFD_01_userfaultfd_is_denied(sandbox):
    assert syscalls(sandbox, [("userfaultfd", 323, [0])]) == {"userfaultfd": "EPERM"}


def test_FS_SPECIAL_01_no_device_nodes_or_mounts_can_be_made(sandbox):
    res = syscalls(sandbox, [("mount_tmpfs", 165, [0, 0, 0, 0, 0]),
                             ("fsopen", 430, [0, 0]), ("pivot_root", 155, [0, 0]),
                             ("chroot", 161, [0])])
    assert res == {k: "EPERM" for k in res}, res
    r = sandbox.exec("mknod /workspace/sda b 8 0 2>&1; mkfifo /workspace/ok && echo fifo-ok; "
                     "ls /dev/fuse 2>&1")
    assert b"Operation not permitted" in r.stdout
    assert b"No such file" in r.stdout


# --------------------------------------------------------------------------- host death


HOST_SCRIPT = """
import json, sys, time
from karotte.grading import private_dir
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec
boxes = [Sandbox(SandboxSpec(image=sys.argv[1])) for _ in range(3)]
for b in boxes:
    b.exec("sleep 1000 & (setsid sleep 1000 &)")
print(json.dumps({"inits": [b.init_pid for b in boxes], "dir": private_dir("hidden"),
                  "pids": [b.cgroup.pids() for b in boxes]}), flush=True)
time.sleep(1000)
"""


@pytest.mark.cgroup2
def test_sigkill_of_the_host_process_takes_its_sandboxes_down_and_gc_cleans_up(userland,
                                                                                 no_leaks):
    host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, userland], stdout=subprocess.PIPE)
    try:
        info = json.loads(host.stdout.readline())
    finally:
        host.kill()
        host.wait()
    host.stdout.close()
    pids = {pid for group in info["pids"] for pid in group} | set(info["inits"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) for p in pids), "sandbox processes outlived their host"
    stale = cgroups.find_stale()
    assert stale, "the crashed host's cgroups should be found as stale"
    r = subprocess.run([sys.executable, "-m", "karotte.cli.sandbox", "gc"], capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert b"removed cgroup" in r.stdout
    assert f"removed directory {info['dir']}".encode() in r.stdout
    assert cgroups.find_stale() == [] and not os.path.exists(info["dir"])


# --------------------------------------------------------------------------- host-wide pools


def test_kernel_aio_is_unavailable_so_the_host_pool_cannot_be_drained(sandbox):
    # fs.aio-max-nr is one counter for the whole host: one agent could take it all.
    res = syscalls(sandbox, [("io_setup", _nr("io_setup"), [1, 0]),
                             ("io_submit", _nr("io_submit"), [0, 0, 0]),
                             ("io_getevents", _nr("io_getevents"), [0, 0, 0, 0, 0])])
    assert res == {k: "ENOSYS" for k in res}, res


def test_ptys_are_capped_per_sandbox_so_one_cannot_take_every_pty_of_the_host(userland,
                                                                               no_leaks):
    # Without max= on its devpts, every sandbox draws on one host-wide pty pool.
    grab = py("import os\nfds = []\n"
              "try:\n    while len(fds) < 500: fds.append(os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY))\n"
              "except OSError as e:\n    print(len(fds), e.strerror)")
    spec = SandboxSpec(image=userland)
    with Sandbox(spec) as hog, Sandbox(spec) as neighbour:
        r = hog.exec(grab)
        got, why = r.stdout.decode().split(" ", 1)
        assert int(got) <= 64 and "No space" in why
        assert neighbour.exec(py("import os; os.openpty(); print('ok')")).stdout == b"ok\n"


def test_per_user_kernel_counts_are_capped_per_sandbox(sandbox):
    # inotify instances, message-queue bytes and queued signals are counted per user and,
    # on the host, against the user namespace's creator: one sandbox takes a small share.
    r = sandbox.exec(py("""
import ctypes, resource
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while libc.inotify_init1(0) >= 0 and n < 1000:
    n += 1
print(n, resource.getrlimit(resource.RLIMIT_MSGQUEUE)[1], resource.getrlimit(resource.RLIMIT_SIGPENDING)[1])
"""))
    instances, msgqueue, sigpending = map(int, r.stdout.split())
    assert instances <= 32 and msgqueue <= 64 * 1024 and sigpending <= 1024


HOLD_INOTIFY = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while n < 32 and libc.inotify_init1(0) >= 0:
    n += 1
print(n, flush=True)
time.sleep(600)
"""


def _cap_eff() -> int:
    status = open("/proc/thread-self/status").read()
    return int(status.split("CapEff:")[1].split()[0], 16)


@pytest.mark.skipif(os.geteuid() != 0, reason="an unprivileged trainer's sandboxes are owned by "
                    "its own uid, whose per-user counts they share (tests/test_unprivileged.py)")
def test_per_user_kernel_counts_of_sandboxes_are_not_charged_to_the_trainer(userland,
                                                                            no_leaks):
    # inotify instances are counted per user, at every level up to the user namespace's
    # owner on the host. Owned by the trainer's root, a few sandboxes at their own cap
    # (32) took every instance root had (fs.inotify.max_user_instances, 128 here), the
    # trainer's own included.
    libc = ctypes.CDLL(None, use_errno=True)
    host_limit = int(open("/proc/sys/fs/inotify/max_user_instances").read())
    count = host_limit // 32 + 2
    if count > 24:
        pytest.skip(f"fs.inotify.max_user_instances is {host_limit}: too many sandboxes "
                    "to fill it in a test")
    pdeathsig = prctl.get_pdeathsig()
    prctl.set_pdeathsig(signal.SIGWINCH)  # harmless if it fires: ignored by default
    prctl.cap_effective.net_admin = False  # a trainer that dropped a capability
    caps = _cap_eff()
    sandboxes = []
    try:
        sandboxes += [Sandbox(SandboxSpec(image=userland)) for _ in range(count)]
        owners = {userns_owner(sb.init_pid) for sb in sandboxes}
        assert len(owners) == count and all(o in ns_owner_ids() for o in owners)
        got = []
        for sb in sandboxes:
            r = sb.exec(["sh", "-c", f"/usr/bin/python3 -c '{HOLD_INOTIFY}' > /tmp/n & "
                         "while [ ! -s /tmp/n ]; do sleep 0.01; done; cat /tmp/n"])
            got.append(int(r.stdout))
        assert got == [32] * count  # each its own share, none starved by the others
        fd = libc.inotify_init1(os.O_CLOEXEC)  # and the trainer keeps its own
        assert fd >= 0, os.strerror(ctypes.get_errno())
        os.close(fd)
        # the spawning thread took other effective ids for the clone: all given back,
        # and its effective capabilities are the ones it had, not all it may have
        assert (os.geteuid(), os.getegid()) == (0, 0) and _cap_eff() == caps
        assert prctl.get_pdeathsig() == signal.SIGWINCH
    finally:
        prctl.set_pdeathsig(pdeathsig)
        prctl.cap_effective.net_admin = True
        for sb in sandboxes:
            sb.close()


# Host-only from here on: each of these is about the trainer's side (its id tables, its
# cgroup, its own process) and is decided before init exists, so no root filesystem is
# involved and an image adds nothing to test.
@pytest.mark.skipif(os.geteuid() != 0, reason="the host id range is used by root callers only")
@pytest.mark.parametrize("base, why", [(0xFFFF_0000, "leaves no room"), (1, "'daemon' with id 1")])
def test_a_host_id_range_that_overflows_or_holds_an_account_is_refused(no_leaks, monkeypatch, base,
                                                                     why):
    # Every sandbox's user namespace is owned by one of these ids, and the owner has
    # every capability over it: an account holding one could enter sandboxes.
    monkeypatch.setenv("KAROTTE_UID_BASE", str(base))
    with pytest.raises(HostUnsupported, match=why):
        Sandbox()


@pytest.mark.skipif(os.geteuid() != 0, reason="the host id range is used by root callers only")
@pytest.mark.parametrize("table, offset", [("subuid", 1), ("subgid", 3)])
def test_a_subordinate_id_range_that_overlaps_karottes_host_ids_is_refused(no_leaks, monkeypatch,
                                                                           tmp_path, table,
                                                                           offset):
    # A user whose /etc/subuid range covers the agent's host uid can run a container
    # process as that uid, which may then signal or trace the agent's processes (and
    # /etc/subgid, as the gid: the group the grader reads hidden data through).
    subids = tmp_path / table
    subids.write_text(f"alice:100000:65536\nmallory:{DEFAULT_UID_BASE + 500}:1000\n")
    monkeypatch.setattr(userns, "SUBID_TABLES", (str(tmp_path / "none"), str(subids)))
    monkeypatch.setenv("KAROTTE_UID_BASE", str(DEFAULT_UID_BASE + offset))  # not cached yet
    with pytest.raises(HostUnsupported, match=f"{table} gives 'mallory' the ids 0x700001f4-"):
        Sandbox()
    subids.write_text("alice:100000:65536\n")
    monkeypatch.setenv("KAROTTE_UID_BASE", str(DEFAULT_UID_BASE + offset + 1))
    with Sandbox() as sb:
        assert sb.exec(["true"]).exit_code == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the host id range is used by root callers only")
def test_a_group_inside_karottes_host_ids_is_refused(no_leaks, monkeypatch, tmp_path):
    # Its members would share the agent gid, through which the grader reads hidden data.
    group = tmp_path / "group"
    group.write_text(f"root:x:0:\nsandboxes:x:{DEFAULT_UID_BASE + 1000}:mallory\n")
    monkeypatch.setattr(userns, "ID_TABLES", ("/etc/passwd", str(group)))
    monkeypatch.setenv("KAROTTE_UID_BASE", str(DEFAULT_UID_BASE + 5))  # not cached yet
    with pytest.raises(HostUnsupported, match=f"{group} has 'sandboxes' with id") as e:
        Sandbox()
    # named as the lines of `karotte-sandbox check` that such a range takes away
    assert e.value.protections == ("separate-host-uid", "own-userns-owner")
    assert set(e.value.protections) <= set(PROTECTIONS)


def test_a_frozen_parent_cgroup_refuses_a_sandbox_instead_of_hanging_the_trainer(no_leaks):
    # On v1 the spawn runs in a thread that moves itself into the sandbox's cgroups: in a
    # frozen one it would stop at once, and the caller with it.
    limits = cgroups.CgroupLimits(memory=512 * MiB, pids=64, cpus=1.0)
    parent = cgroups.create(cgroups.leaf_name("frozen-parent"), limits)
    try:
        parent.freeze()
        started = time.monotonic()
        with pytest.raises(cgroups.CgroupError, match="frozen"):
            Sandbox(cgroup_parent=parent)
        assert time.monotonic() - started < 5
        parent.thaw()
        with Sandbox(cgroup_parent=parent) as sb:
            assert sb.exec(["echo", "ok"]).stdout == b"ok\n"
    finally:
        parent.thaw()
        parent.destroy()


def test_a_library_with_large_thread_local_storage_does_not_break_the_spawn(tmp_path):
    # glibc puts static TLS on each thread's stack: the spawn thread must have room.
    src = tmp_path / "tls.c"
    src.write_text("__thread char big[96 * 1024];\nchar *touch(void) { return big; }\n")
    lib = tmp_path / "libtls.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    code = ("from karotte.sandbox import Sandbox\n"
            "with Sandbox() as sb:\n    print(sb.exec(['echo', 'ok']).stdout.decode(), end='')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "LD_PRELOAD": str(lib)}, timeout=60)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
