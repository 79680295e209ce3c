"""SandboxSpec(agent_user="root"): commands run as uid 0 of the sandbox's own user namespace
holding only the file-ownership capabilities and CAP_KILL. What that root can do (chown,
write what the image's root owns), and everything it still cannot (mount, new namespaces,
limits, the clock, modules, the host, init, read-only binds, the cgroup's limits).
The argument: docs/image-sandbox.md, "Root inside"."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile

import psutil
import pytest

from conftest import FORK_BOMB, needs_sandbox, py, run_karotte_sandbox
from karotte import plan
from karotte import protocol as p
from karotte.sandbox import AGENT_UID, Sandbox
from karotte.spec import MiB, SandboxSpec, SpecError
from karotte.userns import identity

pytestmark = needs_sandbox()

# capabilities(7): CAP_CHOWN 0, CAP_DAC_OVERRIDE 1, CAP_FOWNER 3, CAP_FSETID 4, CAP_KILL 5,
# CAP_SETGID 6, CAP_SETUID 7; never DAC_READ_SEARCH 2, SETPCAP 8, NET_ADMIN 12, SYS_MODULE 16,
# SYS_PTRACE 19, SYS_ADMIN 21, SYS_RESOURCE 24, SYS_TIME 25, ...
ROOT_CAPS = sum(1 << cap for cap in (0, 1, 3, 4, 5, 6, 7))
CAP_SYS_ADMIN = 21
BUSYBOX = "/bin/busybox"
NOBODY = 65534
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = SandboxSpec(agent_user="root")


@pytest.fixture
def root_sandbox(no_leaks):
    with Sandbox(ROOT) as sb:
        yield sb


def status(sb: Sandbox) -> dict[str, str]:
    text = sb.exec(["cat", "/proc/self/status"]).stdout.decode()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


# A probe run inside with ctypes: each call's errno name, or OK.
PROBE = r"""
import ctypes, errno, fcntl, json, os, resource, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
def call(f, *args):
    ctypes.set_errno(0)
    return "OK" if f(*args) != -1 else errno.errorcode[ctypes.get_errno()]
def attempt(f):
    try:
        f()
        return "OK"
    except OSError as e:
        return errno.errorcode[e.errno]
