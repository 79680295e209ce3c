"""The sandbox's seccomp policy, and its compiler to classic BPF.

``DEFAULT_POLICY`` is the list of what an agent may not ask the kernel for, each rule
with the errno it gets and the attack it stops. ``compile_policy`` turns a policy into
the bytes of a ``struct sock_filter[]`` that karotte-init loads with
``seccomp(SECCOMP_SET_MODE_FILTER, 0, &prog)`` after ``PR_SET_NO_NEW_PRIVS``, right
before it execs the agent's command.

Every compiled filter starts with the same guard, which is not a rule because nothing
else is sound without it: a syscall made through another ABI than the native one
(``int 0x80`` into the i386 table on x86_64, or the x32 table) carries other syscall
numbers, so the filter kills the process for a foreign ``seccomp_data.arch`` and, on
x86_64, for any number with the x32 bit (0x40000000). After the rules, everything is
allowed: this is a deny list of kernel attack surface, not an allow list of programs.
"""
from __future__ import annotations

import platform
import struct
from dataclasses import dataclass
from errno import ENOSYS, EPERM
from types import MappingProxyType

from karotte.errors import KarotteError


class SeccompError(KarotteError):
    """A seccomp policy is invalid, or cannot be compiled for the asked architecture."""


# --- The syscall table ----------------------------------------------------------------
#
# Only the syscalls a policy may name. Numbers are checked against the kernel UAPI
# headers (asm/unistd_64.h for x86_64, asm-generic/unistd.h for aarch64) by
# tests/test_seccomp.py. None: the syscall does not exist on that architecture, and a
# rule naming it is skipped there (there is nothing to deny).
#
#   name                        x86_64  aarch64
_TABLE: dict[str, tuple[int | None, int | None]] = {
    "ioctl":                    (16,    29),
    "socket":                   (41,    198),
    "socketpair":               (53,    199),
    "setsockopt":               (54,    208),
    "clone":                    (56,    220),
    "ptrace":                   (101,   117),
    "syslog":                   (103,   116),
    "io_setup":                 (206,   0),
    "io_destroy":               (207,   1),
    "io_getevents":             (208,   4),
    "io_submit":                (209,   2),
    "io_cancel":                (210,   3),
    "uselib":                   (134,   None),  # a.out-era library loader, x86 only
    "personality":              (135,   92),
    "vhangup":                  (153,   58),
    "modify_ldt":               (154,   None),  # x86 segment descriptors
    "pivot_root":               (155,   41),
    "prctl":                    (157,   167),
    "adjtimex":                 (159,   171),
    "chroot":                   (161,   51),
    "acct":                     (163,   89),
    "settimeofday":             (164,   170),
    "mount":                    (165,   40),
    "umount2":                  (166,   39),
    "swapon":                   (167,   224),
    "swapoff":                  (168,   225),
    "reboot":                   (169,   142),
    "iopl":                     (172,   None),  # x86 I/O privilege level
    "ioperm":                   (173,   None),  # x86 I/O port bitmap
    "init_module":              (175,   105),
    "delete_module":            (176,   106),
    "quotactl":                 (179,   60),
    "nfsservctl":               (180,   42),
    "lookup_dcookie":           (212,   18),
    # aarch64 has only fadvise64_64 (asm-generic's __NR3264_fadvise64), with the same
    # arguments in the same order (fd, offset, len, advice).
    "fadvise64":                (221,   223),
    "clock_settime":            (227,   112),
    "kexec_load":               (246,   104),
    "add_key":                  (248,   217),
    "request_key":              (249,   218),
    "keyctl":                   (250,   219),
    "unshare":                  (272,   97),
    "perf_event_open":          (298,   241),
    "io_pgetevents":            (333,   292),
    "prlimit64":                (302,   261),
    "fanotify_init":            (300,   262),
    "name_to_handle_at":        (303,   264),
    "open_by_handle_at":        (304,   265),
    "clock_adjtime":            (305,   266),
    "setns":                    (308,   268),
    "process_vm_readv":         (310,   270),
    "process_vm_writev":        (311,   271),
    "kcmp":                     (312,   272),
    "finit_module":             (313,   273),
    "seccomp":                  (317,   277),
    "kexec_file_load":          (320,   294),
    "bpf":                      (321,   280),
    "userfaultfd":              (323,   282),
    # From 424 on, every architecture shares one numbering.
    "io_uring_setup":           (425,   425),
    "io_uring_enter":           (426,   426),
    "io_uring_register":        (427,   427),
    "open_tree":                (428,   428),
    "move_mount":               (429,   429),
    "fsopen":                   (430,   430),
    "fsconfig":                 (431,   431),
    "fsmount":                  (432,   432),
    "fspick":                   (433,   433),
    "clone3":                   (435,   435),
    "pidfd_getfd":              (438,   438),
    "mount_setattr":            (442,   442),
    "quotactl_fd":              (443,   443),
    "open_tree_attr":           (467,   467),  # Linux 6.15
}

