"""The seccomp policy, loaded into the real kernel and probed.

tests/helpers/seccomp_exec.c loads a compiled filter the way karotte-init does
(no_new_privs, then seccomp(SECCOMP_SET_MODE_FILTER)) and execs tests/helpers/sysprobe.c,
which attempts one operation per probe name and prints the errno it got. Each probe is
also run without the filter, to show that the answer under the filter comes from the
filter and not from the host. The aarch64 program, which this machine cannot load, is
checked by a small classic-BPF interpreter instead.
"""
from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from karotte.errors import KarotteError
from karotte.seccomp import (
    ARCHES,
    DEFAULT_POLICY,
    REVIEWED_THROUGH,
    SYSCALL_NUMBERS,
    UNASSIGNED,
    Allow,
    ArgHasAnyBit,
    ArgIn,
    ArgNotIn,
    Deny,
    Policy,
    SeccompError,
    compile_policy,
)
from karotte.sandbox import Sandbox

from conftest import SYSCALL_PROBE, needs_sandbox, py

HELPERS = Path(__file__).resolve().parent / "helpers"
MACHINE = platform.machine()

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
AUDIT_ARCH_I386 = 0x40000003
KILL_PROCESS = 0x80000000
ALLOW = 0x7FFF0000
ERRNO_EPERM = 0x00050001
ERRNO_ENOSYS = 0x00050026
ERRNO_EOPNOTSUPP = 0x0005005F
NO_OP = 0x00050000  # SECCOMP_RET_ERRNO with errno 0: the call returns 0
BPF_MAXINSNS = 4096

needs_native_arch = pytest.mark.skipif(
    MACHINE not in ARCHES, reason=f"Karotte has no seccomp table for {MACHINE}")
x86_64_only = pytest.mark.skipif(MACHINE != "x86_64", reason="an x86_64 ABI property")


# --- Building and running the helpers -----------------------------------------------------

def _gcc(out: Path, source: Path, *extra: str) -> None:
    base = ["gcc", "-O2", "-Wall", "-Wextra", "-o", str(out), str(source), *extra]
    # Static when possible, so that the same probe also runs inside a sandbox's rootfs.
    static = subprocess.run([*base, "-static"], capture_output=True, text=True)
    if static.returncode == 0:
        return
    dynamic = subprocess.run(base, capture_output=True, text=True)
    if dynamic.returncode != 0:
        pytest.fail(f"gcc could not build {source.name}:\n{dynamic.stderr}")


@pytest.fixture(scope="session")
def helpers(tmp_path_factory) -> dict[str, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed; the seccomp tests build their C helpers with it "
                    "(apt-get install gcc libc6-dev)")
    if MACHINE not in ARCHES:
        pytest.skip(f"Karotte has no seccomp table for {MACHINE}")
    out = tmp_path_factory.mktemp("seccomp-helpers")
    _gcc(out / "seccomp_exec", HELPERS / "seccomp_exec.c")
    _gcc(out / "sysprobe", HELPERS / "sysprobe.c", "-pthread")
    return {"exec": out / "seccomp_exec", "probe": out / "sysprobe"}


@pytest.fixture(scope="session")
def filter_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("seccomp-filter") / "default.bpf"
    path.write_bytes(compile_policy())
    return path


def _parse(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines())


@pytest.fixture(scope="session")
def all_probes(helpers) -> list[str]:
    listing = subprocess.run([helpers["probe"], "--list"], capture_output=True, text=True,
                             check=True)
    return listing.stdout.split()