out = {}
out["mount"] = call(libc.mount, b"none", b"/mnt", b"tmpfs", 0, None)
out["unshare"] = call(libc.unshare, 0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
above = (ctypes.c_uint64 * 2)(hard + 1, hard + 1)  # Python's setrlimit hides the errno
out["rlimit"] = call(libc.setrlimit, resource.RLIMIT_NOFILE, above)
out["clock"] = attempt(lambda: __import__("time").clock_settime(0, 0.0))
out["module"] = call(libc.syscall, 313, -1, b"", 0)  # finit_module
out["init_module"] = call(libc.syscall, 175, None, 0, b"")  # init_module
out["ptrace"] = call(libc.ptrace, 16, 1, None, None)  # PTRACE_ATTACH init
out["init_mem"] = attempt(lambda: os.open("/proc/1/mem", os.O_RDONLY))
out["write_usr"] = attempt(lambda: os.open("/usr/karotte-root", os.O_CREAT | os.O_WRONLY, 0o644))
s = socket.socket()
out["connect_host"] = attempt(lambda: s.connect(("127.0.0.1", int(sys.argv[1]))))
ifreq = struct.pack("16sH14x", b"lo", 0)  # SIOCSIFFLAGS: lo down
out["lo_down"] = attempt(lambda: fcntl.ioctl(s.fileno(), 0x8914, ifreq))
# CAP_SYS_ADMIN back: capset, and an ambient raise (PR_CAP_AMBIENT 47, RAISE 2)
hdr = struct.pack("II", 0x20080522, 0)
data = struct.pack("6I", (1 << 21) | 0xfb, (1 << 21) | 0xfb, 0, 0, 0, 0)
out["capset_sys_admin"] = call(libc.syscall, 126, hdr, data)
out["ambient_sys_admin"] = call(libc.prctl, 47, 2, 21, 0, 0)
print(json.dumps(out))
"""


def test_the_default_agent_config_is_todays_and_root_changes_only_the_ids_and_adds_caps():
    ident = identity()

    def records(spec: SandboxSpec) -> list[tuple[int, bytes]]:
        return list(p._records(plan.config_message(spec, ident), p._HEADER.size))

    agent = records(SandboxSpec())
    assert agent == records(SandboxSpec(agent_user="agent"))
    nested = int(ident.nested).to_bytes(4, "little")
    assert agent[0] == (p.T_IDS, AGENT_UID.to_bytes(4, "little") * 2 + nested)
    assert p.T_CAPS not in [tag for tag, _ in agent]
    root = records(ROOT)
    assert root[0] == (p.T_IDS, b"\0" * 8 + nested)
    assert root[1] == (p.T_CAPS, ROOT_CAPS.to_bytes(8, "little"))
    assert root[2:] == agent[1:]
    assert p.ROOT_CAPS == ROOT_CAPS


@pytest.mark.parametrize("bad", ["Root", "", "0", None, "nobody"])
def test_an_agent_user_other_than_agent_or_root_is_refused_naming_both(bad):
    with pytest.raises(SpecError, match=r"agent_user must be 'agent' or 'root'"):
        SandboxSpec(agent_user=bad)


def test_root_is_uid_0_with_exactly_the_seven_capabilities_no_new_privs_and_the_filter(
        root_sandbox):
    assert root_sandbox.exec(["id", "-u"]).stdout == b"0\n"
    assert root_sandbox.exec(["id", "-g"]).stdout == b"0\n"
    st = status(root_sandbox)
    for cap in ("CapEff", "CapPrm", "CapBnd"):
        assert int(st[cap], 16) == ROOT_CAPS, f"{cap} is {st[cap]}"
    assert int(st["CapInh"], 16) == 0 and int(st["CapAmb"], 16) == 0
    assert st["NoNewPrivs"].strip() == "1" and st["Seccomp"].strip() == "2"
    assert st["Seccomp_filters"].strip() == "1"
    # What a root exec gives (permitted = bounding set | inheritable) is the same set again,
    # two execs down; after a change to uid 1000 nothing is left, and no way back.
    again = root_sandbox.exec(["sh", "-c", "sh -c 'grep CapEff /proc/self/status'"])
    assert int(again.stdout.split()[1], 16) == ROOT_CAPS
    dropped = root_sandbox.exec(py(
        "import os; os.setresgid(1000, 1000, 1000); os.setresuid(1000, 1000, 1000)\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "try:\n    os.setuid(0)\nexcept PermissionError:\n    print('EPERM')"))
    assert dropped.stdout == b"0000000000000000\nEPERM\n"


def test_root_can_chown_and_chmod_files_of_the_workspace(root_sandbox):
    r = root_sandbox.exec("cd /workspace && echo x > f && chown 4242:4343 f && chmod 0600 f "
                          "&& chown 1000:1000 /workspace && stat -c '%u:%g %a' f /workspace")
    assert r.stdout == b"4242:4343 600\n1000:1000 755\n", r.stderr
    # DAC_OVERRIDE and FOWNER: another owner's 0600 file is root's to read, write and chmod
    r = root_sandbox.exec("cd /workspace && echo y >> f && cat f && chmod 0644 f && stat -c %a f")
    assert r.stdout == b"x\ny\n644\n", r.stderr


def test_root_cannot_mount_unshare_raise_limits_set_the_clock_load_modules_or_regain_caps(
        root_sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        r = root_sandbox.exec(py(PROBE) + [str(listener.getsockname()[1])])
    finally:
        listener.close()
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == {
        "mount": "EPERM", "unshare": "EPERM", "rlimit": "EPERM", "clock": "EPERM",
        "module": "EPERM", "init_module": "EPERM", "ptrace": "EPERM",
        "init_mem": "ENOENT",  # hidden: /proc shows init only to who may ptrace it
        "write_usr": "EROFS",
        "connect_host": "ECONNREFUSED",  # the sandbox's own loopback: nothing listens there
        "lo_down": "EPERM", "capset_sys_admin": "EPERM", "ambient_sys_admin": "EPERM"}


def test_ROOT_KILL_01_sigkill_and_sigstop_from_root_inside_do_not_reach_init(root_sandbox):
    init = psutil.Process(root_sandbox.init_pid)
    # CAP_KILL (and init's own uid) let kill(2) succeed; the kernel drops SIGKILL and
    # SIGSTOP sent to its PID namespace's init from inside, and init blocks the rest.
    r = root_sandbox.exec("kill -KILL 1; echo $?; kill -STOP 1; echo $?; kill -TERM 1; echo $?")
    assert r.stdout == b"0\n0\n0\n"
    assert init.is_running() and init.status() != psutil.STATUS_STOPPED
    assert root_sandbox.exec(["echo", "alive"]).stdout == b"alive\n"


@pytest.mark.cgroup2  # v2's memory.oom.group kills every task not at -1000: init, if raised
def test_ROOT_OOM_01_root_cannot_make_init_the_victim_of_its_own_oom(no_leaks):
    spec = SandboxSpec(agent_user="root", memory=96 * MiB, timeout=20)
    with Sandbox(spec) as sb:
        r = sb.exec("echo 1000 > /proc/1/oom_score_adj; ls /proc | grep -x 1; "
                    "grep -c . /proc/1/status")
        assert b"/proc/1/oom_score_adj: Directory nonexistent" in r.stderr, r.stderr
        assert r.stdout == b""
        if sb.cgroup is None:
            return
        r = sb.exec(py("b = []\nwhile True: b.append(bytearray(16 << 20))"))
        assert r.signal == signal.SIGKILL and r.oom_killed
        assert sb.exec(["echo", "alive"]).stdout == b"alive\n"


@pytest.mark.cgroup2
def test_root_is_held_by_the_pids_limit_and_the_memory_limit(no_leaks):
    with Sandbox(SandboxSpec(agent_user="root", pids=32, memory=96 * MiB, timeout=20)) as sb:
        r = sb.exec(py(FORK_BOMB))
        code, kids = r.stdout.split()
        assert code == b"EAGAIN" and int(kids) < 32
        if sb.cgroup is not None:
            r = sb.exec(py("b = []\nwhile True: b.append(bytearray(16 << 20))"))
            assert r.signal == signal.SIGKILL and r.oom_killed
            assert r.peak_memory is None or r.peak_memory <= 96 * MiB


def test_karotte_sandbox_exec_agent_user_root_runs_as_root_and_refuses_other_users():
    r = run_karotte_sandbox("exec", "--agent-user", "root", "--", "id", "-u")
    assert r.returncode == 0 and r.stdout == b"0\n", r.stderr
    assert run_karotte_sandbox("exec", "--", "id", "-u").stdout == b"1000\n"
    r = run_karotte_sandbox("exec", "--agent-user", "admin", "--", "true")
    assert r.returncode == 2 and b"invalid choice: 'admin' (choose from 'agent', 'root')" in r.stderr


# ------------------------------------------------------------------------------ on an image


def _busybox_tree() -> str:
    """A static busybox with its applets, a root-owned /etc with a 0600 file of root's and
    one of another uid's."""
    if not os.path.exists(BUSYBOX):
        pytest.skip(f"{BUSYBOX} is missing (apt-get install busybox-static)")
    tree = tempfile.mkdtemp(prefix="karotte-test-root-")
    os.chmod(tree, 0o755)
    for d in ("bin", "etc"):
        os.mkdir(os.path.join(tree, d), 0o755)
    shutil.copy(BUSYBOX, os.path.join(tree, "bin/busybox"))
    for applet in ("sh", "cat", "id", "stat", "chown", "chmod", "echo", "grep"):
        os.symlink("busybox", os.path.join(tree, "bin", applet))
    for name, owner in (("etc/shadow", 0), ("etc/other", 4242)):
        path = os.path.join(tree, name)
        with open(path, "w") as f:
            f.write("secret\n")
        os.chown(path, owner, owner)
        os.chmod(path, 0o600)
    return tree


def _digest(tree: str) -> str:
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(tree)):
        for n in sorted(dirs + files):
            path = os.path.join(d, n)
            st = os.lstat(path)
            h.update(f"{path} {st.st_mode} {st.st_uid} {st.st_gid}".encode())
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@pytest.mark.skipif(os.geteuid() != 0, reason="the tree's root-owned files are made as root")
def test_root_writes_and_chowns_the_images_root_owned_files_through_the_overlay_only(no_leaks):
    tree = _busybox_tree()
    try:
        before = _digest(tree)
        with Sandbox(SandboxSpec(image=f"dir:{tree}", agent_user="root")) as sb:
            r = sb.exec("chmod 0000 /etc/shadow && echo root >> /etc/shadow && cat /etc/shadow "
                        "&& echo dac >> /etc/other && cat /etc/other "
                        "&& chown 0:0 /etc/other && stat -c '%u %a' /etc/shadow /etc/other")
            assert r.stdout == b"secret\nroot\nsecret\ndac\n0 0\n0 600\n", r.stderr
        with Sandbox(SandboxSpec(image=f"dir:{tree}")) as sb:
            r = sb.exec("cat /etc/shadow; echo x >> /etc/other")
            assert b"Permission denied" in r.stderr and r.stdout == b""
        assert _digest(tree) == before
    finally:
        shutil.rmtree(tree)