ARCHES = ("x86_64", "aarch64")

#: name -> {arch: number or None}, for the syscalls a policy may name.
SYSCALL_NUMBERS = MappingProxyType({
    name: MappingProxyType(dict(zip(ARCHES, numbers))) for name, numbers in _TABLE.items()
})


@dataclass(frozen=True)
class _Arch:
    audit_arch: int  # AUDIT_ARCH_* that the kernel puts in seccomp_data.arch
    x32_bit: bool  # numbers with 0x40000000 set reach the x32 table


_ARCH_INFO = {
    "x86_64": _Arch(audit_arch=0xC000003E, x32_bit=True),
    "aarch64": _Arch(audit_arch=0xC00000B7, x32_bit=False),
}

# --- Constants the policy compares against ---------------------------------------------

CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEW_ANY = (CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC
                 | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET)

TIOCSTI = 0x5412
TIOCLINUX = 0x541C

AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10

PER_LINUX = 0
PERSONALITY_QUERY = 0xFFFFFFFF

SECCOMP_SET_MODE_FILTER = 1  # seccomp(2) op
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2  # prctl(PR_SET_SECCOMP) mode

# asm-generic/socket.h: the same on x86_64 and aarch64.
SOL_SOCKET = 1
SO_ATTACH_FILTER = 26
SO_ATTACH_BPF = 50
SO_ATTACH_REUSEPORT_CBPF = 51
SO_ATTACH_REUSEPORT_EBPF = 52

POSIX_FADV_DONTNEED = 4  # 6 on s390 only

# --- Policy -----------------------------------------------------------------------------

_MAX_VALUES = 64  # per rule, all its conditions together; keeps every jump short


def _check_arg(arg: int) -> None:
    if not isinstance(arg, int) or isinstance(arg, bool) or not 0 <= arg <= 5:
        raise SeccompError(f"syscall argument index must be 0..5, got {arg!r}")