@pytest.fixture(scope="session")
def filtered(helpers, filter_path, all_probes) -> dict[str, str]:
    """Every probe's result under DEFAULT_POLICY."""
    run = subprocess.run([helpers["exec"], filter_path, helpers["probe"], *all_probes],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"probe under the filter failed ({run.returncode}):\n{run.stderr}"
    return _parse(run.stdout)


@pytest.fixture(scope="session")
def unfiltered(helpers, all_probes) -> dict[str, str]:
    """Every probe's result without any filter of ours."""
    run = subprocess.run([helpers["probe"], *all_probes], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return _parse(run.stdout)


def _skip_unless_present(results: dict[str, str], *names: str) -> None:
    for name in names:
        if results[name] == "UNSUPPORTED":
            pytest.skip(f"{name} does not exist on {MACHINE}")


# --- Attacks: each denied under the filter ------------------------------------------------

@pytest.mark.parametrize("probe", ["ioctl_tiocsti", "ioctl_tioclinux"])
def test_ESC_TIOCSTI_01_tiocsti_and_tioclinux_are_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


@pytest.mark.parametrize("probe", ["ioctl_tiocsti_hibits", "ioctl_tioclinux_hibits"])
def test_ESC_TIOCSTI_01_tiocsti_denied_even_with_high_bits_set(filtered, probe):
    # cmd = 0x1_0000_5412: the filter compares the low word only, as the kernel does.
    _skip_unless_present(filtered, probe)
    assert filtered[probe] == "EPERM"


def test_ESC_TIOCSTI_01_kernel_ignores_the_high_word_of_an_ioctl_cmd(filtered, unfiltered):
    # Why the compare must be on 32 bits: FIONREAD | 1 << 32 still works as FIONREAD, so
    # a filter that compared all 64 bits would let TIOCSTI | 1 << 32 through.
    _skip_unless_present(unfiltered, "ioctl_fionread_hibits")
    assert unfiltered["ioctl_fionread_hibits"] == "OK"
    assert filtered["ioctl_fionread_hibits"] == "OK"


@pytest.mark.parametrize("probe", ["io_uring_setup", "io_uring_enter", "io_uring_register"])
def test_ESC_IOURING_01_io_uring_is_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


@pytest.mark.parametrize("flag", ["newns", "newcgroup", "newuts", "newipc", "newuser",
                                  "newpid", "newnet", "newtime"])
def test_ESC_USERNS_01_clone_with_a_namespace_flag_is_denied(filtered, flag):
    assert filtered[f"clone_{flag}"] == "EPERM"


def test_ESC_USERNS_01_clone3_fails_with_enosys_so_callers_fall_back_to_clone(filtered):
    assert filtered["clone3"] == "ENOSYS"


@pytest.mark.parametrize("probe", ["unshare_user", "unshare_mount", "setns"])
def test_ESC_USERNS_01_unshare_and_setns_are_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


def test_ESC_PERF_01_perf_event_open_is_denied(filtered):
    assert filtered["perf_event_open"] == "EPERM"


def test_ESC_UFFD_01_userfaultfd_is_denied(filtered):
    assert filtered["userfaultfd"] == "EPERM"


@pytest.mark.parametrize("probe", ["ptrace", "process_vm_readv", "process_vm_writev",
                                   "pidfd_getfd", "kcmp"])
def test_PROC_PTRACE_01_access_to_other_processes_is_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


@pytest.mark.parametrize("probe", ["mount", "umount2", "pivot_root", "chroot", "fsopen",
                                   "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
                                   "mount_setattr", "open_tree_attr"])
def test_FS_SPECIAL_01_mounts_and_the_new_mount_api_are_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


@pytest.mark.parametrize("probe", ["bpf", "keyctl", "add_key", "request_key"])
def test_bpf_and_kernel_keyrings_are_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


@pytest.mark.parametrize("probe", ["socket_netlink", "socket_packet", "socket_alg",
                                   "socket_vsock", "socketpair_netlink"])
def test_socket_families_other_than_unix_inet_inet6_are_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


def test_socket_family_with_high_bits_set_is_judged_by_its_low_word(filtered, unfiltered):
    # The kernel reads the domain as an int: (1 << 32) | AF_NETLINK is AF_NETLINK to it.
    _skip_unless_present(filtered, "socket_netlink_hibits")
    assert unfiltered["socket_netlink_hibits"] == unfiltered["socket_netlink"]
    assert filtered["socket_netlink_hibits"] == "EPERM"


@pytest.mark.parametrize("probe", ["personality_bad", "personality_read_implies_exec"])
def test_personality_flags_that_weaken_aslr_or_nx_are_denied(filtered, probe):
    assert filtered[probe] == "EPERM"


# RES-BPFJIT-01: every way an agent could have the kernel JIT-compile a BPF program into
# the host-wide budget (net.core.bpf_jit_limit). Each probe loads one tiny program into
# its own short-lived child when allowed, so the unfiltered runs never strain the budget.
JIT_ROUTES = ["seccomp_filter", "seccomp_filter_listener", "prctl_seccomp_filter",
              "setsockopt_attach_filter", "setsockopt_attach_reuseport_cbpf"]


@pytest.mark.parametrize("probe", JIT_ROUTES + ["setsockopt_attach_bpf",
                                                "setsockopt_attach_reuseport_ebpf"])
def test_RES_BPFJIT_01_seccomp_and_socket_filters_cannot_be_loaded(filtered, probe):
    assert filtered[probe] == "EPERM"


def test_RES_BPFJIT_01_each_route_loads_a_program_when_no_filter_is_loaded(unfiltered):
    # What the rules stop: without the filter, each call succeeds, even unprivileged
    # (no_new_privs is all seccomp asks; attaching a socket filter asks nothing).
    assert {probe: unfiltered[probe] for probe in JIT_ROUTES} == dict.fromkeys(JIT_ROUTES, "OK")


@pytest.mark.parametrize("probe", ["seccomp_filter_hibits", "prctl_seccomp_filter_hibits",
                                   "setsockopt_attach_filter_hibits"])
def test_RES_BPFJIT_01_high_bits_do_not_hide_the_operation(filtered, unfiltered, probe):
    # seccomp's op, prctl's option and setsockopt's level and optname are 32-bit to the
    # kernel: with high bits set they still load a program, and the filter still denies.
    _skip_unless_present(filtered, probe)
    assert (unfiltered[probe], filtered[probe]) == ("OK", "EPERM")


@pytest.mark.parametrize("probe", ["seccomp_action_avail", "prctl_set_name",
                                   "setsockopt_lock_filter", "setsockopt_reuseaddr",
                                   "setsockopt_detach_filter"])
def test_RES_BPFJIT_01_calls_that_load_no_program_still_reach_the_kernel(
        filtered, unfiltered, probe):
    # SO_LOCK_FILTER only pins a filter already attached; detaching frees one (ENOENT
    # here: there is none). Neither needs to be denied.
    assert filtered[probe] == unfiltered[probe] != "EPERM"


@pytest.mark.parametrize("probe", ["fadvise_dontneed_badfd", "fadvise_dontneed_hibits_badfd"])
def test_RES_PAGECACHE_01_fadvise_dontneed_is_a_no_op_that_returns_0(filtered, unfiltered, probe):
    # On fd -1 the kernel says EBADF; under the filter the call never reaches it. The
    # page cache itself is checked in tests/test_sandbox_attacks.py.
    _skip_unless_present(filtered, probe)
    assert (unfiltered[probe], filtered[probe]) == ("EBADF", "OK")


@pytest.mark.parametrize("probe", ["fadvise_willneed_badfd", "fadvise_noreuse_badfd"])
def test_RES_PAGECACHE_01_other_advice_reaches_the_kernel(filtered, unfiltered, probe):
    assert filtered[probe] == unfiltered[probe] == "EBADF"


@x86_64_only
def test_x32_syscall_kills_the_process(filtered):
    assert filtered["x32_getpid"] == "killed:SIGSYS"


@x86_64_only
def test_i386_syscall_through_int80_kills_the_process(filtered, unfiltered):
    if unfiltered["i386_getpid"] != "OK":
        pytest.skip(f"this kernel has no i386 emulation (int 0x80 without a filter: "
                    f"{unfiltered['i386_getpid']})")
    assert filtered["i386_getpid"] == "killed:SIGSYS"


def _unconditional_denies():
    arch = MACHINE if MACHINE in ARCHES else "x86_64"
    for entry in DEFAULT_POLICY.entries:
        if isinstance(entry, Deny) and entry.when is None:
            for name in entry.syscalls:
                if SYSCALL_NUMBERS[name][arch] is not None:
                    yield pytest.param(name, entry.errno, id=name)


@pytest.mark.parametrize(("syscall", "errno_value"), list(_unconditional_denies()))
def test_every_unconditionally_denied_syscall_fails_with_its_entrys_errno(
        filtered, syscall, errno_value):
    # The probe named after the syscall calls it; a missing probe shows as UNKNOWN. Errno
    # 0 is a no-op that returns 0.
    assert filtered.get(syscall, "UNKNOWN") == errno.errorcode.get(errno_value, "OK")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _denied_by_host_settings() -> set[str]:
    """Probes that a hardened host answers with EPERM by itself, even for root."""
    denied = set()
    if _read("/proc/sys/kernel/io_uring_disabled") == "2":
        denied |= {"io_uring_setup"}
    if _read("/proc/sys/kernel/kexec_load_disabled") == "1":
        denied |= {"kexec_load", "kexec_file_load"}
    if _read("/proc/sys/kernel/modules_disabled") == "1":
        denied |= {"init_module", "finit_module", "delete_module"}
    if _read("/sys/kernel/security/lockdown") not in ("", "[none] integrity confidentiality"):
        denied |= {"kexec_load", "kexec_file_load", "iopl", "ioperm"}
    return denied


def test_denied_probes_reach_the_kernel_when_no_filter_is_loaded(filtered, unfiltered):
    # Shows that the errno under the filter comes from the filter: with the same
    # arguments and no filter, the kernel answers something else.
    status = Path("/proc/self/status").read_text()
    if not re.search(r"^Seccomp:\s+0$", status, re.M):
        pytest.skip("this test process already runs under a seccomp filter that may deny "
                    "the same calls")
    if os.geteuid() != 0:
        pytest.skip("as non-root the host itself answers EPERM to several of these probes")
    denied = {name for name, result in filtered.items() if result in ("EPERM", "ENOSYS")}
    # Where the kernel has no such call (a sys_ni_syscall slot of the table), both answer
    # ENOSYS; test_SYS_UNREVIEWED_01_a_policy_reviewed_for_an_older_kernel_denies_what_came_since
    # shows the filter's ENOSYS on calls that the kernel does have.
    same = {name: unfiltered[name] for name in denied - _denied_by_host_settings()
            if unfiltered[name] == filtered[name] != "ENOSYS"}
    assert same == {}, f"these probes give the same answer without the filter: {same}"


def test_RES_BPFJIT_01_the_agent_cannot_stack_a_filter_of_its_own(helpers, filter_path, tmp_path):
    # Not even one that allows everything (which could not loosen the policy anyway: the
    # kernel runs every stacked filter and takes the strictest answer).
    allow_all = tmp_path / "allow_all.bpf"
    allow_all.write_bytes(struct.pack("<HBBI", _RET_K, 0, 0, ALLOW))
    run = subprocess.run([helpers["exec"], filter_path, helpers["exec"], allow_all,
                          helpers["probe"], "getpid"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 125 and run.stdout == ""
    assert "seccomp(SECCOMP_SET_MODE_FILTER): Operation not permitted" in run.stderr


def test_filter_built_for_another_arch_fails_closed(helpers, tmp_path):
    other = next(arch for arch in ARCHES if arch != MACHINE)
    wrong = tmp_path / f"{other}.bpf"
    wrong.write_bytes(compile_policy(arch=other))
    run = subprocess.run([helpers["exec"], wrong, helpers["probe"], "getpid"],
                         capture_output=True, text=True, timeout=60)
    # The execve after the load is the first syscall judged, and it kills the process.
    assert run.returncode == -signal.SIGSYS
    assert run.stdout == ""


# --- What normal programs need still works ------------------------------------------------

@pytest.mark.parametrize("probe", ["getpid", "fork", "thread", "clone_plain",
                                   "socket_unix", "socket_inet", "socketpair_unix",
                                   "ioctl_fionread", "personality_query",
                                   "personality_linux"])
def test_harmless_calls_still_succeed(filtered, probe):
    assert filtered[probe] == "OK"


@pytest.mark.parametrize("probe", ["socket_inet6", "ioctl_tiocgwinsz"])
def test_harmless_calls_are_answered_by_the_kernel_not_the_filter(filtered, unfiltered, probe):
    # IPv6 may be disabled on a host and TIOCGWINSZ on a pipe is ENOTTY: whatever the
    # kernel says without the filter, it must also say with it.
    assert filtered[probe] == unfiltered[probe]
    assert filtered[probe] != "EPERM"


def test_python_with_threads_subprocesses_and_sockets_runs_under_the_filter(
        helpers, filter_path):
    script = (
        "import asyncio, socket, subprocess, sys, threading\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "assert subprocess.run([sys.executable, '-c', 'pass']).returncode == 0\n"
        "s = socket.socket(socket.AF_INET); s.bind(('127.0.0.1', 0)); s.listen(); s.close()\n"
        "a, b = socket.socketpair(); a.sendall(b'x'); assert b.recv(1) == b'x'\n"
        "assert socket.getaddrinfo('localhost', 80, flags=socket.AI_ADDRCONFIG)  # no netlink\n"
        "async def child():\n"
        "    p = await asyncio.create_subprocess_exec(sys.executable, '-c', 'pass')\n"
        "    return await p.wait()\n"
        "assert asyncio.run(child()) == 0\n"
        "print('ok')\n"
    )
    run = subprocess.run([helpers["exec"], filter_path, sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout.strip()) == (0, "ok"), run.stderr


# --- The compiled program -------------------------------------------------------------------

_LD_W_ABS, _JA, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x05, 0x15, 0x35, 0x45, 0x06
_SECCOMP_DATA_SIZE = 64


def _insns(program: bytes) -> list[tuple[int, int, int, int]]:
    assert len(program) % 8 == 0
    return [struct.unpack_from("<HBBI", program, off) for off in range(0, len(program), 8)]


def _check_structure(program: bytes) -> None:
    """What the kernel's seccomp_check_filter and bpf_check_classic would reject."""
    insns = _insns(program)
    assert 0 < len(insns) <= BPF_MAXINSNS
    for pc, (code, jt, jf, k) in enumerate(insns):
        if code == _LD_W_ABS:
            assert k % 4 == 0 and k + 4 <= _SECCOMP_DATA_SIZE, f"load at {pc}: offset {k}"
        elif code in (_JEQ_K, _JGE_K, _JSET_K):
            assert pc + 1 + max(jt, jf) < len(insns), f"jump at {pc} leaves the program"
        elif code == _JA:
            assert pc + 1 + k < len(insns), f"ja at {pc} leaves the program"
        else:
            assert code == _RET_K, f"unexpected opcode {code:#x} at {pc}"
    # Jumps only go forward, so ending in a return means every path returns.
    assert insns[-1][0] == _RET_K


def _run(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """The action the program returns for one syscall (a classic-BPF interpreter)."""
    padded = (list(args) + [0] * 6)[:6]
    data = struct.pack("<iIQ6Q", nr if nr < 2**31 else nr - 2**32, arch, 0, *padded)
    insns = _insns(program)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == _LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == _RET_K:
            return k
        elif code == _JA:
            pc += 1 + k
        else:
            taken = {_JEQ_K: acc == k, _JGE_K: acc >= k, _JSET_K: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("arch", ARCHES)
def test_program_is_well_formed_and_well_under_the_bpf_limit(arch):
    program = compile_policy(arch=arch)
    _check_structure(program)
    assert len(program) // 8 < 512


@pytest.mark.parametrize(("arch", "audit_arch"), [("x86_64", AUDIT_ARCH_X86_64),
                                                  ("aarch64", AUDIT_ARCH_AARCH64)])
def test_first_instructions_kill_any_other_arch(arch, audit_arch):
    first = _insns(compile_policy(arch=arch))[:3]
    assert first == [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, audit_arch), (_RET_K, 0, 0, KILL_PROCESS)]


def test_aarch64_program_uses_aarch64_numbers():
    program = compile_policy(arch="aarch64")
    a64 = AUDIT_ARCH_AARCH64
    assert _run(program, 172, a64) == ALLOW  # getpid
    assert _run(program, 117, a64) == ERRNO_EPERM  # ptrace
    assert _run(program, 101, a64) == ALLOW  # nanosleep: x86_64's ptrace number
    assert _run(program, 435, a64) == ERRNO_ENOSYS  # clone3
    assert _run(program, 220, a64, (0x10000000 | 17,)) == ERRNO_EPERM  # clone(NEWUSER)
    assert _run(program, 220, a64, (17,)) == ALLOW  # clone(SIGCHLD)
    assert _run(program, 29, a64, (0, 0x100005412)) == ERRNO_EPERM  # ioctl TIOCSTI, high bits
    assert _run(program, 29, a64, (0, 0x541B)) == ALLOW  # ioctl FIONREAD
    assert _run(program, 198, a64, (16,)) == ERRNO_EPERM  # socket(AF_NETLINK)
    assert _run(program, 198, a64, (2,)) == ALLOW  # socket(AF_INET)
    assert _run(program, 277, a64, (1,)) == ERRNO_EPERM  # seccomp(SET_MODE_FILTER)
    assert _run(program, 277, a64, (2,)) == ALLOW  # seccomp(GET_ACTION_AVAIL)
    assert _run(program, 167, a64, (22, 2)) == ERRNO_EPERM  # prctl(PR_SET_SECCOMP, FILTER)
    assert _run(program, 167, a64, (15, 2)) == ALLOW  # prctl(PR_SET_NAME)
    assert _run(program, 208, a64, (3, 1, 26)) == ERRNO_EPERM  # SO_ATTACH_FILTER
    assert _run(program, 208, a64, (3, 1, 2)) == ALLOW  # SO_REUSEADDR
    assert _run(program, 223, a64, (3, 0, 0, 4)) == NO_OP  # fadvise64_64(DONTNEED)
    assert _run(program, 223, a64, (3, 0, 0, 3)) == ALLOW  # fadvise64_64(WILLNEED)
    assert _run(program, 172, AUDIT_ARCH_X86_64) == KILL_PROCESS


def test_x86_64_program_kills_every_x32_number():
    program = compile_policy(arch="x86_64")
    x86 = AUDIT_ARCH_X86_64
    assert _run(program, 0x40000000 | 39, x86) == KILL_PROCESS
    assert _run(program, 0xFFFFFFFF, x86) == KILL_PROCESS
    assert _run(program, 39, x86) == ALLOW
    assert _run(program, 20, AUDIT_ARCH_I386) == KILL_PROCESS


def test_compile_defaults_to_this_machine():
    if MACHINE not in ARCHES:
        with pytest.raises(SeccompError, match=re.escape(MACHINE)):
            compile_policy()
    else:
        assert compile_policy() == compile_policy(DEFAULT_POLICY, arch=MACHINE)


def test_unsupported_arch_is_a_clear_error():
    with pytest.raises(SeccompError, match=r"'riscv64'.*x86_64, aarch64"):
        compile_policy(arch="riscv64")
    assert issubclass(SeccompError, KarotteError)


def test_syscall_missing_on_an_arch_is_skipped_there():
    policy = Policy(entries=(Deny("ioperm", reason="x86 port I/O"),
                             Allow("getppid", reason="a harmless query")))
    # aarch64 has no ioperm; its number on x86_64 (173) is getppid on aarch64.
    assert _run(compile_policy(policy, arch="aarch64"), 173, AUDIT_ARCH_AARCH64) == ALLOW
    assert _run(compile_policy(policy, arch="x86_64"), 173, AUDIT_ARCH_X86_64) == ERRNO_EPERM


# --- Policy validation ----------------------------------------------------------------------

def test_bogus_syscall_name_is_a_clear_error():
    with pytest.raises(SeccompError, match=r"unknown syscall 'frobnicate'.*_TABLE"):
        Policy(entries=(Deny("frobnicate", reason="no such thing"),))


def test_syscall_named_by_two_entries_is_rejected():
    with pytest.raises(SeccompError, match="more than one entry"):
        Policy(entries=(Deny("ptrace", reason="a"), Allow(("bpf", "ptrace"), reason="b")))


@pytest.mark.parametrize("kind", [Allow, Deny])
def test_entry_without_a_reason_is_rejected(kind):
    with pytest.raises(SeccompError, match="needs a reason"):
        kind("ptrace", reason=" ")


def test_compared_value_beyond_32_bits_is_rejected():
    # The filter sees only the low word; a 64-bit value could never match as written.
    with pytest.raises(SeccompError, match="0..0xffffffff"):
        ArgIn(1, (0x100005412,))


def test_largest_condition_still_compiles_with_in_range_jumps():
    values = tuple(range(0x5400, 0x5440))
    policy = Policy(entries=(Deny("ioctl", reason="many", when=ArgIn(1, values)),))
    program = compile_policy(policy, arch="x86_64")
    _check_structure(program)
    assert _run(program, 16, AUDIT_ARCH_X86_64, (0, values[0])) == ERRNO_EPERM
    assert _run(program, 16, AUDIT_ARCH_X86_64, (0, values[-1])) == ERRNO_EPERM
    assert _run(program, 16, AUDIT_ARCH_X86_64, (0, values[-1] + 1)) == ALLOW
    with pytest.raises(SeccompError, match="1..64"):
        ArgIn(1, values + (0x5440,))


def test_conditions_on_two_arguments_must_both_hold():
    # setsockopt(fd, level, optname): only SOL_SOCKET (1) with SO_ATTACH_FILTER (26).
    policy = Policy(entries=(Deny("setsockopt", reason="two arguments",
                                  when=(ArgIn(1, (1,)), ArgIn(2, (26, 51)))),))
    program = compile_policy(policy, arch="x86_64")
    _check_structure(program)
    x86 = AUDIT_ARCH_X86_64
    assert _run(program, 54, x86, (3, 1, 26)) == ERRNO_EPERM
    assert _run(program, 54, x86, (3, 1, 51)) == ERRNO_EPERM
    assert _run(program, 54, x86, (3, 1, 2)) == ALLOW  # right level, other option
    assert _run(program, 54, x86, (3, 0, 26)) == ALLOW  # option 26 of another level
    assert _run(program, 54, x86, (3, 1 | 1 << 32, 26 | 1 << 32)) == ERRNO_EPERM


def test_every_kind_of_condition_combines_with_the_others():
    # All three kinds in one rule, each one failing in turn.
    policy = Policy(entries=(Deny("clone", reason="combined", when=(
        ArgHasAnyBit(0, 0x10), ArgNotIn(1, (7, 8)), ArgIn(2, (5, 6)))),))
    program = compile_policy(policy, arch="x86_64")
    _check_structure(program)
    x86 = AUDIT_ARCH_X86_64
    assert _run(program, 56, x86, (0x10, 0, 6)) == ERRNO_EPERM
    assert _run(program, 56, x86, (0x01, 0, 6)) == ALLOW
    assert _run(program, 56, x86, (0x10, 8, 6)) == ALLOW
    assert _run(program, 56, x86, (0x10, 0, 4)) == ALLOW


def test_errno_0_makes_the_call_a_no_op_that_returns_0():
    policy = Policy(entries=(Deny("fadvise64", errno=0, reason="advice", when=ArgIn(3, (4,))),))
    program = compile_policy(policy, arch="x86_64")
    assert _run(program, 221, AUDIT_ARCH_X86_64, (3, 0, 0, 4)) == NO_OP
    assert _run(program, 221, AUDIT_ARCH_X86_64, (3, 0, 0, 3)) == ALLOW


def test_two_conditions_on_one_argument_are_rejected():
    with pytest.raises(SeccompError, match="two conditions on one argument"):
        Deny("ioctl", reason="x", when=(ArgIn(1, (1,)), ArgNotIn(1, (2,))))
    with pytest.raises(SeccompError, match="non-empty tuple"):
        Deny("ioctl", reason="x", when=())


def test_a_deny_compares_at_most_64_values_over_all_its_conditions():
    with pytest.raises(SeccompError, match="compares 65 values"):
        Deny("ioctl", reason="x", when=(ArgIn(0, (1,)), ArgIn(1, tuple(range(64)))))


def test_default_policy_denies_every_syscall_the_issue_requires():
    named = {name for entry in DEFAULT_POLICY.entries if isinstance(entry, Deny)
             for name in entry.syscalls}
    required = {
        "ptrace", "process_vm_readv", "process_vm_writev", "perf_event_open", "bpf",
        "userfaultfd", "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
        "io_uring_register", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig",
        "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr", "open_tree_attr",
        "unshare", "setns", "kexec_load", "kexec_file_load", "init_module", "finit_module",
        "delete_module", "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl",
        "quotactl_fd", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "vhangup",
        "nfsservctl", "iopl", "ioperm", "clock_settime", "settimeofday", "adjtimex",
        "clock_adjtime", "fanotify_init", "clone3", "clone", "ioctl", "socket", "socketpair",
        "personality", "seccomp", "prctl", "setsockopt", "fadvise64", "memfd_secret",
        "process_madvise", "process_mrelease", "cachestat", "preadv2", "pwritev2", "ustat",
    }
    assert required <= named, sorted(required - named)


def _doc_verdict(entry) -> str:
    if isinstance(entry, Allow):
        return "allowed"
    if entry.errno == errno.EOPNOTSUPP:  # one number on Linux; Python calls it ENOTSUP
        return "EOPNOTSUPP"
    return errno.errorcode[entry.errno] if entry.errno else "returns 0"


def test_docs_list_every_entry_of_the_default_policy():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "seccomp.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    for entry in DEFAULT_POLICY.entries:
        names = [f"`{name}`" for name in entry.syscalls]
        matching = [row for row in rows if row.split("|")[1].split(",")[0].strip() == names[0]]
        assert len(matching) == 1, f"docs/seccomp.md has no single table row for {names[0]}"
        cells = matching[0].split("|")
        assert [n.strip() for n in cells[1].split("(")[0].split(",")] == names
        assert cells[2].strip() == _doc_verdict(entry), names[0]


# --- The syscall table ----------------------------------------------------------------------

def _header_numbers(path: str) -> dict[str, int]:
    text = Path(path).read_text()
    numbers = {m[1]: int(m[2])
               for m in re.finditer(r"^#define __NR_(\w+)\s+(\d+)\s*$", text, re.M)}
    # asm-generic names some calls through an alias: __NR_fadvise64 __NR3264_fadvise64.
    aliases = {m[1]: int(m[2])
               for m in re.finditer(r"^#define (__NR3264_\w+)\s+(\d+)\s*$", text, re.M)}
    for m in re.finditer(r"^#define __NR_(\w+)\s+(__NR3264_\w+)\s*$", text, re.M):
        if m[2] in aliases:
            numbers.setdefault(m[1], aliases[m[2]])
    return numbers


@pytest.mark.parametrize(("arch", "header"), [
    ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    ("aarch64", "/usr/include/asm-generic/unistd.h"),
])
def test_syscall_table_matches_the_kernel_headers(arch, header):
    if not Path(header).exists():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    numbers = _header_numbers(header)
    wrong = {}
    for name, per_arch in SYSCALL_NUMBERS.items():
        ours = per_arch[arch]
        if ours is None:
            if name in numbers:
                wrong[name] = (None, numbers[name])
        elif name in numbers and numbers[name] != ours:
            wrong[name] = (ours, numbers[name])
        # A name newer than the installed headers (open_tree_attr before 6.15) is not
        # checkable here.
    assert wrong == {}, f"(ours, header's) for {arch}: {wrong}"


# --- SYS-UNREVIEWED-01: every number is decided; newer ones get ENOSYS ---------------------

HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
           "aarch64": "/usr/include/asm-generic/unistd.h"}


def _unassigned(arch: str, nr: int) -> bool:
    return any(first <= nr <= last for first, last in UNASSIGNED[arch])


def _undecided(arch: str, numbers) -> list[str]:
    """The numbers among ``numbers`` that DEFAULT_POLICY does not decide on ``arch``."""
    by_number = {per_arch[arch]: name for name, per_arch in SYSCALL_NUMBERS.items()
                 if per_arch[arch] is not None}
    missing = []
    for nr in sorted(set(numbers)):
        name = by_number.get(nr)
        if nr > REVIEWED_THROUGH:
            missing.append(f"{nr}: above REVIEWED_THROUGH ({REVIEWED_THROUGH}); review it")
        elif name is None and not _unassigned(arch, nr):
            missing.append(f"{nr}: in no _TABLE entry and no UNASSIGNED range")
        elif name is not None and _unassigned(arch, nr):
            missing.append(f"{nr} ({name}): in _TABLE and in an UNASSIGNED range")
        elif name is not None and DEFAULT_POLICY.verdict(name) is None:
            missing.append(f"{nr} ({name}): no entry of DEFAULT_POLICY decides it")
    return missing


@pytest.mark.parametrize("arch", ARCHES)
def test_SYS_UNREVIEWED_01_every_number_of_the_table_is_decided(arch):
    numbers = [per_arch[arch] for per_arch in SYSCALL_NUMBERS.values()
               if per_arch[arch] is not None]
    assert max(numbers) == REVIEWED_THROUGH
    assert _undecided(arch, range(REVIEWED_THROUGH + 1)) == []


@pytest.mark.parametrize("arch", ARCHES)
def test_SYS_UNREVIEWED_01_every_number_of_the_kernel_headers_is_decided(arch):
    if not Path(HEADERS[arch]).exists():
        pytest.skip(f"{HEADERS[arch]} is not installed (linux-libc-dev)")
    numbers = _header_numbers(HEADERS[arch])
    numbers.pop("syscalls", None)  # asm-generic's __NR_syscalls is a count, not a call
    assert _undecided(arch, numbers.values()) == []


def test_SYS_UNREVIEWED_01_every_name_of_the_x86_64_header_is_in_the_table():
    # By name as well as by number: a call renamed in the headers shows up here.
    if not Path(HEADERS["x86_64"]).exists():
        pytest.skip(f"{HEADERS['x86_64']} is not installed (linux-libc-dev)")
    names = _header_numbers(HEADERS["x86_64"])
    assert sorted(set(names) - set(SYSCALL_NUMBERS)) == []


@pytest.mark.parametrize(("arch", "audit_arch"), [("x86_64", AUDIT_ARCH_X86_64),
                                                  ("aarch64", AUDIT_ARCH_AARCH64)])
def test_SYS_UNREVIEWED_01_numbers_above_the_review_and_unassigned_ones_get_enosys(
        arch, audit_arch):
    program = compile_policy(arch=arch)
    above = [REVIEWED_THROUGH + 1, 511, 512, 547, 548, 1023, 0x3FFFFFFF]
    unassigned = [nr for first, last in UNASSIGNED[arch] for nr in range(first, last + 1)]
    assert {nr: _run(program, nr, audit_arch) for nr in above + unassigned} == \
        dict.fromkeys(above + unassigned, ERRNO_ENOSYS)
    # and one compare decides the numbers above: nr is loaded, then the x32 guard, then it.
    insns = _insns(program)
    at = 4 + (2 if arch == "x86_64" else 0)
    assert insns[at:at + 2] == [(_JGE_K, 0, 1, REVIEWED_THROUGH + 1), (_RET_K, 0, 0, ERRNO_ENOSYS)]


def test_SYS_UNREVIEWED_01_each_number_gets_its_entrys_verdict():
    # The compiled search over numbers against the table, number by number.
    program = compile_policy(arch="x86_64")
    wrong = {}
    for name, per_arch in SYSCALL_NUMBERS.items():
        entry = DEFAULT_POLICY.verdict(name)
        if isinstance(entry, Deny) and entry.when is not None:
            continue  # decided by its arguments; the tests above cover each
        want = ALLOW if isinstance(entry, Allow) else 0x00050000 | entry.errno
        got = _run(program, per_arch["x86_64"], AUDIT_ARCH_X86_64, (0, 0, 0, 0, 0, 0))
        if got != want:
            wrong[name] = (hex(got), hex(want))
    assert wrong == {}


def test_SYS_UNREVIEWED_01_a_syscall_no_entry_names_gets_enosys():
    policy = Policy(entries=(Allow("getpid", reason="a harmless query"),))
    program = compile_policy(policy, arch="x86_64")
    assert _run(program, 39, AUDIT_ARCH_X86_64) == ALLOW
    assert _run(program, 110, AUDIT_ARCH_X86_64) == ERRNO_ENOSYS  # getppid, undecided


def test_SYS_UNREVIEWED_01_an_entry_above_the_review_is_rejected():
    with pytest.raises(SeccompError, match=r"mseal is numbered 462, above the policy's "
                                           r"reviewed_through 450"):
        Policy(entries=(Allow("mseal", reason="x"),), reviewed_through=450)


def test_SYS_UNREVIEWED_01_the_search_jumps_over_a_long_half_with_ja():
    # Alternating verdicts over all 470 numbers: the left half of the first compare is
    # longer than an 8-bit jump, and every number still gets its own verdict.
    names = [name for name, per_arch in SYSCALL_NUMBERS.items() if per_arch["x86_64"] % 2 == 0]
    policy = Policy(entries=(Allow(tuple(names), reason="even numbers"),))
    program = compile_policy(policy, arch="x86_64")
    _check_structure(program)
    assert _JA in {code for code, *_ in _insns(program)}
    by_number = {per_arch["x86_64"]: name for name, per_arch in SYSCALL_NUMBERS.items()}
    for nr in range(REVIEWED_THROUGH + 1):
        want = ALLOW if nr in by_number and nr % 2 == 0 else ERRNO_ENOSYS
        assert _run(program, nr, AUDIT_ARCH_X86_64) == want, nr


def _as_reviewed_through(policy: Policy, last: int) -> Policy:
    """``policy`` as if it had been reviewed only up to syscall number ``last``."""
    entries = []
    for entry in policy.entries:
        names = tuple(name for name in entry.syscalls
                      if all(nr is None or nr <= last for nr in SYSCALL_NUMBERS[name].values()))
        if names and isinstance(entry, Allow):
            entries.append(Allow(names, entry.reason))
        elif names:
            entries.append(Deny(names, entry.reason, entry.errno, entry.when))
    return Policy(entries=tuple(entries), reviewed_through=last)


# Calls newer than Debian 12's 6.1 headers, with arguments the kernel refuses when it has
# the call (a bad fd, NULL, a missing path), so that nothing happens either way.
NEWER_THAN_6_1 = [
    ("cachestat", [-1, 0, 0, 0]),
    ("fchmodat2", [-100, 0, 0, 0]),  # AT_FDCWD, NULL path
    ("futex_wake", [0, 1, 0, 0x82]),  # NULL, FUTEX2_SIZE_U32 | FUTEX2_PRIVATE
    ("statmount", [0, 0, 0, 0]),
    ("listmount", [0, 0, 0, 0]),
    ("lsm_list_modules", [0, 0, 0]),
    ("getxattrat", [-1, 0, 0, 0, 0, 0]),
    ("file_getattr", [-1, 0, 0, 0, 0]),
]


@x86_64_only
def test_SYS_UNREVIEWED_01_a_policy_reviewed_for_an_older_kernel_denies_what_came_since(
        helpers, tmp_path):
    # The issue's case: a policy written for Linux 6.1 (last number 450) on this newer
    # kernel. Every call added since gets ENOSYS from the filter, though the kernel has it.
    old = tmp_path / "reviewed-for-6.1.bpf"
    old.write_bytes(compile_policy(_as_reviewed_through(DEFAULT_POLICY, 450)))
    calls = json.dumps([(name, SYSCALL_NUMBERS[name]["x86_64"], args)
                        for name, args in NEWER_THAN_6_1])
    bare = subprocess.run([sys.executable, "-I", "-c", SYSCALL_PROBE, calls],
                          capture_output=True, text=True, timeout=60, check=True)
    kernel = json.loads(bare.stdout)
    if "ENOSYS" in kernel.values():
        pytest.skip(f"this kernel lacks some of the calls since 6.1: {kernel}")
    filtered = subprocess.run([helpers["exec"], old, sys.executable, "-I", "-c", SYSCALL_PROBE,
                               calls], capture_output=True, text=True, timeout=60)
    assert filtered.returncode == 0, filtered.stderr
    assert json.loads(filtered.stdout) == dict.fromkeys(kernel, "ENOSYS")


def _probe_in_sandbox(calls: list[tuple[str, int, list[int]]]) -> dict[str, str]:
    with Sandbox() as sb:
        r = sb.exec(py(SYSCALL_PROBE) + [json.dumps(calls)])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


@x86_64_only
@needs_sandbox()
def test_SYS_UNREVIEWED_01_numbers_above_the_review_get_enosys_in_a_sandbox(no_leaks):
    numbers = [337, 380, 423, REVIEWED_THROUGH + 1, 500, 512, 547, 548, 1000]
    got = _probe_in_sandbox([(str(nr), nr, [-1, 0, 0, 0, 0, 0]) for nr in numbers])
    assert got == {str(nr): "ENOSYS" for nr in numbers}


# Each call this review denied, the errno it gets, and arguments the kernel refuses when
# the call runs (fd -1, invalid flags), so that the kernel's own answer differs.
NEWLY_DENIED = [
    ("memfd_secret", "ENOSYS", [0xFFFFFFFF]),  # no such flags: EINVAL
    ("process_madvise", "EPERM", [-1, 0, 0, 0, 0]),
    ("process_mrelease", "EPERM", [-1, 0]),
    ("fanotify_mark", "EPERM", [-1, 0, 0, -100, 0]),
    ("sysfs", "EPERM", [99, 0, 0]),  # no such option: EINVAL
    ("create_module", "ENOSYS", [0, 0]),
    ("security", "ENOSYS", [0, 0, 0]),
    ("vserver", "ENOSYS", [0, 0, 0]),
]


def _newly_denied_params():
    arch = MACHINE if MACHINE in ARCHES else "x86_64"
    for name, policy_errno, args in NEWLY_DENIED:
        marks = [] if SYSCALL_NUMBERS[name][arch] is not None else [
            pytest.mark.skip(reason=f"{name} does not exist on {MACHINE}")]
        yield pytest.param(name, args, policy_errno, id=name, marks=marks)


@needs_sandbox()
@pytest.mark.parametrize(("name", "args", "policy_errno"), list(_newly_denied_params()))
def test_SYS_UNREVIEWED_01_a_newly_denied_call_is_denied_in_a_sandbox(
        no_leaks, name, args, policy_errno):
    call = [(name, SYSCALL_NUMBERS[name][MACHINE], args)]
    bare = subprocess.run([sys.executable, "-I", "-c", SYSCALL_PROBE, json.dumps(call)],
                          capture_output=True, text=True, timeout=60, check=True)
    kernel = json.loads(bare.stdout)[name]
    assert _probe_in_sandbox(call) == {name: policy_errno}
    # The kernel without the filter says something else, except where it has no such
    # call either (a sys_ni_syscall slot: both ENOSYS).
    assert kernel != policy_errno or kernel == "ENOSYS"


# RES-HUGETLB-01: each way to take the host's reserved huge pages, and the same call
# without the huge-page flag, with arguments the kernel refuses (or grants harmlessly)
# when the call reaches it: a NULL name, a segment of size 0.
MB2 = 2 * 1024 * 1024
HUGETLB_CALLS = [
    ("mmap_hugetlb", "mmap", [0, MB2, 3, 0x22 | 0x40000, -1, 0]),  # PRIVATE|ANONYMOUS|HUGETLB
    ("mmap_plain", "mmap", [0, MB2, 3, 0x22, -1, 0]),
    ("memfd_create_hugetlb", "memfd_create", [0, 4]),  # MFD_HUGETLB
    ("memfd_create_plain", "memfd_create", [0, 0]),
    ("shmget_hugetlb", "shmget", [0, 0, 0o1000 | 0o4000 | 0o600]),  # IPC_CREAT|SHM_HUGETLB
    ("shmget_plain", "shmget", [0, 0, 0o1000 | 0o600]),
]


@needs_sandbox()
def test_RES_HUGETLB_01_the_hosts_huge_pages_cannot_be_asked_for_and_normal_pages_can(no_leaks):
    calls = [(label, SYSCALL_NUMBERS[name][MACHINE], args) for label, name, args in HUGETLB_CALLS]
    bare = subprocess.run([sys.executable, "-I", "-c", SYSCALL_PROBE, json.dumps(calls)],
                          capture_output=True, text=True, timeout=60, check=True)
    kernel = json.loads(bare.stdout)
    inside = _probe_in_sandbox(calls)
    for label in ("mmap_hugetlb", "memfd_create_hugetlb", "shmget_hugetlb"):
        assert inside[label] == "EPERM", (label, inside[label])
        assert kernel[label] != "EPERM", f"{label}: the kernel itself says EPERM here"
    for label in ("mmap_plain", "memfd_create_plain", "shmget_plain"):
        assert inside[label] == kernel[label] != "EPERM", (label, inside[label], kernel[label])


def _dirty_pages(path: str) -> int:
    """nr_dirty of cachestat(2) over the whole file, from the host."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    cstat = (ctypes.c_uint64 * 5)()  # cache, dirty, writeback, evicted, recently_evicted
    rng = (ctypes.c_uint64 * 2)(0, 0)  # off 0, len 0: to the end of the file
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(SYSCALL_NUMBERS["cachestat"][MACHINE], fd, rng, cstat, 0) != 0:
            raise OSError(ctypes.get_errno(), "cachestat")
    finally:
        os.close(fd)
    return cstat[1]


@needs_sandbox()
def test_RES_SYNC_01_sync_and_syncfs_in_a_sandbox_leave_the_hosts_dirty_data_alone(
        no_leaks, tmp_path):
    if os.statvfs(str(tmp_path)).f_fsid == os.statvfs("/dev/shm").f_fsid:
        pytest.skip("the test directory is on a tmpfs, whose pages sync never writes")
    path = tmp_path / "unwritten"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * 16)  # 16 MiB the kernel writes back in 30 s, or on sync
    try:
        before = _dirty_pages(str(path))
    except OSError as exc:
        pytest.skip(f"this kernel has no cachestat to count dirty pages: {exc}")
    assert before > 1000, "the host wrote the file back at once; nothing to measure"
    with Sandbox() as sb:
        r = sb.exec(py("import os; os.sync(); "
                       "fd = os.open('/usr/bin', os.O_RDONLY); "
                       "import ctypes; print(ctypes.CDLL(None).syncfs(fd))"))
    assert r.exit_code == 0 and r.stdout.strip() == b"0", r.stderr
    assert _dirty_pages(str(path)) > before // 2  # without the no-op: 0, flushed by the agent
