"""The sandbox's seccomp policy, and its compiler to classic BPF.

``DEFAULT_POLICY`` decides every syscall of the kernel's table, up to the newest one
Karotte was reviewed for (Linux 6.18, number ``REVIEWED_THROUGH``): each entry allows
or denies a syscall or a small group of them, with the reason. ``compile_policy`` turns
a policy into the bytes of a ``struct sock_filter[]`` that karotte-init loads with
``seccomp(SECCOMP_SET_MODE_FILTER, 0, &prog)`` after ``PR_SET_NO_NEW_PRIVS``, right
before it execs the agent's command.

Every compiled filter starts with the same guard, which is not an entry because nothing
else is sound without it: a syscall made through another ABI than the native one
(``int 0x80`` into the i386 table on x86_64, or the x32 table) carries other syscall
numbers, so the filter kills the process for a foreign ``seccomp_data.arch`` and, on
x86_64, for any number with the x32 bit (0x40000000). Then every number above
``REVIEWED_THROUGH`` fails with ENOSYS: a call that a newer kernel adds is denied until
someone reviews it (SYS-UNREVIEWED-01). Below it, a number that no entry decides, and a
number that has no syscall on the architecture, fail with ENOSYS too.
"""
from __future__ import annotations

import platform
import struct
from dataclasses import dataclass
from errno import ENOSYS, EOPNOTSUPP, EPERM
from types import MappingProxyType

from karotte.errors import KarotteError
from karotte.namespaces import CLONE_NEW_ANY
from karotte.namespaces import (  # noqa: F401 (public here too)
    CLONE_NEWCGROUP, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWTIME,
    CLONE_NEWUSER, CLONE_NEWUTS)


class SeccompError(KarotteError):
    """A seccomp policy is invalid, or cannot be compiled for the asked architecture."""