def _check_u32(value: int, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0xFFFFFFFF:
        raise SeccompError(f"{what} must be an integer in 0..0xffffffff (the filter compares "
                           f"the low 32 bits of an argument), got {value!r}")


def _check_values(values: tuple[int, ...]) -> None:
    if not isinstance(values, tuple) or not 1 <= len(values) <= _MAX_VALUES:
        raise SeccompError(f"values must be a tuple of 1..{_MAX_VALUES} integers, got {values!r}")
    for value in values:
        _check_u32(value, "a compared value")


@dataclass(frozen=True)
class ArgHasAnyBit:
    """Holds when the low 32 bits of ``args[arg]`` share a bit with ``mask``."""

    arg: int
    mask: int

    def __post_init__(self):
        _check_arg(self.arg)
        _check_u32(self.mask, "mask")
        if self.mask == 0:
            raise SeccompError("ArgHasAnyBit.mask must have at least one bit set")


@dataclass(frozen=True)
class ArgIn:
    """Holds when the low 32 bits of ``args[arg]`` equal one of ``values``."""

    arg: int
    values: tuple[int, ...]

    def __post_init__(self):
        _check_arg(self.arg)
        _check_values(self.values)


@dataclass(frozen=True)
class ArgNotIn:
    """Holds when the low 32 bits of ``args[arg]`` equal none of ``values``."""

    arg: int
    values: tuple[int, ...]

    def __post_init__(self):
        _check_arg(self.arg)
        _check_values(self.values)


Condition = ArgHasAnyBit | ArgIn | ArgNotIn


def _conditions(when: Condition | tuple[Condition, ...] | None) -> tuple[Condition, ...]:
    """A rule's ``when`` as a tuple of conditions that must all hold (empty: always)."""
    if when is None:
        return ()
    return when if isinstance(when, tuple) else (when,)


@dataclass(frozen=True)
class Rule:
    """Calls to ``syscalls`` fail with ``errno`` (when ``when`` holds, if it is given).

    ``when`` is one condition, or a tuple of conditions on distinct arguments that must
    all hold (setsockopt's level and optname). ``errno`` 0 makes the call a no-op that
    returns 0, for calls whose effect is advice the caller cannot count on.

    Conditions look at the low 32 bits of an argument only. That is exact for the
    arguments the default policy inspects, which the kernel itself truncates to 32 bits
    (ioctl's cmd, socket's domain, clone's flags, personality's persona, seccomp's op,
    prctl's option, setsockopt's level and optname, fadvise64's advice), so a caller
    cannot hide a value in the high word. prctl(PR_SET_SECCOMP)'s mode is a whole
    unsigned long to the kernel: an ArgIn on its low word also matches values the kernel
    rejects (EINVAL), never fewer than it accepts.
    """

    syscalls: tuple[str, ...]
    reason: str
    errno: int = EPERM
    when: Condition | tuple[Condition, ...] | None = None

    def __post_init__(self):
        if isinstance(self.syscalls, str):
            object.__setattr__(self, "syscalls", (self.syscalls,))
        if not isinstance(self.syscalls, tuple) or not self.syscalls:
            raise SeccompError(
                f"Rule.syscalls must name at least one syscall, got {self.syscalls!r}")
        for name in self.syscalls:
            if name not in _TABLE:
                raise SeccompError(
                    f"unknown syscall {name!r}: it is not in Karotte's syscall table; add its "
                    f"x86_64 and aarch64 numbers to _TABLE in karotte/seccomp.py (None where the "
                    f"architecture lacks it)")
        if len(set(self.syscalls)) != len(self.syscalls):
            raise SeccompError(f"Rule.syscalls names a syscall twice: {self.syscalls!r}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise SeccompError(f"the rule for {', '.join(self.syscalls)} needs a reason: "
                               f"say which attack it stops")
        if not isinstance(self.errno, int) or isinstance(self.errno, bool) \
                or not 0 <= self.errno <= 4095:
            raise SeccompError(f"Rule.errno must be an errno in 1..4095, or 0 for a no-op "
                               f"that returns 0, got {self.errno!r}")
        conditions = _conditions(self.when)
        if (isinstance(self.when, tuple) and not self.when) or not all(
                isinstance(c, (ArgHasAnyBit, ArgIn, ArgNotIn)) for c in conditions):
            raise SeccompError(f"Rule.when must be ArgHasAnyBit, ArgIn, ArgNotIn, a non-empty "
                               f"tuple of them, or None, got {self.when!r}")
        args = [c.arg for c in conditions]
        if len(set(args)) != len(args):
            raise SeccompError(f"Rule.when has two conditions on one argument: {self.when!r}; "
                               f"merge them into one")
        compared = sum(1 if isinstance(c, ArgHasAnyBit) else len(c.values) for c in conditions)
        if compared > _MAX_VALUES:
            raise SeccompError(f"the rule for {', '.join(self.syscalls)} compares {compared} "
                               f"values; at most {_MAX_VALUES} in all (a mask counts as one)")


@dataclass(frozen=True)
class Policy:
    """Deny rules over a default of allow; each syscall is named by at most one rule.

    The ABI guard described in the module docstring (kill on a foreign arch or an x32
    number) is compiled in front of the rules of every policy and cannot be turned off.
    """

    rules: tuple[Rule, ...]

    def __post_init__(self):
        if not isinstance(self.rules, tuple) or not all(isinstance(r, Rule) for r in self.rules):
            raise SeccompError("Policy.rules must be a tuple of Rule")
        seen: set[str] = set()
        for rule in self.rules:
            for name in rule.syscalls:
                if name in seen:
                    raise SeccompError(f"syscall {name!r} is named by more than one rule; "
                                       f"a syscall gets exactly one rule")
                seen.add(name)


DEFAULT_POLICY = Policy(rules=(
    # Rules that look at arguments. ioctl comes first: it is the hot one.
    Rule("ioctl", when=ArgIn(1, (TIOCSTI, TIOCLINUX)),
         reason="ESC-TIOCSTI-01: TIOCSTI pushes bytes into a terminal's input queue and "
                "TIOCLINUX pastes the console selection; either types commands into a shell "
                "outside the sandbox. Compared on the low 32 bits of cmd, the only ones the "
                "kernel uses, so high bits cannot slip past (CVE-2019-10063)"),
    Rule(("socket", "socketpair"), when=ArgNotIn(0, (AF_UNIX, AF_INET, AF_INET6)),
         reason="only UNIX, IPv4 and IPv6 sockets: netlink (nf_tables, the usual path from a "
                "user namespace to a kernel exploit), packet, AF_ALG, vsock, bluetooth and the "
                "other families are kernel attack surface an agent has no use for"),
    Rule("clone", when=ArgHasAnyBit(0, CLONE_NEW_ANY),
         reason="ESC-USERNS-01: a new user namespace gives back a full capability set over "
                "fresh kernel attack surface, and the other namespace flags build mount, PID "
                "or network views the sandbox did not plan; fork, vfork and threads pass"),
    Rule("personality", when=ArgNotIn(0, (PER_LINUX, PERSONALITY_QUERY)),
         reason="persona flags such as ADDR_NO_RANDOMIZE and READ_IMPLIES_EXEC turn off ASLR "
                "and NX for the process and everything it execs; only PER_LINUX and the "
                "0xffffffff query pass"),
    Rule("prlimit64", when=ArgNotIn(0, (0,)),
         reason="PROC-LIMITS-01: another process's limits. When the caller is unprivileged "
                "the agent shares init's host uid, and prlimit on pid 1 (RLIMIT_NOFILE 3) "
                "would wedge the sandbox into looking like an infrastructure failure; "
                "glibc's own setrlimit and getrlimit pass pid 0"),
    Rule("seccomp", when=ArgIn(0, (SECCOMP_SET_MODE_FILTER,)),
         reason="RES-BPFJIT-01: every seccomp filter is JIT-compiled and charged to the "
                "host-wide BPF JIT budget (net.core.bpf_jit_limit); an agent stacking "
                "filters, or pinning them with a SECCOMP_FILTER_FLAG_NEW_LISTENER fd, uses "
                "it up, and then no new sandbox (and no unprivileged host service) can load "
                "its filter. The GET_ACTION_AVAIL and GET_NOTIF_SIZES queries pass"),
    Rule("prctl", when=(ArgIn(0, (PR_SET_SECCOMP,)), ArgIn(1, (SECCOMP_MODE_FILTER,))),
         reason="RES-BPFJIT-01: PR_SET_SECCOMP with SECCOMP_MODE_FILTER is the older way to "
                "load a seccomp filter; every other prctl passes"),
    Rule("setsockopt", when=(ArgIn(1, (SOL_SOCKET,)),
                             ArgIn(2, (SO_ATTACH_FILTER, SO_ATTACH_REUSEPORT_CBPF,
                                       SO_ATTACH_BPF, SO_ATTACH_REUSEPORT_EBPF))),
         reason="RES-BPFJIT-01: a classic BPF socket filter is JIT-compiled into the same "
                "host-wide budget (about 34 KiB for a large one, on each of a thousand "
                "sockets); the eBPF variants attach a program from bpf(), which is denied "
                "too. Detaching a filter and SO_LOCK_FILTER allocate nothing and pass"),
    Rule("fadvise64", errno=0, when=ArgIn(3, (POSIX_FADV_DONTNEED,)),
         reason="RES-PAGECACHE-01: POSIX_FADV_DONTNEED drops a file's clean pages from the "
                "page cache, which the read-only binds of the host's /usr share with the "
                "host and every sandbox: read and DONTNEED in a loop made them all read "
                "from disk (1.1 GiB/s). Errno 0 makes it a no-op that returns 0, which "
                "advice may be. advice is args[3] on x86_64 and aarch64 (fadvise64_64)"),
    # Rules that deny a syscall whatever its arguments.
    Rule("clone3", errno=ENOSYS,
         reason="ESC-USERNS-01: clone3 passes its flags in memory, which a seccomp filter "
                "cannot read; ENOSYS makes glibc fall back to clone, whose flags are checked"),
    Rule(("unshare", "setns"),
         reason="ESC-USERNS-01: entering or creating namespaces (a user namespace above all) "
                "regains capabilities and reaches netfilter and filesystem code"),
    Rule(("io_uring_setup", "io_uring_enter", "io_uring_register"),
         reason="ESC-IOURING-01: io_uring runs opens, connects and reads inside the kernel "
                "where seccomp never sees them, and has been a leading source of kernel "
                "exploits"),
    Rule(("io_setup", "io_destroy", "io_submit", "io_getevents", "io_pgetevents", "io_cancel"),
         errno=ENOSYS,
         reason="kernel AIO contexts come from one host-wide pool (fs.aio-max-nr): one agent "
                "could take them all from the host and every other sandbox; ENOSYS, and "
                "glibc's POSIX AIO, which uses threads, still works"),
    Rule("userfaultfd",
         reason="ESC-UFFD-01: userfaultfd stalls a kernel copy at a chosen page, the usual "
                "way to win a kernel race"),
    Rule("perf_event_open",
         reason="ESC-PERF-01: hardware counters are side channels across the host, and the "
                "perf subsystem has a long record of kernel bugs"),
    Rule("bpf",
         reason="the eBPF verifier and JIT are large kernel attack surface, a frequent local "
                "privilege escalation"),
    Rule(("keyctl", "add_key", "request_key"),
         reason="kernel keyrings are not isolated by namespaces and have a record of kernel "
                "bugs; an agent has no keys to keep"),
    Rule(("ptrace", "process_vm_readv", "process_vm_writev"),
         reason="PROC-PTRACE-01: reading or writing the memory and registers of another "
                "process, such as a grader in the same sandbox"),
    Rule("pidfd_getfd",
         reason="PROC-PTRACE-01: copies an open file out of another process, a ptrace-level "
                "power"),
    Rule("kcmp",
         reason="PROC-PTRACE-01: compares kernel objects of other processes, which leaks "
                "the ordering of kernel pointers"),
    Rule(("mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
          "fspick", "move_mount", "open_tree", "mount_setattr", "open_tree_attr"),
         reason="FS-SPECIAL-01: the mount tree Karotte built is the agent's view of the "
                "filesystem; new mounts (FUSE, a filesystem image) hang readers and reach "
                "filesystem drivers, and unmounting can uncover what is beneath"),
    Rule(("open_by_handle_at", "name_to_handle_at"),
         reason="file handles open an inode by number, past the mount tree; this was the "
                "'shocker' container escape"),
    Rule(("kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module",
          "delete_module"),
         reason="replacing, rebooting or extending the running kernel; these need host "
                "capabilities, and are denied so that a bug in that check is unreachable"),
    Rule(("swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "vhangup"),
         reason="host-wide administration (swap, process accounting, quotas, terminal "
                "hangup) that no agent needs; denied for the same reason"),
    Rule("syslog",
         reason="the kernel log shows host activity and kernel addresses that help an exploit"),
    Rule(("clock_settime", "settimeofday", "adjtimex", "clock_adjtime"),
         reason="the clock is shared with the host and every other sandbox: moving it would "
                "break their timeouts, certificates and logs"),
    Rule("fanotify_init",
         reason="filesystem-wide watches see, and with permission events block, file access "
                "by processes outside the sandbox on the same filesystem"),
    Rule(("lookup_dcookie", "nfsservctl", "uselib"),
         reason="obsolete interfaces (profiling cookies, the old NFS server, a.out libraries) "
                "that are now only kernel attack surface"),
    Rule(("iopl", "ioperm", "modify_ldt"),
         reason="x86 port I/O and segment descriptors: raw hardware access, and LDT code "
                "that only 16-bit programs need and that has had kernel bugs"),
))

# --- Compiler ---------------------------------------------------------------------------

_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JSET_K = 0x45
_BPF_RET_K = 0x06
BPF_MAXINSNS = 4096

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
_OFF_NR = 0
_OFF_ARCH = 4
_X32_SYSCALL_BIT = 0x40000000


def _arg_low(arg: int) -> int:
    # Both supported architectures are little endian: the low word of args[i] comes first.
    return 16 + 8 * arg


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
        raise SeccompError(f"internal: BPF jump offset out of range (jt={jt}, jf={jf})")
    return struct.pack("<HBBI", code, jt, jf, k)


def _ret(action: int) -> bytes:
    return _insn(_BPF_RET_K, action)


def _body(rule: Rule) -> list[bytes]:
    """The instructions after a rule's syscall matched; every path ends in a return.

    Because each body returns, the next rule is reached only from the syscall-number
    compare in front of the body, with the accumulator still holding nr. All jumps are
    local to one body, so none can outgrow the 8-bit jt/jf fields.

    Each condition is a block that falls through to the next when it holds and jumps to
    the final ``ret ALLOW`` when it does not; after the last block, ``ret ERRNO``.
    """
    conditions = _conditions(rule.when)
    sizes = [2 if isinstance(c, ArgHasAnyBit) else 1 + len(c.values) for c in conditions]
    allow_at = sum(sizes) + 1  # index of ret ALLOW within the body, after ret ERRNO
    body: list[bytes] = []
    for cond, size in zip(conditions, sizes):
        body.append(_insn(_BPF_LD_W_ABS, _arg_low(cond.arg)))
        end = len(body) + size - 1  # first instruction after this block
        if isinstance(cond, ArgHasAnyBit):
            body.append(_insn(_BPF_JSET_K, cond.mask, jt=0, jf=allow_at - len(body) - 1))
            continue
        for i, value in enumerate(cond.values):
            pc = len(body)
            if isinstance(cond, ArgNotIn):  # any equal value: the condition fails
                body.append(_insn(_BPF_JEQ_K, value, jt=allow_at - pc - 1, jf=0))
            elif i < len(cond.values) - 1:  # ArgIn: an equal value ends the block
                body.append(_insn(_BPF_JEQ_K, value, jt=end - pc - 1, jf=0))
            else:  # ArgIn's last value, and no value was equal: the condition fails
                body.append(_insn(_BPF_JEQ_K, value, jt=0, jf=allow_at - pc - 1))
    body.append(_ret(SECCOMP_RET_ERRNO | rule.errno))
    if conditions:
        body.append(_ret(SECCOMP_RET_ALLOW))
    return body


def _resolve_arch(arch: str | None) -> str:
    name = platform.machine() if arch is None else arch
    if name not in _ARCH_INFO:
        where = "this machine" if arch is None else "the arch asked for"
        raise SeccompError(
            f"no seccomp syscall table for architecture {name!r} ({where}); Karotte supports "
            f"{', '.join(ARCHES)}. Run on one of those, or add a column to _TABLE in "
            f"karotte/seccomp.py with the AUDIT_ARCH value in _ARCH_INFO")
    return name


def compile_policy(policy: Policy = DEFAULT_POLICY, arch: str | None = None) -> bytes:
    """The policy as classic BPF: little-endian ``struct sock_filter[]`` bytes.

    ``arch`` None means this machine (``platform.machine()``). Syscalls that do not exist
    on ``arch`` are skipped. The result is what ``seccomp(SECCOMP_SET_MODE_FILTER, ...)``
    takes as ``prog.filter``, with ``prog.len = len(result) // 8``.
    """
    if not isinstance(policy, Policy):
        raise SeccompError(f"compile_policy needs a Policy, got {type(policy).__name__}")
    name = _resolve_arch(arch)
    info = _ARCH_INFO[name]
    column = ARCHES.index(name)

    prog = [
        # Numbers mean something only in the native table: any other ABI is killed
        # before a rule looks at nr, or i386's ptrace (26) would pass as x86_64's msync.
        _insn(_BPF_LD_W_ABS, _OFF_ARCH),
        _insn(_BPF_JEQ_K, info.audit_arch, jt=1, jf=0),
        _ret(SECCOMP_RET_KILL_PROCESS),
        _insn(_BPF_LD_W_ABS, _OFF_NR),
    ]
    if info.x32_bit:
        # x32 reaches the same kernel code under nr | 0x40000000, past every rule below.
        prog += [_insn(_BPF_JGE_K, _X32_SYSCALL_BIT, jt=0, jf=1), _ret(SECCOMP_RET_KILL_PROCESS)]

    # Argument rules first: since Linux 5.11 the kernel caches the verdict of syscalls
    # whose outcome does not depend on arguments, so these are the rules that run.
    ordered = sorted(policy.rules, key=lambda rule: rule.when is None)
    for rule in ordered:
        for syscall in rule.syscalls:
            nr = _TABLE[syscall][column]
            if nr is None:
                continue
            body = _body(rule)
            prog.append(_insn(_BPF_JEQ_K, nr, jt=0, jf=len(body)))
            prog += body
    prog.append(_ret(SECCOMP_RET_ALLOW))

    if len(prog) > BPF_MAXINSNS:
        raise SeccompError(f"the compiled filter has {len(prog)} instructions, over the "
                           f"kernel's limit of {BPF_MAXINSNS}; the policy names too many "
                           f"syscalls or values")
    return b"".join(prog)