# -------------------------------------------------------------------- an unprivileged caller


_AS_NOBODY = r"""
import json, sys
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec, MiB
from karotte.protections import NO_CGROUP
with Sandbox(SandboxSpec(agent_user="root", memory=96 * MiB, allow_degraded=NO_CGROUP)) as sb:
    run = lambda s: sb.exec(["/bin/sh", "-c", s]).stdout.decode()
    print(json.dumps({"id": run("id -u"), "map": run("cat /proc/self/uid_map").split(),
                      "caps": run("grep -E '^Cap(Eff|Prm|Bnd|Inh|Amb)' /proc/self/status").split(),
                      "dac": run("cd /workspace && echo x > f && chmod 0 f && echo y >> f && cat f"),
                      "unshare": run("unshare -U true 2>&1; echo $?").splitlines()[-1],
                      "mount": run("mount -t tmpfs x /mnt 2>/dev/null; echo $?"),
                      "usr": run("touch /usr/x 2>&1")}))
"""


def test_an_unprivileged_callers_root_is_root_of_its_own_nested_namespace_with_the_seven(
        no_leaks):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run as uid 65534")
    site = sysconfig.get_paths()["purelib"]
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "/usr/bin/python3", "-c", _AS_NOBODY],
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROJECT}:{site}"},
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["id"] == "0\n"
    assert out["map"] == ["0", "0", "1"]  # init's root, the caller, and nothing else
    caps = dict(zip(out["caps"][::2], out["caps"][1::2]))
    assert {k: int(v, 16) for k, v in caps.items()} == {
        "CapInh:": 0, "CapPrm:": ROOT_CAPS, "CapEff:": ROOT_CAPS, "CapBnd:": ROOT_CAPS,
        "CapAmb:": 0}
    assert out["dac"] == "x\ny\n"
    assert out["unshare"] == "1" and out["mount"] == "32\n"
    assert "Read-only file system" in out["usr"]