# --- The syscall table ----------------------------------------------------------------
#
# Every syscall of the x86_64 table of Linux 6.18 (arch/x86/entry/syscalls/syscall_64.tbl),
# with its aarch64 number (the generic table, scripts/syscall.tbl) or None where aarch64
# lacks it. tests/test_seccomp.py checks the numbers against the installed UAPI headers
# (asm/unistd_64.h, asm-generic/unistd.h) and that every number of the headers and of
# this table is decided by DEFAULT_POLICY. From 424 on, every architecture shares one
# numbering. aarch64 has only fadvise64_64 (asm-generic's __NR3264_fadvise64), with the
# same arguments in the same order (fd, offset, len, advice).
#
#   name                         x86_64  aarch64
_TABLE: dict[str, tuple[int | None, int | None]] = {
    "read":                      (0,    63),
    "write":                     (1,    64),
    "open":                      (2,    None),
    "close":                     (3,    57),
    "stat":                      (4,    None),
    "fstat":                     (5,    80),
    "lstat":                     (6,    None),
    "poll":                      (7,    None),
    "lseek":                     (8,    62),
    "mmap":                      (9,    222),
    "mprotect":                  (10,   226),
    "munmap":                    (11,   215),
    "brk":                       (12,   214),
    "rt_sigaction":              (13,   134),
    "rt_sigprocmask":            (14,   135),
    "rt_sigreturn":              (15,   139),
    "ioctl":                     (16,   29),
    "pread64":                   (17,   67),
    "pwrite64":                  (18,   68),
    "readv":                     (19,   65),
    "writev":                    (20,   66),
    "access":                    (21,   None),
    "pipe":                      (22,   None),
    "select":                    (23,   None),
    "sched_yield":               (24,   124),
    "mremap":                    (25,   216),
    "msync":                     (26,   227),
    "mincore":                   (27,   232),
    "madvise":                   (28,   233),
    "shmget":                    (29,   194),
    "shmat":                     (30,   196),
    "shmctl":                    (31,   195),
    "dup":                       (32,   23),
    "dup2":                      (33,   None),
    "pause":                     (34,   None),
    "nanosleep":                 (35,   101),
    "getitimer":                 (36,   102),
    "alarm":                     (37,   None),
    "setitimer":                 (38,   103),
    "getpid":                    (39,   172),
    "sendfile":                  (40,   71),
    "socket":                    (41,   198),
    "connect":                   (42,   203),
    "accept":                    (43,   202),
    "sendto":                    (44,   206),
    "recvfrom":                  (45,   207),
    "sendmsg":                   (46,   211),
    "recvmsg":                   (47,   212),
    "shutdown":                  (48,   210),
    "bind":                      (49,   200),
    "listen":                    (50,   201),
    "getsockname":               (51,   204),
    "getpeername":               (52,   205),
    "socketpair":                (53,   199),
    "setsockopt":                (54,   208),
    "getsockopt":                (55,   209),
    "clone":                     (56,   220),
    "fork":                      (57,   None),
    "vfork":                     (58,   None),
    "execve":                    (59,   221),
    "exit":                      (60,   93),
    "wait4":                     (61,   260),
    "kill":                      (62,   129),
    "uname":                     (63,   160),
    "semget":                    (64,   190),
    "semop":                     (65,   193),
    "semctl":                    (66,   191),
    "shmdt":                     (67,   197),
    "msgget":                    (68,   186),
    "msgsnd":                    (69,   189),
    "msgrcv":                    (70,   188),
    "msgctl":                    (71,   187),
    "fcntl":                     (72,   25),
    "flock":                     (73,   32),
    "fsync":                     (74,   82),
    "fdatasync":                 (75,   83),
    "truncate":                  (76,   45),
    "ftruncate":                 (77,   46),
    "getdents":                  (78,   None),
    "getcwd":                    (79,   17),
    "chdir":                     (80,   49),
    "fchdir":                    (81,   50),
    "rename":                    (82,   None),
    "mkdir":                     (83,   None),
    "rmdir":                     (84,   None),
    "creat":                     (85,   None),
    "link":                      (86,   None),
    "unlink":                    (87,   None),
    "symlink":                   (88,   None),
    "readlink":                  (89,   None),
    "chmod":                     (90,   None),
    "fchmod":                    (91,   52),
    "chown":                     (92,   None),
    "fchown":                    (93,   55),
    "lchown":                    (94,   None),
    "umask":                     (95,   166),
    "gettimeofday":              (96,   169),
    "getrlimit":                 (97,   163),
    "getrusage":                 (98,   165),
    "sysinfo":                   (99,   179),
    "times":                     (100,  153),
    "ptrace":                    (101,  117),
    "getuid":                    (102,  174),
    "syslog":                    (103,  116),
    "getgid":                    (104,  176),
    "setuid":                    (105,  146),
    "setgid":                    (106,  144),
    "geteuid":                   (107,  175),
    "getegid":                   (108,  177),
    "setpgid":                   (109,  154),
    "getppid":                   (110,  173),
    "getpgrp":                   (111,  None),
    "setsid":                    (112,  157),
    "setreuid":                  (113,  145),
    "setregid":                  (114,  143),
    "getgroups":                 (115,  158),
    "setgroups":                 (116,  159),
    "setresuid":                 (117,  147),
    "getresuid":                 (118,  148),
    "setresgid":                 (119,  149),
    "getresgid":                 (120,  150),
    "getpgid":                   (121,  155),
    "setfsuid":                  (122,  151),
    "setfsgid":                  (123,  152),
    "getsid":                    (124,  156),
    "capget":                    (125,  90),
    "capset":                    (126,  91),
    "rt_sigpending":             (127,  136),
    "rt_sigtimedwait":           (128,  137),
    "rt_sigqueueinfo":           (129,  138),
    "rt_sigsuspend":             (130,  133),
    "sigaltstack":               (131,  132),
    "utime":                     (132,  None),
    "mknod":                     (133,  None),
    "uselib":                    (134,  None),
    "personality":               (135,  92),
    "ustat":                     (136,  None),
    "statfs":                    (137,  43),
    "fstatfs":                   (138,  44),
    "sysfs":                     (139,  None),
    "getpriority":               (140,  141),
    "setpriority":               (141,  140),
    "sched_setparam":            (142,  118),
    "sched_getparam":            (143,  121),
    "sched_setscheduler":        (144,  119),
    "sched_getscheduler":        (145,  120),
    "sched_get_priority_max":    (146,  125),
    "sched_get_priority_min":    (147,  126),
    "sched_rr_get_interval":     (148,  127),
    "mlock":                     (149,  228),
    "munlock":                   (150,  229),
    "mlockall":                  (151,  230),
    "munlockall":                (152,  231),
    "vhangup":                   (153,  58),
    "modify_ldt":                (154,  None),
    "pivot_root":                (155,  41),
    "_sysctl":                   (156,  None),
    "prctl":                     (157,  167),
    "arch_prctl":                (158,  None),
    "adjtimex":                  (159,  171),
    "setrlimit":                 (160,  164),
    "chroot":                    (161,  51),
    "sync":                      (162,  81),
    "acct":                      (163,  89),
    "settimeofday":              (164,  170),
    "mount":                     (165,  40),
    "umount2":                   (166,  39),
    "swapon":                    (167,  224),
    "swapoff":                   (168,  225),
    "reboot":                    (169,  142),
    "sethostname":               (170,  161),
    "setdomainname":             (171,  162),
    "iopl":                      (172,  None),
    "ioperm":                    (173,  None),
    "create_module":             (174,  None),
    "init_module":               (175,  105),
    "delete_module":             (176,  106),
    "get_kernel_syms":           (177,  None),
    "query_module":              (178,  None),
    "quotactl":                  (179,  60),
    "nfsservctl":                (180,  42),
    "getpmsg":                   (181,  None),
    "putpmsg":                   (182,  None),
    "afs_syscall":               (183,  None),
    "tuxcall":                   (184,  None),
    "security":                  (185,  None),
    "gettid":                    (186,  178),
    "readahead":                 (187,  213),
    "setxattr":                  (188,  5),
    "lsetxattr":                 (189,  6),
    "fsetxattr":                 (190,  7),
    "getxattr":                  (191,  8),
    "lgetxattr":                 (192,  9),
    "fgetxattr":                 (193,  10),
    "listxattr":                 (194,  11),
    "llistxattr":                (195,  12),
    "flistxattr":                (196,  13),
    "removexattr":               (197,  14),
    "lremovexattr":              (198,  15),
    "fremovexattr":              (199,  16),
    "tkill":                     (200,  130),
    "time":                      (201,  None),
    "futex":                     (202,  98),
    "sched_setaffinity":         (203,  122),
    "sched_getaffinity":         (204,  123),
    "set_thread_area":           (205,  None),
    "io_setup":                  (206,  0),
    "io_destroy":                (207,  1),
    "io_getevents":              (208,  4),
    "io_submit":                 (209,  2),
    "io_cancel":                 (210,  3),
    "get_thread_area":           (211,  None),
    "lookup_dcookie":            (212,  18),
    "epoll_create":              (213,  None),
    "epoll_ctl_old":             (214,  None),
    "epoll_wait_old":            (215,  None),
    "remap_file_pages":          (216,  234),
    "getdents64":                (217,  61),
    "set_tid_address":           (218,  96),
    "restart_syscall":           (219,  128),
    "semtimedop":                (220,  192),
    "fadvise64":                 (221,  223),
    "timer_create":              (222,  107),
    "timer_settime":             (223,  110),
    "timer_gettime":             (224,  108),
    "timer_getoverrun":          (225,  109),
    "timer_delete":              (226,  111),
    "clock_settime":             (227,  112),
    "clock_gettime":             (228,  113),
    "clock_getres":              (229,  114),
    "clock_nanosleep":           (230,  115),
    "exit_group":                (231,  94),
    "epoll_wait":                (232,  None),
    "epoll_ctl":                 (233,  21),
    "tgkill":                    (234,  131),
    "utimes":                    (235,  None),
    "vserver":                   (236,  None),
    "mbind":                     (237,  235),
    "set_mempolicy":             (238,  237),
    "get_mempolicy":             (239,  236),
    "mq_open":                   (240,  180),
    "mq_unlink":                 (241,  181),
    "mq_timedsend":              (242,  182),
    "mq_timedreceive":           (243,  183),
    "mq_notify":                 (244,  184),
    "mq_getsetattr":             (245,  185),
    "kexec_load":                (246,  104),
    "waitid":                    (247,  95),
    "add_key":                   (248,  217),
    "request_key":               (249,  218),
    "keyctl":                    (250,  219),
    "ioprio_set":                (251,  30),
    "ioprio_get":                (252,  31),
    "inotify_init":              (253,  None),
    "inotify_add_watch":         (254,  27),
    "inotify_rm_watch":          (255,  28),
    "migrate_pages":             (256,  238),
    "openat":                    (257,  56),
    "mkdirat":                   (258,  34),
    "mknodat":                   (259,  33),
    "fchownat":                  (260,  54),
    "futimesat":                 (261,  None),
    "newfstatat":                (262,  79),
    "unlinkat":                  (263,  35),
    "renameat":                  (264,  38),
    "linkat":                    (265,  37),
    "symlinkat":                 (266,  36),
    "readlinkat":                (267,  78),
    "fchmodat":                  (268,  53),
    "faccessat":                 (269,  48),
    "pselect6":                  (270,  72),
    "ppoll":                     (271,  73),
    "unshare":                   (272,  97),
    "set_robust_list":           (273,  99),
    "get_robust_list":           (274,  100),
    "splice":                    (275,  76),
    "tee":                       (276,  77),
    "sync_file_range":           (277,  84),
    "vmsplice":                  (278,  75),
    "move_pages":                (279,  239),
    "utimensat":                 (280,  88),
    "epoll_pwait":               (281,  22),
    "signalfd":                  (282,  None),
    "timerfd_create":            (283,  85),
    "eventfd":                   (284,  None),
    "fallocate":                 (285,  47),
    "timerfd_settime":           (286,  86),
    "timerfd_gettime":           (287,  87),
    "accept4":                   (288,  242),
    "signalfd4":                 (289,  74),
    "eventfd2":                  (290,  19),
    "epoll_create1":             (291,  20),
    "dup3":                      (292,  24),
    "pipe2":                     (293,  59),
    "inotify_init1":             (294,  26),
    "preadv":                    (295,  69),
    "pwritev":                   (296,  70),
    "rt_tgsigqueueinfo":         (297,  240),
    "perf_event_open":           (298,  241),
    "recvmmsg":                  (299,  243),
    "fanotify_init":             (300,  262),
    "fanotify_mark":             (301,  263),
    "prlimit64":                 (302,  261),
    "name_to_handle_at":         (303,  264),
    "open_by_handle_at":         (304,  265),
    "clock_adjtime":             (305,  266),
    "syncfs":                    (306,  267),
    "sendmmsg":                  (307,  269),
    "setns":                     (308,  268),
    "getcpu":                    (309,  168),
    "process_vm_readv":          (310,  270),
    "process_vm_writev":         (311,  271),
    "kcmp":                      (312,  272),
    "finit_module":              (313,  273),
    "sched_setattr":             (314,  274),
    "sched_getattr":             (315,  275),
    "renameat2":                 (316,  276),
    "seccomp":                   (317,  277),
    "getrandom":                 (318,  278),
    "memfd_create":              (319,  279),
    "kexec_file_load":           (320,  294),
    "bpf":                       (321,  280),
    "execveat":                  (322,  281),
    "userfaultfd":               (323,  282),
    "membarrier":                (324,  283),
    "mlock2":                    (325,  284),
    "copy_file_range":           (326,  285),
    "preadv2":                   (327,  286),
    "pwritev2":                  (328,  287),
    "pkey_mprotect":             (329,  288),
    "pkey_alloc":                (330,  289),
    "pkey_free":                 (331,  290),
    "statx":                     (332,  291),
    "io_pgetevents":             (333,  292),
    "rseq":                      (334,  293),
    "uretprobe":                 (335,  None),
    "uprobe":                    (336,  None),
    "pidfd_send_signal":         (424,  424),
    "io_uring_setup":            (425,  425),
    "io_uring_enter":            (426,  426),
    "io_uring_register":         (427,  427),
    "open_tree":                 (428,  428),
    "move_mount":                (429,  429),
    "fsopen":                    (430,  430),
    "fsconfig":                  (431,  431),
    "fsmount":                   (432,  432),
    "fspick":                    (433,  433),
    "pidfd_open":                (434,  434),
    "clone3":                    (435,  435),
    "close_range":               (436,  436),
    "openat2":                   (437,  437),
    "pidfd_getfd":               (438,  438),
    "faccessat2":                (439,  439),
    "process_madvise":           (440,  440),
    "epoll_pwait2":              (441,  441),
    "mount_setattr":             (442,  442),
    "quotactl_fd":               (443,  443),
    "landlock_create_ruleset":   (444,  444),
    "landlock_add_rule":         (445,  445),
    "landlock_restrict_self":    (446,  446),
    "memfd_secret":              (447,  447),
    "process_mrelease":          (448,  448),
    "futex_waitv":               (449,  449),
    "set_mempolicy_home_node":   (450,  450),
    "cachestat":                 (451,  451),
    "fchmodat2":                 (452,  452),
    "map_shadow_stack":          (453,  453),
    "futex_wake":                (454,  454),
    "futex_wait":                (455,  455),
    "futex_requeue":             (456,  456),
    "statmount":                 (457,  457),
    "listmount":                 (458,  458),
    "lsm_get_self_attr":         (459,  459),
    "lsm_set_self_attr":         (460,  460),
    "lsm_list_modules":          (461,  461),
    "mseal":                     (462,  462),
    "setxattrat":                (463,  463),
    "getxattrat":                (464,  464),
    "listxattrat":               (465,  465),
    "removexattrat":             (466,  466),
    "open_tree_attr":            (467,  467),
    "file_getattr":              (468,  468),
    "file_setattr":              (469,  469),
}

ARCHES = ("x86_64", "aarch64")

#: The highest syscall number that Karotte's review covers, on every architecture: Linux
#: 6.18's last call (file_setattr). A kernel's number above it fails with ENOSYS.
REVIEWED_THROUGH = 469
REVIEWED_KERNEL = "6.18"

#: Numbers below REVIEWED_THROUGH that have no syscall on the architecture: the kernel
#: answers ENOSYS, and so does the filter, decided here as ranges rather than per number.
#: On x86_64 the table skips 337..423 to line up with the generic numbering from 424;
#: the x32 calls (512..547) are above REVIEWED_THROUGH and carry the x32 bit anyway. On
#: aarch64, 244..259 are other architectures' own calls, 295..402 are unused and 403..423
#: are the 32-bit time64 calls.
UNASSIGNED = MappingProxyType({
    "x86_64": ((337, 423),),
    "aarch64": ((244, 259), (295, 423)),
})

#: name -> {arch: number or None}, for every syscall of the table.
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

RWF_NOWAIT = 0x00000008  # preadv2/pwritev2 flags, args[5] on x86_64 and aarch64
# Requests for the host's reserved huge pages; the same bits on x86_64 and aarch64.
MAP_HUGETLB = 0x40000  # mmap flags, args[3]
MFD_HUGETLB = 0x0004  # memfd_create flags, args[1]
SHM_HUGETLB = 0o4000  # shmget flags, args[2]

# --- Policy -----------------------------------------------------------------------------

_MAX_VALUES = 64  # per entry, all its conditions together; keeps every jump short


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
    """A deny's ``when`` as a tuple of conditions that must all hold (empty: always)."""
    if when is None:
        return ()
    return when if isinstance(when, tuple) else (when,)


def _check_names(kind: str, syscalls, reason) -> tuple[str, ...]:
    """``syscalls`` as a tuple of known names, and ``reason`` as a real one."""
    names = (syscalls,) if isinstance(syscalls, str) else syscalls
    if not isinstance(names, tuple) or not names:
        raise SeccompError(f"{kind}.syscalls must name at least one syscall, got {syscalls!r}")
    for name in names:
        if name not in _TABLE:
            raise SeccompError(
                f"unknown syscall {name!r}: it is not in Karotte's syscall table; add its "
                f"x86_64 and aarch64 numbers to _TABLE in karotte/seccomp.py (None where the "
                f"architecture lacks it)")
    if len(set(names)) != len(names):
        raise SeccompError(f"{kind}.syscalls names a syscall twice: {names!r}")
    if not isinstance(reason, str) or not reason.strip():
        raise SeccompError(f"the {kind} of {', '.join(names)} needs a reason: say why an agent "
                           f"may make the call, or which attack denying it stops")
    return names


@dataclass(frozen=True)
class Allow:
    """Calls to ``syscalls`` run; ``reason`` says why an agent may make them."""

    syscalls: tuple[str, ...]
    reason: str

    def __post_init__(self):
        object.__setattr__(self, "syscalls", _check_names("Allow", self.syscalls, self.reason))


@dataclass(frozen=True)
class Deny:
    """Calls to ``syscalls`` fail with ``errno`` (when ``when`` holds, if it is given;
    otherwise they run). ``when`` is one condition, or a tuple of conditions on distinct
    arguments that must all hold; ``errno`` 0 makes the call a no-op that returns 0.
    Conditions look at an argument's low 32 bits only, as the kernel reads the ones the
    policy inspects (why that is exact: docs/seccomp.md, "Arguments are compared...").
    """

    syscalls: tuple[str, ...]
    reason: str
    errno: int = EPERM
    when: Condition | tuple[Condition, ...] | None = None

    def __post_init__(self):
        names = _check_names("Deny", self.syscalls, self.reason)
        object.__setattr__(self, "syscalls", names)
        if not isinstance(self.errno, int) or isinstance(self.errno, bool) \
                or not 0 <= self.errno <= 4095:
            raise SeccompError(f"Deny.errno must be an errno in 1..4095, or 0 for a no-op "
                               f"that returns 0, got {self.errno!r}")
        conditions = _conditions(self.when)
        if (isinstance(self.when, tuple) and not self.when) or not all(
                isinstance(c, (ArgHasAnyBit, ArgIn, ArgNotIn)) for c in conditions):
            raise SeccompError(f"Deny.when must be ArgHasAnyBit, ArgIn, ArgNotIn, a non-empty "
                               f"tuple of them, or None, got {self.when!r}")
        args = [c.arg for c in conditions]
        if len(set(args)) != len(args):
            raise SeccompError(f"Deny.when has two conditions on one argument: {self.when!r}; "
                               f"merge them into one")
        compared = sum(1 if isinstance(c, ArgHasAnyBit) else len(c.values) for c in conditions)
        if compared > _MAX_VALUES:
            raise SeccompError(f"the Deny of {', '.join(names)} compares {compared} values; at "
                               f"most {_MAX_VALUES} in all (a mask counts as one)")


Entry = Allow | Deny


@dataclass(frozen=True)
class Policy:
    """What each syscall gets; each syscall is named by at most one entry.

    A syscall that no entry names fails with ENOSYS, as does every number above
    ``reviewed_through``: the policy allows only what it was written to allow. The ABI
    guard described in the module docstring (kill on a foreign arch or an x32 number) is
    compiled in front of every policy and cannot be turned off.
    """

    entries: tuple[Entry, ...]
    reviewed_through: int = REVIEWED_THROUGH

    def __post_init__(self):
        if not isinstance(self.entries, tuple) or not all(
                isinstance(e, (Allow, Deny)) for e in self.entries):
            raise SeccompError("Policy.entries must be a tuple of Allow and Deny")
        if not isinstance(self.reviewed_through, int) or isinstance(self.reviewed_through, bool) \
                or not 0 <= self.reviewed_through <= REVIEWED_THROUGH:
            raise SeccompError(f"Policy.reviewed_through must be a syscall number in "
                               f"0..{REVIEWED_THROUGH} (Karotte's table ends there), got "
                               f"{self.reviewed_through!r}")
        seen: set[str] = set()
        for entry in self.entries:
            for name in entry.syscalls:
                if name in seen:
                    raise SeccompError(f"syscall {name!r} is named by more than one entry; "
                                       f"a syscall gets exactly one verdict")
                seen.add(name)
                above = {arch: nr for arch, nr in SYSCALL_NUMBERS[name].items()
                         if nr is not None and nr > self.reviewed_through}
                if above:
                    raise SeccompError(f"{name} is numbered {max(above.values())}, above the "
                                       f"policy's reviewed_through {self.reviewed_through}: "
                                       f"raise reviewed_through once the calls up to it are "
                                       f"reviewed, or drop the entry")

    def verdict(self, name: str) -> Entry | None:
        """The entry that decides ``name``, or None (the call then fails with ENOSYS)."""
        return next((e for e in self.entries if name in e.syscalls), None)


DEFAULT_POLICY = Policy(entries=(
    # Files and I/O. ioctl is the first argument check the filter makes: it is the hot one.
    Deny("ioctl", when=ArgIn(1, (TIOCSTI, TIOCLINUX)),
         reason="ESC-TIOCSTI-01: TIOCSTI pushes bytes into a terminal's input queue and "
                "TIOCLINUX pastes the console selection; either types commands into a shell "
                "outside the sandbox. Compared on the low 32 bits of cmd, the only ones the "
                "kernel uses, so high bits cannot slip past (CVE-2019-10063)"),
    Allow(("read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
           "lseek", "sendfile", "splice", "tee", "vmsplice", "copy_file_range", "close",
           "close_range", "dup", "dup2", "dup3", "fcntl", "flock", "pipe", "pipe2", "fsync",
           "fdatasync", "sync_file_range", "fallocate", "truncate",
           "ftruncate", "readahead"),
          reason="I/O on fds the caller holds; the mount plan decides what it can open, and "
                 "RLIMIT_FSIZE and the tmpfs sizes cap what it writes. flock on a read-only "
                 "bind is seen by every sandbox (docs/side-channels.md)"),
    Deny(("sync", "syncfs"), errno=0,
         reason="RES-SYNC-01: sync flushes the dirty data of every filesystem of the host, "
                "and syncfs of an fd of a read-only bind that of the host's root: in a "
                "loop they hold the trainer's own writes (checkpoints, logs) to the disk's "
                "pace. The sandbox's writable filesystems are tmpfs, which they do not "
                "touch, so a no-op that returns 0 loses the agent nothing; fsync and "
                "fdatasync of its own files still run"),
    Deny(("preadv2", "pwritev2"), errno=EOPNOTSUPP, when=ArgHasAnyBit(5, RWF_NOWAIT),
         reason="LINK-CACHE-01: RWF_NOWAIT fails with EAGAIN instead of reading a page that "
                "is not cached, so it reads the host's page cache of the read-only binds, "
                "which every sandbox and every later run share, without leaving a trace: "
                "one run marks pages, a later one reads the marks. EOPNOTSUPP is what the "
                "kernel says for a file without RWF_NOWAIT, and callers fall back to a "
                "plain read; every other flag passes"),
    Allow(("open", "openat", "openat2", "creat", "stat", "fstat", "lstat", "newfstatat",
           "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2", "getdents",
           "getdents64", "getcwd", "chdir", "fchdir", "rename", "renameat", "renameat2",
           "mkdir", "mkdirat", "rmdir", "link", "linkat", "unlink", "unlinkat", "symlink",
           "symlinkat", "readlink", "readlinkat", "chmod", "fchmod", "fchmodat", "fchmodat2",
           "chown", "fchown", "lchown", "fchownat", "umask", "utime", "utimes", "futimesat",
           "utimensat", "mknod", "mknodat", "setxattr", "lsetxattr", "fsetxattr", "getxattr",
           "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr", "removexattr",
           "lremovexattr", "fremovexattr", "setxattrat", "getxattrat", "listxattrat",
           "removexattrat", "file_getattr", "file_setattr"),
          reason="files as the mount plan shows them: permissions, the read-only binds and "
                 "the unprivileged uid decide what succeeds, and without CAP_MKNOD in the "
                 "host's namespace mknod makes no device node"),
    Deny("fadvise64", errno=0, when=ArgIn(3, (POSIX_FADV_DONTNEED,)),
         reason="RES-PAGECACHE-01: POSIX_FADV_DONTNEED drops a file's clean pages from the "
                "page cache, which the read-only binds of the host's /usr share with the "
                "host and every sandbox: read and DONTNEED in a loop made them all read "
                "from disk (1.1 GiB/s). Errno 0 makes it a no-op that returns 0, which "
                "advice may be. advice is args[3] on x86_64 and aarch64 (fadvise64_64)"),
    Deny("cachestat",
         reason="LINK-CACHE-01: counts the cached pages of a range of a file, the host's "
                "page cache of the read-only binds included, which links runs and "
                "sandboxes. Linux 6.18 already refuses it for a file the caller may not "
                "write; denied so that no kernel's own check is relied on"),
    Allow(("poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl",
           "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "signalfd",
           "signalfd4", "timerfd_create", "timerfd_settime", "timerfd_gettime",
           "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch"),
          reason="waiting on fds the caller holds; init caps inotify instances and watches "
                 "per sandbox. A watch on a read-only bind sees other sandboxes open the "
                 "file (docs/side-channels.md)"),
    # Memory.
    Deny("mmap", when=ArgHasAnyBit(3, MAP_HUGETLB),
         reason="RES-HUGETLB-01: MAP_HUGETLB takes pages of the host's reserved huge-page "
                "pool (vm.nr_hugepages, often set on GPU and RDMA nodes), which no memory "
                "cgroup of the sandbox limits: one agent could take them all from the host "
                "and every other sandbox. A caller sees a failed request, as on a host "
                "without huge pages, and normal pages still work; transparent huge pages "
                "are not affected"),
    Deny("memfd_create", when=ArgHasAnyBit(1, MFD_HUGETLB),
         reason="RES-HUGETLB-01: MFD_HUGETLB backs the memfd with the host's reserved huge "
                "pages, as MAP_HUGETLB does"),
    Allow(("brk", "munmap", "mremap", "mprotect", "msync", "madvise", "mlock", "mlock2",
           "munlock", "mlockall", "munlockall", "remap_file_pages", "pkey_mprotect",
           "pkey_alloc", "pkey_free", "mseal", "map_shadow_stack", "membarrier",
           "mbind", "set_mempolicy", "get_mempolicy",
           "set_mempolicy_home_node", "migrate_pages", "move_pages"),
          reason="the caller's own memory, charged to the sandbox's memory cgroup; "
                 "MADV_PAGEOUT pages out only files the caller may write "
                 "(test_RES_PAGECACHE_01_*), and another process's pages are those of the "
                 "sandbox's own processes"),
    Allow("mincore",
          reason="residency of the caller's own memory; for a mapping of a file whose "
                 "permissions do not let the caller write it (all of the host's /usr) the "
                 "kernel reports every page resident, cached or not (test_LINK_CACHE_01_"
                 "mincore_reads_every_page_of_a_file_the_agent_may_not_write_as_cached). "
                 "Of a file it may write, pagemap after fault-around shows as much"),
    Deny("memfd_secret", errno=ENOSYS,
         reason="each page of secret memory is taken out of the kernel's direct map, which "
                "splits the huge pages that map all of the host's memory into small ones; "
                "they are not merged back when the page is freed, so one agent faulting "
                "secret pages across memory slows the kernel's own memory accesses for "
                "every later sandbox and grader until the host reboots. ENOSYS is what a "
                "kernel without secretmem answers, and callers fall back"),
    Deny(("process_madvise", "process_mrelease"),
         reason="PROC-PTRACE-01: advice on, or reaping of, another process's memory, which "
                "only a userspace OOM killer needs; madvise covers the caller's own memory"),
    # Processes, signals and identities.
    Deny("clone", when=ArgHasAnyBit(0, CLONE_NEW_ANY),
         reason="ESC-USERNS-01: a new user namespace gives back a full capability set over "
                "fresh kernel attack surface, and the other namespace flags build mount, PID "
                "or network views the sandbox did not plan; fork, vfork and threads pass"),
    Deny("clone3", errno=ENOSYS,
         reason="ESC-USERNS-01: clone3 passes its flags in memory, which a seccomp filter "
                "cannot read; ENOSYS makes glibc fall back to clone, whose flags are checked"),
    Deny(("unshare", "setns"),
         reason="ESC-USERNS-01: entering or creating namespaces (a user namespace above all) "
                "regains capabilities and reaches netfilter and filesystem code"),
    Allow(("fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid",
           "kill", "tkill", "tgkill", "getpid", "getppid", "gettid", "getpgrp", "getpgid",
           "setpgid", "getsid", "setsid", "set_tid_address", "set_robust_list",
           "get_robust_list", "rseq", "restart_syscall", "pidfd_open", "pidfd_send_signal",
           "getrusage", "times", "arch_prctl"),
          reason="the sandbox's own processes: its PID namespace holds no other"),
    Allow(("rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending",
           "rt_sigtimedwait", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "rt_sigsuspend",
           "sigaltstack", "pause", "alarm", "getitimer", "setitimer"),
          reason="signals of the caller and of the sandbox's own processes"),
    Allow(("getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
           "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid",
           "setfsgid", "setgroups", "capget", "capset"),
          reason="the agent holds no capability, so it can only drop ids and capabilities "
                 "or move among those it already has"),
    Deny("prctl", when=(ArgIn(0, (PR_SET_SECCOMP,)), ArgIn(1, (SECCOMP_MODE_FILTER,))),
         reason="RES-BPFJIT-01: PR_SET_SECCOMP with SECCOMP_MODE_FILTER is the older way to "
                "load a seccomp filter; every other prctl passes"),
    Deny("seccomp", when=ArgIn(0, (SECCOMP_SET_MODE_FILTER,)),
         reason="RES-BPFJIT-01: every seccomp filter is JIT-compiled and charged to the "
                "host-wide BPF JIT budget (net.core.bpf_jit_limit); an agent stacking "
                "filters, or pinning them with a SECCOMP_FILTER_FLAG_NEW_LISTENER fd, uses "
                "it up, and then no new sandbox (and no unprivileged host service) can load "
                "its filter. The GET_ACTION_AVAIL and GET_NOTIF_SIZES queries pass"),
    Deny("personality", when=ArgNotIn(0, (PER_LINUX, PERSONALITY_QUERY)),
         reason="persona flags such as ADDR_NO_RANDOMIZE and READ_IMPLIES_EXEC turn off ASLR "
                "and NX for the process and everything it execs; only PER_LINUX and the "
                "0xffffffff query pass"),
    Deny("prlimit64", when=ArgNotIn(0, (0,)),
         reason="PROC-LIMITS-01: another process's limits. When the caller is unprivileged "
                "the agent shares init's host uid, and prlimit on pid 1 (RLIMIT_NOFILE 3) "
                "would wedge the sandbox into looking like an infrastructure failure; "
                "glibc's own setrlimit and getrlimit pass pid 0"),
    Allow(("getrlimit", "setrlimit", "getpriority", "setpriority", "sched_yield",
           "sched_setparam", "sched_getparam", "sched_setscheduler", "sched_getscheduler",
           "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
           "sched_setaffinity", "sched_getaffinity", "sched_setattr", "sched_getattr",
           "ioprio_set", "ioprio_get", "getcpu"),
          reason="limits and scheduling of the sandbox's own processes; raising a hard "
                 "limit or a priority needs a capability the agent lacks, and the cgroup "
                 "caps CPU time"),
    Deny(("ptrace", "process_vm_readv", "process_vm_writev"),
         reason="PROC-PTRACE-01: reading or writing the memory and registers of another "
                "process, such as a grader in the same sandbox"),
    Deny("pidfd_getfd",
         reason="PROC-PTRACE-01: copies an open file out of another process, a ptrace-level "
                "power"),
    Deny("kcmp",
         reason="PROC-PTRACE-01: compares kernel objects of other processes, which leaks "
                "the ordering of kernel pointers"),
    Allow(("futex", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue"),
          reason="locks and waits of the caller's threads and processes. A futex on a page "
                 "of a read-only bind is keyed by the host's inode, so it signals between "
                 "sandboxes (docs/side-channels.md); seccomp cannot tell it from a lock in "
                 "shared memory, which multiprocessing needs"),
    # Time.
    Allow(("time", "gettimeofday", "clock_gettime", "clock_getres", "nanosleep",
           "clock_nanosleep", "timer_create", "timer_settime", "timer_gettime",
           "timer_getoverrun", "timer_delete"),
          reason="reading clocks, sleeping, and timers of the caller"),
    Deny(("clock_settime", "settimeofday", "adjtimex", "clock_adjtime"),
         reason="the clock is shared with the host and every other sandbox: moving it would "
                "break their timeouts, certificates and logs"),
    # Inter-process communication and the network.
    Deny("shmget", when=ArgHasAnyBit(2, SHM_HUGETLB),
         reason="RES-HUGETLB-01: SHM_HUGETLB makes a segment of the host's reserved huge "
                "pages, as MAP_HUGETLB does"),
    Allow(("shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
           "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
           "mq_timedreceive", "mq_notify", "mq_getsetattr"),
          reason="System V and POSIX IPC objects live in the sandbox's own IPC namespace "
                 "(test_LINK_SIBLING_01_ipc_objects_are_private_to_a_sandbox)"),
    Deny(("socket", "socketpair"), when=ArgNotIn(0, (AF_UNIX, AF_INET, AF_INET6)),
         reason="only UNIX, IPv4 and IPv6 sockets: netlink (nf_tables, the usual path from a "
                "user namespace to a kernel exploit), packet, AF_ALG, vsock, bluetooth and the "
                "other families are kernel attack surface an agent has no use for"),
    Deny("setsockopt", when=(ArgIn(1, (SOL_SOCKET,)),
                             ArgIn(2, (SO_ATTACH_FILTER, SO_ATTACH_REUSEPORT_CBPF,
                                       SO_ATTACH_BPF, SO_ATTACH_REUSEPORT_EBPF))),
         reason="RES-BPFJIT-01: a classic BPF socket filter is JIT-compiled into the same "
                "host-wide budget (about 34 KiB for a large one, on each of a thousand "
                "sockets); the eBPF variants attach a program from bpf(), which is denied "
                "too. Detaching a filter and SO_LOCK_FILTER allocate nothing and pass"),
    Allow(("connect", "accept", "accept4", "bind", "listen", "sendto", "recvfrom", "sendmsg",
           "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "getsockname", "getpeername",
           "getsockopt"),
          reason="sockets of the families socket() allows, in the sandbox's own network "
                 "namespace (loopback only), abstract UNIX names included "
                 "(test_LINK_SIBLING_01_abstract_unix_sockets_are_private_to_a_sandbox)"),
    # The system.
    Allow(("uname", "sethostname", "setdomainname", "getrandom", "sysinfo"),
          reason="the sandbox's own UTS namespace, and random bytes; sysinfo shows host-wide "
                 "totals (load, free memory, thread count), which docs/side-channels.md "
                 "lists as observable"),
    Allow(("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
           "lsm_get_self_attr", "lsm_set_self_attr", "lsm_list_modules"),
          reason="a process may only narrow its own access (Landlock needs no_new_privs, "
                 "which the agent has), and read or set its own LSM attributes as the LSM "
                 "policy lets /proc/self/attr do; unlike seccomp filters, none of this is "
                 "JIT-compiled into a host-wide budget"),
    Allow(("statmount", "listmount"),
          reason="the mounts of the caller's own mount namespace, as /proc/self/mountinfo "
                 "shows them; another namespace needs CAP_SYS_ADMIN over it"),
    Allow(("uretprobe", "uprobe"),
          reason="only the kernel's uprobe trampolines make these calls (a host tracer's "
                 "probe on a binary the sandbox runs); anything else that calls them gets "
                 "SIGILL. Linux 6.13 and later pass them past every seccomp filter, and "
                 "denying them would crash a traced program on the kernels before"),
    Deny(("io_uring_setup", "io_uring_enter", "io_uring_register"),
         reason="ESC-IOURING-01: io_uring runs opens, connects and reads inside the kernel "
                "where seccomp never sees them, and has been a leading source of kernel "
                "exploits"),
    Deny(("io_setup", "io_destroy", "io_submit", "io_getevents", "io_pgetevents", "io_cancel"),
         errno=ENOSYS,
         reason="kernel AIO contexts come from one host-wide pool (fs.aio-max-nr): one agent "
                "could take them all from the host and every other sandbox; ENOSYS, and "
                "glibc's POSIX AIO, which uses threads, still works"),
    Deny("userfaultfd",
         reason="ESC-UFFD-01: userfaultfd stalls a kernel copy at a chosen page, the usual "
                "way to win a kernel race"),
    Deny("perf_event_open",
         reason="ESC-PERF-01: hardware counters are side channels across the host, and the "
                "perf subsystem has a long record of kernel bugs"),
    Deny("bpf",
         reason="the eBPF verifier and JIT are large kernel attack surface, a frequent local "
                "privilege escalation"),
    Deny(("keyctl", "add_key", "request_key"),
         reason="kernel keyrings are not isolated by namespaces and have a record of kernel "
                "bugs; an agent has no keys to keep"),
    Deny(("mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
          "fspick", "move_mount", "open_tree", "mount_setattr", "open_tree_attr"),
         reason="FS-SPECIAL-01: the mount tree Karotte built is the agent's view of the "
                "filesystem; new mounts (FUSE, a filesystem image) hang readers and reach "
                "filesystem drivers, and unmounting can uncover what is beneath"),
    Deny(("open_by_handle_at", "name_to_handle_at"),
         reason="file handles open an inode by number, past the mount tree; this was the "
                "'shocker' container escape"),
    Deny(("kexec_load", "kexec_file_load", "reboot", "init_module", "finit_module",
          "delete_module"),
         reason="replacing, rebooting or extending the running kernel; these need host "
                "capabilities, and are denied so that a bug in that check is unreachable"),
    Deny(("swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "vhangup"),
         reason="host-wide administration (swap, process accounting, quotas, terminal "
                "hangup) that no agent needs; denied for the same reason"),
    Deny("syslog",
         reason="the kernel log shows host activity and kernel addresses that help an exploit"),
    Deny(("fanotify_init", "fanotify_mark"),
         reason="filesystem-wide watches see, and with permission events block, file access "
                "by processes outside the sandbox on the same filesystem"),
    Deny("ustat",
         reason="LINK-SIBLING-01: reports the free blocks and inodes of any mounted "
                "filesystem by its device number, past the mount namespace: one sandbox "
                "read another's workspace filling up, a channel between them. Obsolete "
                "(glibc has no wrapper since 2.28); statfs covers the caller's own mounts"),
    Deny(("lookup_dcookie", "nfsservctl", "uselib", "sysfs"),
         reason="obsolete interfaces (profiling cookies, the old NFS server, a.out libraries, "
                "the list of filesystem types) that are now only kernel attack surface"),
    Deny(("iopl", "ioperm", "modify_ldt"),
         reason="x86 port I/O and segment descriptors: raw hardware access, and LDT code "
                "that only 16-bit programs need and that has had kernel bugs"),
    Deny(("_sysctl", "create_module", "get_kernel_syms", "query_module", "getpmsg", "putpmsg",
          "afs_syscall", "tuxcall", "security", "set_thread_area", "get_thread_area",
          "epoll_ctl_old", "epoll_wait_old", "vserver"),
         errno=ENOSYS,
         reason="slots of the x86_64 table that Linux implements as sys_ni_syscall: the "
                "kernel answers ENOSYS and so does the filter, so a kernel that gives one a "
                "meaning (a patched kernel's own call) is not reached through them"),
))

# --- Compiler ---------------------------------------------------------------------------

_BPF_LD_W_ABS = 0x20
_BPF_JA = 0x05
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JSET_K = 0x45
_BPF_RET_K = 0x06
BPF_MAXINSNS = 4096
_MAX_JUMP = 255  # jt and jf are 8 bits; ja takes a 32-bit offset

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
    if not (0 <= jt <= _MAX_JUMP and 0 <= jf <= _MAX_JUMP):
        raise SeccompError(f"internal: BPF jump offset out of range (jt={jt}, jf={jf})")
    return struct.pack("<HBBI", code, jt, jf, k)


def _ret(action: int) -> bytes:
    return _insn(_BPF_RET_K, action)


def _body(deny: Deny) -> list[bytes]:
    """The instructions after a conditional deny's syscall matched; every path returns.

    Because each body returns, the next compare is reached only from the syscall-number
    compare in front of the body, with the accumulator still holding nr. All jumps are
    local to one body, so none can outgrow the 8-bit jt/jf fields.

    Each condition is a block that falls through to the next when it holds and jumps to
    the final ``ret ALLOW`` when it does not; after the last block, ``ret ERRNO``.
    """
    conditions = _conditions(deny.when)
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
    body += [_ret(SECCOMP_RET_ERRNO | deny.errno), _ret(SECCOMP_RET_ALLOW)]
    return body


def _action(entry: Entry | None) -> int:
    """The return value for a syscall whose verdict needs no argument."""
    if isinstance(entry, Allow):
        return SECCOMP_RET_ALLOW
    return SECCOMP_RET_ERRNO | (ENOSYS if entry is None else entry.errno)


def _runs(actions: list[int | None]) -> list[tuple[int, int]]:
    """(first number, action) for each run of equal actions over 0..len-1.

    None (a syscall whose verdict looks at arguments, decided before the search and
    never reaching it) joins the run before it, or the one after at the start."""
    runs: list[tuple[int, int]] = []
    for nr, action in enumerate(actions):
        if action is None:
            continue
        if not runs:
            runs.append((0, action))
        elif runs[-1][1] != action:
            runs.append((nr, action))
    return runs


def _search(runs: list[tuple[int, int]]) -> list[bytes]:
    """A binary search on nr over ``runs``, ending in each run's return.

    One ``jge`` per level: about log2(len(runs)) compares for any syscall. A left half
    too long for the 8-bit jt is jumped over with ``ja``, which takes a 32-bit offset."""
    if len(runs) == 1:
        return [_ret(runs[0][1])]
    middle = len(runs) // 2
    low, high = _search(runs[:middle]), _search(runs[middle:])
    split = runs[middle][0]
    if len(low) <= _MAX_JUMP:
        return [_insn(_BPF_JGE_K, split, jt=len(low), jf=0), *low, *high]
    return [_insn(_BPF_JGE_K, split, jt=0, jf=1), _insn(_BPF_JA, len(low)), *low, *high]


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
    top = policy.reviewed_through

    prog = [
        # Numbers mean something only in the native table: any other ABI is killed
        # before anything looks at nr, or i386's ptrace (26) would pass as x86_64's msync.
        _insn(_BPF_LD_W_ABS, _OFF_ARCH),
        _insn(_BPF_JEQ_K, info.audit_arch, jt=1, jf=0),
        _ret(SECCOMP_RET_KILL_PROCESS),
        _insn(_BPF_LD_W_ABS, _OFF_NR),
    ]
    if info.x32_bit:
        # x32 reaches the same kernel code under nr | 0x40000000, past every compare below.
        prog += [_insn(_BPF_JGE_K, _X32_SYSCALL_BIT, jt=0, jf=1), _ret(SECCOMP_RET_KILL_PROCESS)]
    # SYS-UNREVIEWED-01: a call newer than the review is denied until someone reviews it.
    prog += [_insn(_BPF_JGE_K, top + 1, jt=0, jf=1), _ret(SECCOMP_RET_ERRNO | ENOSYS)]

    # Numbers with no syscall here, and syscalls no entry names, stay ENOSYS.
    actions: list[int | None] = [SECCOMP_RET_ERRNO | ENOSYS] * (top + 1)
    for entry in policy.entries:
        for syscall in entry.syscalls:
            nr = _TABLE[syscall][column]
            if nr is None:
                continue
            if isinstance(entry, Deny) and entry.when is not None:
                # Argument checks come first, in the policy's order: since Linux 5.11 the
                # kernel caches the verdict of every syscall whose outcome does not
                # depend on arguments, so these are the compares that run.
                body = _body(entry)
                prog += [_insn(_BPF_JEQ_K, nr, jt=0, jf=len(body)), *body]
                actions[nr] = None
            else:
                actions[nr] = _action(entry)
    prog += _search(_runs(actions))

    if len(prog) > BPF_MAXINSNS:
        raise SeccompError(f"the compiled filter has {len(prog)} instructions, over the "
                           f"kernel's limit of {BPF_MAXINSNS}; the policy names too many "
                           f"syscalls or values")
    return b"".join(prog)
