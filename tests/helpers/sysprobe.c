/* sysprobe NAME...   |   sysprobe --list
 *
 * For each NAME, attempts one kernel operation and prints "NAME RESULT" on its own line:
 *   OK                 the call succeeded
 *   EPERM, ENOSYS ...  the call failed with that errno
 *   killed:SIGSYS ...  the process making the call was killed by that signal
 *   UNSUPPORTED        the operation does not exist on this architecture
 *   UNKNOWN            no probe has that name (exit status 2 at the end)
 *
 * Every probe runs in a child of its own, so that a kill, a changed persona or a new
 * namespace stays in that child and the next probe starts clean. Arguments are chosen
 * so that the call, if it is allowed at all, fails harmlessly or does nothing lasting:
 * nonexistent paths and pids, fd -1, bad magic numbers, invalid flags. It is safe to
 * run on a host as root; it does not need the Karotte filter, which is what lets tests
 * compare results with and without it.
 *
 * Self-contained on purpose (no libc extensions beyond glibc/musl basics; static when
 * the build allows) so that the same binary runs inside a sandbox.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

/* Numbers newer than some libc headers; from 424 on they are the same on every
 * architecture this probe targets. */
#ifndef __NR_pidfd_getfd
#define __NR_pidfd_getfd 438
#endif
#ifndef __NR_clone3
#define __NR_clone3 435
#endif
#ifndef __NR_mount_setattr
#define __NR_mount_setattr 442
#endif
#ifndef __NR_quotactl_fd
#define __NR_quotactl_fd 443
#endif
#ifndef __NR_open_tree_attr
#define __NR_open_tree_attr 467
#endif
#ifndef __NR_process_madvise
#define __NR_process_madvise 440
#endif
#ifndef __NR_memfd_secret
#define __NR_memfd_secret 447
#endif
#ifndef __NR_process_mrelease
#define __NR_process_mrelease 448
#endif
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif
#ifndef AF_ALG
#define AF_ALG 38
#endif
#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif
#ifndef TIOCLINUX
#define TIOCLINUX 0x541C
#endif
#ifndef SO_ATTACH_REUSEPORT_CBPF
#define SO_ATTACH_REUSEPORT_CBPF 51
#endif
#ifndef SO_ATTACH_REUSEPORT_EBPF
#define SO_ATTACH_REUSEPORT_EBPF 52
#endif
#ifndef SO_LOCK_FILTER
#define SO_LOCK_FILTER 44
#endif
#ifndef SECCOMP_FILTER_FLAG_NEW_LISTENER
#define SECCOMP_FILTER_FLAG_NEW_LISTENER (1UL << 3)
#endif

#define NOWHERE "/nonexistent/karotte-probe"
#define NO_PID 0x7fffffff /* above any pid_max */
#define PROBE_TIMEOUT_S 10
#define HIGH_BITS (1UL << 32) /* set in the high word of a 64-bit argument */

/* ---- probes: return >= 0 on success, -1 with errno set on failure ---- */

static long wait_ok(pid_t pid)
{
    int status;
    /* __WALL: a child whose exit signal is not SIGCHLD is waited for too. */
    while (waitpid(pid, &status, __WALL) < 0) {
        if (errno != EINTR)
            return -1;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        return 0;
    errno = ECHILD;
    return -1;
}

/* clone(2) without a new stack: the child runs on a copy of ours, like fork. */
static long clone_with(unsigned long flags)
{
    long pid = syscall(SYS_clone, flags, 0UL, 0UL, 0UL, 0UL);
    if (pid < 0)
        return -1;
    if (pid == 0)
        _exit(0);
    return wait_ok((pid_t)pid);
}

static long p_getpid(void) { return getpid(); }

static long p_fork(void)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0)
        _exit(0);
    return wait_ok(pid);
}

static void *thread_main(void *arg) { return arg; }

static long p_thread(void)
{
    pthread_t t;
    int rc = pthread_create(&t, NULL, thread_main, NULL);
    if (rc != 0) {
        errno = rc;
        return -1;
    }
    pthread_join(t, NULL);
    return 0;
}

static long p_clone_plain(void) { return clone_with(SIGCHLD); }
static long p_clone_newns(void) { return clone_with(CLONE_NEWNS | SIGCHLD); }
static long p_clone_newcgroup(void) { return clone_with(CLONE_NEWCGROUP | SIGCHLD); }
static long p_clone_newuts(void) { return clone_with(CLONE_NEWUTS | SIGCHLD); }
static long p_clone_newipc(void) { return clone_with(CLONE_NEWIPC | SIGCHLD); }
static long p_clone_newuser(void) { return clone_with(CLONE_NEWUSER | SIGCHLD); }
static long p_clone_newpid(void) { return clone_with(CLONE_NEWPID | SIGCHLD); }
static long p_clone_newnet(void) { return clone_with(CLONE_NEWNET | SIGCHLD); }
/* In clone(2) this bit lies in the exit-signal byte; the kernel ignores it there. */
static long p_clone_newtime(void) { return clone_with(CLONE_NEWTIME | SIGCHLD); }
/* A NULL, zero-size clone_args: the kernel rejects it without creating anything. */
static long p_clone3(void) { return syscall(__NR_clone3, NULL, 0UL); }
/* No flags: a no-op when allowed; the filter denies unshare whatever the flags. */
static long p_unshare(void) { return unshare(0); }
static long p_unshare_user(void) { return unshare(CLONE_NEWUSER); }
static long p_unshare_mount(void) { return unshare(CLONE_NEWNS); }
static long p_setns(void) { return setns(-1, 0); }

static long p_ptrace(void) { return syscall(SYS_ptrace, 16L /* PTRACE_ATTACH */, NO_PID, 0L, 0L); }

static long vm_rw(long nr)
{
    char buf[8];
    struct iovec local = {buf, sizeof(buf)}, remote = {buf, sizeof(buf)};
    return syscall(nr, NO_PID, &local, 1UL, &remote, 1UL, 0UL);
}
static long p_process_vm_readv(void) { return vm_rw(SYS_process_vm_readv); }
static long p_process_vm_writev(void) { return vm_rw(SYS_process_vm_writev); }
static long p_pidfd_getfd(void) { return syscall(__NR_pidfd_getfd, -1, 0, 0); }
static long p_kcmp(void) { return syscall(SYS_kcmp, getpid(), getpid(), 0x7fff, 0UL, 0UL); }

static long p_perf_event_open(void) { return syscall(SYS_perf_event_open, NULL, 0, -1, -1, 0UL); }
static long p_bpf(void) { return syscall(SYS_bpf, 0x7fff, NULL, 0); }
/* Invalid flags (UFFD_USER_MODE_ONLY among them, so no privilege is needed to get EINVAL). */
static long p_userfaultfd(void) { return syscall(SYS_userfaultfd, 0x7fffffff); }
/* Kernel AIO with an invalid context or count: EINVAL unless a filter answers first. */
static long p_io_setup(void) { return syscall(SYS_io_setup, 0, NULL); }
static long p_io_destroy(void) { return syscall(SYS_io_destroy, 0UL); }
static long p_io_submit(void) { return syscall(SYS_io_submit, 0UL, 0L, NULL); }
static long p_io_getevents(void) { return syscall(SYS_io_getevents, 0UL, 0L, 0L, NULL, NULL); }
static long p_io_pgetevents(void) { return syscall(SYS_io_pgetevents, 0UL, 0L, 0L, NULL, NULL, NULL); }
static long p_io_cancel(void) { return syscall(SYS_io_cancel, 0UL, NULL, NULL); }
static long p_keyctl(void) { return syscall(SYS_keyctl, 0x7fff, 0UL, 0UL, 0UL, 0UL); }
static long p_add_key(void) { return syscall(SYS_add_key, NULL, NULL, NULL, 0UL, 0); }
static long p_request_key(void) { return syscall(SYS_request_key, NULL, NULL, NULL, 0); }

static long p_io_uring_setup(void) { return syscall(SYS_io_uring_setup, 0U, NULL); }
static long p_io_uring_enter(void) { return syscall(SYS_io_uring_enter, -1, 0U, 0U, 0U, NULL, 0UL); }
static long p_io_uring_register(void) { return syscall(SYS_io_uring_register, -1, 0U, NULL, 0U); }

static long p_mount(void) { return syscall(SYS_mount, "none", NOWHERE, "tmpfs", 0UL, NULL); }
static long p_umount2(void) { return syscall(SYS_umount2, NOWHERE, 0); }
static long p_pivot_root(void) { return syscall(SYS_pivot_root, NOWHERE "/a", NOWHERE "/b"); }
static long p_chroot(void) { return syscall(SYS_chroot, NOWHERE); }
static long p_fsopen(void) { return syscall(SYS_fsopen, "karotte-no-such-fs", 0U); }
static long p_fsconfig(void) { return syscall(SYS_fsconfig, -1, 0U, NULL, NULL, 0); }
static long p_fsmount(void) { return syscall(SYS_fsmount, -1, 0U, 0U); }
static long p_fspick(void) { return syscall(SYS_fspick, AT_FDCWD, NOWHERE, 0U); }
static long p_move_mount(void) { return syscall(SYS_move_mount, -1, "", -1, "", 0U); }
static long p_open_tree(void) { return syscall(SYS_open_tree, AT_FDCWD, NOWHERE, 0U); }
static long p_mount_setattr(void) { return syscall(__NR_mount_setattr, -1, "", 0U, NULL, 0UL); }
static long p_open_tree_attr(void)
{
    return syscall(__NR_open_tree_attr, AT_FDCWD, NOWHERE, 0U, NULL, 0UL);
}

static long p_open_by_handle_at(void) { return syscall(SYS_open_by_handle_at, -1, NULL, 0); }
static long p_name_to_handle_at(void)
{
    return syscall(SYS_name_to_handle_at, AT_FDCWD, NOWHERE, NULL, NULL, 0);
}

/* More segments than the kernel accepts: rejected before anything is loaded or unloaded. */
static long p_kexec_load(void) { return syscall(SYS_kexec_load, 0UL, ULONG_MAX, NULL, 0UL); }
static long p_kexec_file_load(void) { return syscall(SYS_kexec_file_load, -1, -1, 0UL, NULL, ULONG_MAX); }
/* Bad magic numbers: the kernel refuses before it looks at the command. */
static long p_reboot(void) { return syscall(SYS_reboot, 0, 0, 0U, NULL); }
static long p_init_module(void) { return syscall(SYS_init_module, NULL, 0UL, ""); }
static long p_finit_module(void) { return syscall(SYS_finit_module, -1, "", 0); }
static long p_delete_module(void) { return syscall(SYS_delete_module, "karotte_no_such_module", O_NONBLOCK); }
static long p_swapon(void) { return syscall(SYS_swapon, NOWHERE, 0); }
static long p_swapoff(void) { return syscall(SYS_swapoff, NOWHERE); }
static long p_acct(void) { return syscall(SYS_acct, NOWHERE); }
static long p_quotactl(void) { return syscall(SYS_quotactl, 0, NOWHERE, 0, NULL); }
static long p_quotactl_fd(void) { return syscall(__NR_quotactl_fd, -1, 0U, 0, NULL); }
/* SYSLOG_ACTION_SIZE_BUFFER: reads the buffer size, changes nothing. */
static long p_syslog(void) { return syscall(SYS_syslog, 10, NULL, 0); }
static long p_vhangup(void)
{
    /* Drop the controlling terminal first, so that an allowed vhangup hangs up nothing.
     * setsid cannot fail here: a freshly forked child never leads a process group. */
    if (setsid() < 0)
        return -1;
    return syscall(SYS_vhangup);
}
static long p_lookup_dcookie(void) { return syscall(SYS_lookup_dcookie, 0UL, NULL, 0UL); }
static long p_nfsservctl(void) { return syscall(SYS_nfsservctl, 0, NULL, NULL); }

/* Invalid clock, NULL pointers: nothing is set. */
static long p_clock_settime(void) { return syscall(SYS_clock_settime, -1, NULL); }
static long p_settimeofday(void) { return syscall(SYS_settimeofday, NULL, NULL); }
static long p_adjtimex(void) { return syscall(SYS_adjtimex, NULL); }
static long p_clock_adjtime(void) { return syscall(SYS_clock_adjtime, -1, NULL); }
static long p_fanotify_init(void) { return syscall(SYS_fanotify_init, 0xffffffffU, 0U); }
static long p_fanotify_mark(void) { return syscall(SYS_fanotify_mark, -1, 0U, 0ULL, AT_FDCWD, NULL); }

/* fd -1, invalid flags, a device number no filesystem has: nothing is read or made. */
static long p_cachestat(void) { return syscall(__NR_cachestat, -1, NULL, NULL, 0U); }
static long p_memfd_secret(void) { return syscall(__NR_memfd_secret, 0xffffffffU); }
static long p_process_madvise(void) { return syscall(__NR_process_madvise, -1, NULL, 0UL, 0, 0U); }
static long p_process_mrelease(void) { return syscall(__NR_process_mrelease, -1, 0U); }
/* sync has no argument to make it fail: it flushes the host's dirty data once, which is
 * harmless; syncfs of fd -1 is EBADF when it reaches the kernel. */
static long p_sync(void) { return syscall(SYS_sync); }
static long p_syncfs(void) { return syscall(SYS_syncfs, -1); }

/* One instruction that accepts everything: SECCOMP_RET_ALLOW to seccomp, "keep the whole
 * packet" to a socket. Loading it is what costs a JIT allocation; it changes nothing. */
static struct sock_filter accept_all[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};
static struct sock_fprog accept_all_prog = {1, accept_all};

/* A filter is loaded into this probe's own child only, and goes with it. no_new_privs is
 * what lets an unprivileged process load one (as in the sandbox, where it is set). */
static long load_seccomp(unsigned long op, unsigned long flags)
{
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return -1;
    long fd = syscall(SYS_seccomp, op, flags, &accept_all_prog);
    if (fd > 0 && (flags & SECCOMP_FILTER_FLAG_NEW_LISTENER))
        close((int)fd);
    return fd;
}
static long p_seccomp_filter(void) { return load_seccomp(SECCOMP_SET_MODE_FILTER, 0); }
static long p_seccomp_filter_listener(void)
{
    return load_seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER);
}
static long p_prctl_seccomp_filter(void)
{
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &accept_all_prog);
}
static long p_seccomp_action_avail(void)
{
    unsigned int action = SECCOMP_RET_ALLOW;
    return syscall(SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0U, &action);
}
static long p_prctl_set_name(void) { return prctl(PR_SET_NAME, "sysprobe", 0, 0, 0); }

static const int one = 1;
static const int no_prog_fd = -1;

/* setsockopt(level, optname) on a fresh UDP socket, with SO_REUSEPORT set first when
 * reuseport is true (a reuseport filter needs it). */
static long on_udp_socket(int reuseport, long level, long optname, const void *val,
                          socklen_t len)
{
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    long rc = reuseport ? setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) : 0;
    if (rc == 0)
        rc = syscall(SYS_setsockopt, fd, level, optname, val, (long)len);
    int saved = errno;
    close(fd);
    errno = saved;
    return rc;
}
static long p_setsockopt_attach_filter(void)
{
    return on_udp_socket(0, SOL_SOCKET, SO_ATTACH_FILTER, &accept_all_prog,
                         sizeof(accept_all_prog));
}
static long p_setsockopt_attach_reuseport_cbpf(void)
{
    return on_udp_socket(1, SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, &accept_all_prog,
                         sizeof(accept_all_prog));
}
/* The eBPF variants take a program fd from bpf(); -1 is none (EBADF without a filter). */
static long p_setsockopt_attach_bpf(void)
{
    return on_udp_socket(0, SOL_SOCKET, SO_ATTACH_BPF, &no_prog_fd, sizeof(no_prog_fd));
}
static long p_setsockopt_attach_reuseport_ebpf(void)
{
    return on_udp_socket(1, SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, &no_prog_fd,
                         sizeof(no_prog_fd));
}
static long p_setsockopt_lock_filter(void)
{
    return on_udp_socket(0, SOL_SOCKET, SO_LOCK_FILTER, &one, sizeof(one));
}
static long p_setsockopt_detach_filter(void)
{
    return on_udp_socket(0, SOL_SOCKET, SO_DETACH_FILTER, &one, sizeof(one));
}
static long p_setsockopt_reuseaddr(void)
{
    return on_udp_socket(0, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
}

/* fd -1: without a filter the kernel answers EBADF, so an OK is the filter's no-op. */
static long fadvise_badfd(unsigned long advice)
{
    return syscall(SYS_fadvise64, -1, 0L, 0L, advice);
}
static long p_fadvise_dontneed_badfd(void) { return fadvise_badfd(POSIX_FADV_DONTNEED); }
static long p_fadvise_willneed_badfd(void) { return fadvise_badfd(POSIX_FADV_WILLNEED); }
static long p_fadvise_noreuse_badfd(void) { return fadvise_badfd(POSIX_FADV_NOREUSE); }

static long with_pipe(unsigned long cmd)
{
    int fds[2];
    long buf[4] = {0}; /* room for what either command writes */
    if (pipe(fds) < 0)
        return -1;
    long rc = syscall(SYS_ioctl, fds[0], cmd, buf);
    int saved = errno;
    close(fds[0]);
    close(fds[1]);
    errno = saved;
    return rc;
}
static long p_ioctl_fionread(void) { return with_pipe(FIONREAD); }
static long p_ioctl_tiocgwinsz(void) { return with_pipe(TIOCGWINSZ); }
/* fd -1: even without a filter, no byte reaches any terminal. */
static long p_ioctl_tiocsti(void) { char c = '\n'; return syscall(SYS_ioctl, -1, (unsigned long)TIOCSTI, &c); }
static long p_ioctl_tioclinux(void) { char c = 3; return syscall(SYS_ioctl, -1, (unsigned long)TIOCLINUX, &c); }
#if ULONG_MAX > 0xffffffffUL
static long p_ioctl_fionread_hibits(void) { return with_pipe(HIGH_BITS | FIONREAD); }
static long p_ioctl_tiocsti_hibits(void)
{
    char c = '\n';
    return syscall(SYS_ioctl, -1, HIGH_BITS | TIOCSTI, &c);
}
static long p_ioctl_tioclinux_hibits(void)
{
    char c = 3;
    return syscall(SYS_ioctl, -1, HIGH_BITS | TIOCLINUX, &c);
}
static long p_socket_netlink_hibits(void)
{
    long fd = syscall(SYS_socket, HIGH_BITS | AF_NETLINK, (unsigned long)SOCK_RAW, 0UL);
    if (fd >= 0)
        close((int)fd);
    return fd < 0 ? -1 : 0;
}
static long p_seccomp_filter_hibits(void)
{
    return load_seccomp(HIGH_BITS | SECCOMP_SET_MODE_FILTER, 0);
}
static long p_prctl_seccomp_filter_hibits(void)
{
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return -1;
    return syscall(SYS_prctl, HIGH_BITS | PR_SET_SECCOMP, (unsigned long)SECCOMP_MODE_FILTER,
                   &accept_all_prog, 0UL, 0UL);
}
static long p_setsockopt_attach_filter_hibits(void)
{
    return on_udp_socket(0, (long)(HIGH_BITS | SOL_SOCKET),
                         (long)(HIGH_BITS | SO_ATTACH_FILTER), &accept_all_prog,
                         sizeof(accept_all_prog));
}
static long p_fadvise_dontneed_hibits_badfd(void)
{
    return fadvise_badfd(HIGH_BITS | POSIX_FADV_DONTNEED);
}
#define HIBITS(f) f
#else
#define HIBITS(f) NULL
#endif

static long try_socket(int domain, int type)
{
    int fd = socket(domain, type | SOCK_CLOEXEC, 0);
    if (fd >= 0)
        close(fd);
    return fd < 0 ? -1 : 0;
}
static long p_socket_unix(void) { return try_socket(AF_UNIX, SOCK_STREAM); }
static long p_socket_inet(void) { return try_socket(AF_INET, SOCK_STREAM); }
static long p_socket_inet6(void) { return try_socket(AF_INET6, SOCK_STREAM); }
static long p_socket_netlink(void) { return try_socket(AF_NETLINK, SOCK_RAW); }
static long p_socket_packet(void) { return try_socket(AF_PACKET, SOCK_DGRAM); }
static long p_socket_alg(void) { return try_socket(AF_ALG, SOCK_SEQPACKET); }
static long p_socket_vsock(void) { return try_socket(AF_VSOCK, SOCK_STREAM); }

static long try_socketpair(int domain, int type)
{
    int sv[2];
    if (socketpair(domain, type | SOCK_CLOEXEC, 0, sv) < 0)
        return -1;
    close(sv[0]);
    close(sv[1]);
    return 0;
}
static long p_socketpair_unix(void) { return try_socketpair(AF_UNIX, SOCK_STREAM); }
static long p_socketpair_netlink(void) { return try_socketpair(AF_NETLINK, SOCK_RAW); }

static long p_personality_query(void) { return syscall(SYS_personality, 0xffffffffUL); }
static long p_personality_linux(void) { return syscall(SYS_personality, (unsigned long)PER_LINUX); }
static long p_personality_bad(void) { return syscall(SYS_personality, (unsigned long)ADDR_NO_RANDOMIZE); }
static long p_personality_read_implies_exec(void)
{
    return syscall(SYS_personality, (unsigned long)READ_IMPLIES_EXEC);
}

#if defined(__x86_64__)
static long p_iopl(void) { return syscall(SYS_iopl, 4); /* levels are 0..3 */ }
static long p_ioperm(void) { return syscall(SYS_ioperm, 0x10000UL, 1UL, 0); /* past the last port */ }
static long p_modify_ldt(void) { char buf[8]; return syscall(SYS_modify_ldt, 0, buf, 0UL); /* read 0 bytes */ }
static long p_uselib(void) { return syscall(SYS_uselib, NOWHERE); }
static long p_ustat(void) { char buf[32]; return syscall(SYS_ustat, 0xfffffUL, buf); }
static long p_sysfs(void) { return syscall(SYS_sysfs, 99, 0UL, 0UL); }
/* Slots of the x86_64 table that Linux implements as sys_ni_syscall. */
static long p__sysctl(void) { return syscall(156, NULL); }
static long p_create_module(void) { return syscall(174, NULL, 0UL); }
static long p_get_kernel_syms(void) { return syscall(177, NULL); }
static long p_query_module(void) { return syscall(178, NULL, 0, NULL, 0UL, NULL); }
static long p_getpmsg(void) { return syscall(181, -1, NULL, NULL, NULL, NULL); }
static long p_putpmsg(void) { return syscall(182, -1, NULL, NULL, 0, 0); }
static long p_afs_syscall(void) { return syscall(183, 0, 0, 0, 0, 0); }
static long p_tuxcall(void) { return syscall(184, 0, 0, 0); }
static long p_security(void) { return syscall(185, 0, 0, 0); }
static long p_set_thread_area(void) { return syscall(205, NULL); }
static long p_get_thread_area(void) { return syscall(211, NULL); }
static long p_epoll_ctl_old(void) { return syscall(214, -1, 0, -1, NULL); }
static long p_epoll_wait_old(void) { return syscall(215, -1, NULL, 0, 0); }
static long p_vserver(void) { return syscall(236, 0, 0, 0); }
/* getpid through the x32 table (nr | 0x40000000). */
static long p_x32_getpid(void) { return syscall(0x40000000L | SYS_getpid); }
/* getpid through the i386 table: int 0x80 from a 64-bit process, eax = 20. */
static long p_i386_getpid(void)
{
    long ret = 20;
    __asm__ volatile("int $0x80" : "+a"(ret) : : "memory", "r8", "r9", "r10", "r11");
    if (ret < 0 && ret > -4096) {
        errno = (int)-ret;
        return -1;
    }
    return ret;
}
#define X86(f) f
#else
#define X86(f) NULL
#endif

struct probe {
    const char *name;
    long (*run)(void); /* NULL: not on this architecture */
};

#define P(name) {#name, p_##name}
static const struct probe probes[] = {
    P(getpid), P(fork), P(thread), P(clone_plain),
    P(clone_newns), P(clone_newcgroup), P(clone_newuts), P(clone_newipc),
    P(clone_newuser), P(clone_newpid), P(clone_newnet), P(clone_newtime),
    P(clone3), P(unshare), P(unshare_user), P(unshare_mount), P(setns),
    P(ptrace), P(process_vm_readv), P(process_vm_writev), P(pidfd_getfd), P(kcmp),
    P(perf_event_open), P(bpf), P(userfaultfd), P(keyctl), P(add_key), P(request_key),
    P(io_uring_setup), P(io_uring_enter), P(io_uring_register),
    P(io_setup), P(io_destroy), P(io_submit), P(io_getevents), P(io_pgetevents), P(io_cancel),
    P(mount), P(umount2), P(pivot_root), P(chroot), P(fsopen), P(fsconfig), P(fsmount),
    P(fspick), P(move_mount), P(open_tree), P(mount_setattr), P(open_tree_attr),
    P(open_by_handle_at), P(name_to_handle_at),
    P(kexec_load), P(kexec_file_load), P(reboot), P(init_module), P(finit_module),
    P(delete_module), P(swapon), P(swapoff), P(acct), P(quotactl), P(quotactl_fd),
    P(syslog), P(vhangup), P(lookup_dcookie), P(nfsservctl),
    P(clock_settime), P(settimeofday), P(adjtimex), P(clock_adjtime), P(fanotify_init),
    P(fanotify_mark), P(cachestat), P(memfd_secret), P(process_madvise), P(process_mrelease),
    P(sync), P(syncfs),
    P(ioctl_fionread), P(ioctl_tiocgwinsz), P(ioctl_tiocsti), P(ioctl_tioclinux),
    {"ioctl_fionread_hibits", HIBITS(p_ioctl_fionread_hibits)},
    {"ioctl_tiocsti_hibits", HIBITS(p_ioctl_tiocsti_hibits)},
    {"ioctl_tioclinux_hibits", HIBITS(p_ioctl_tioclinux_hibits)},
    P(socket_unix), P(socket_inet), P(socket_inet6), P(socket_netlink), P(socket_packet),
    P(socket_alg), P(socket_vsock),
    {"socket_netlink_hibits", HIBITS(p_socket_netlink_hibits)},
    P(socketpair_unix), P(socketpair_netlink),
    P(personality_query), P(personality_linux), P(personality_bad),
    P(personality_read_implies_exec),
    P(seccomp_filter), P(seccomp_filter_listener), P(prctl_seccomp_filter),
    P(seccomp_action_avail), P(prctl_set_name),
    {"seccomp_filter_hibits", HIBITS(p_seccomp_filter_hibits)},
    {"prctl_seccomp_filter_hibits", HIBITS(p_prctl_seccomp_filter_hibits)},
    P(setsockopt_attach_filter), P(setsockopt_attach_reuseport_cbpf), P(setsockopt_attach_bpf),
    P(setsockopt_attach_reuseport_ebpf), P(setsockopt_lock_filter), P(setsockopt_detach_filter),
    P(setsockopt_reuseaddr),
    {"setsockopt_attach_filter_hibits", HIBITS(p_setsockopt_attach_filter_hibits)},
    P(fadvise_dontneed_badfd), P(fadvise_willneed_badfd), P(fadvise_noreuse_badfd),
    {"fadvise_dontneed_hibits_badfd", HIBITS(p_fadvise_dontneed_hibits_badfd)},
    {"iopl", X86(p_iopl)}, {"ioperm", X86(p_ioperm)}, {"modify_ldt", X86(p_modify_ldt)},
    {"uselib", X86(p_uselib)}, {"x32_getpid", X86(p_x32_getpid)},
    {"ustat", X86(p_ustat)}, {"sysfs", X86(p_sysfs)}, {"_sysctl", X86(p__sysctl)},
    {"create_module", X86(p_create_module)}, {"get_kernel_syms", X86(p_get_kernel_syms)},
    {"query_module", X86(p_query_module)}, {"getpmsg", X86(p_getpmsg)},
    {"putpmsg", X86(p_putpmsg)}, {"afs_syscall", X86(p_afs_syscall)},
    {"tuxcall", X86(p_tuxcall)}, {"security", X86(p_security)},
    {"set_thread_area", X86(p_set_thread_area)}, {"get_thread_area", X86(p_get_thread_area)},
    {"epoll_ctl_old", X86(p_epoll_ctl_old)}, {"epoll_wait_old", X86(p_epoll_wait_old)},
    {"vserver", X86(p_vserver)},
    {"i386_getpid", X86(p_i386_getpid)},
};
#define NPROBES (sizeof(probes) / sizeof(probes[0]))

/* ---- names ---- */

#define N(e) {e, #e}
static const struct { int num; const char *name; } errnames[] = {
    N(EPERM), N(ENOENT), N(ESRCH), N(EINTR), N(EIO), N(ENXIO), N(E2BIG), N(ENOEXEC),
    N(EBADF), N(ECHILD), N(EAGAIN), N(ENOMEM), N(EACCES), N(EFAULT), N(EBUSY), N(EEXIST),
    N(EXDEV), N(ENODEV), N(ENOTDIR), N(EISDIR), N(EINVAL), N(ENFILE), N(EMFILE), N(ENOTTY),
    N(ETXTBSY), N(EFBIG), N(ENOSPC), N(ESPIPE), N(EROFS), N(EMLINK), N(EPIPE), N(ERANGE),
    N(ENAMETOOLONG), N(ENOSYS), N(ENOTEMPTY), N(ELOOP), N(ENOKEY), N(EKEYREJECTED),
    N(EOPNOTSUPP), N(EPROTONOSUPPORT), N(ESOCKTNOSUPPORT), N(EPFNOSUPPORT),
    N(EAFNOSUPPORT), N(EPROTOTYPE), N(ENOTSOCK), N(EOVERFLOW), N(ENOPKG),
    N(EUSERS),
};
static const struct { int num; const char *name; } signames[] = {
    N(SIGSYS), N(SIGSEGV), N(SIGKILL), N(SIGILL), N(SIGBUS), N(SIGABRT), N(SIGTRAP),
    N(SIGALRM), N(SIGFPE), N(SIGTERM), N(SIGHUP), N(SIGPIPE), N(SIGXCPU),
};

static void errname(int e, char *out, size_t size)
{
    for (size_t i = 0; i < sizeof(errnames) / sizeof(errnames[0]); i++) {
        if (errnames[i].num == e) {
            snprintf(out, size, "%s", errnames[i].name);
            return;
        }
    }
    snprintf(out, size, "E%d", e);
}

static void signame(int s, char *out, size_t size)
{
    for (size_t i = 0; i < sizeof(signames) / sizeof(signames[0]); i++) {
        if (signames[i].num == s) {
            snprintf(out, size, "killed:%s", signames[i].name);
            return;
        }
    }
    snprintf(out, size, "killed:SIG%d", s);
}

/* ---- driver ---- */

/* Runs one probe in a child; the child reports its result over a pipe, and a kill is
 * read from the wait status. */
static void run_probe(const struct probe *p, char *result, size_t size)
{
    int fds[2];
    if (pipe(fds) < 0) {
        snprintf(result, size, "probe-error:pipe:%d", errno);
        return;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(result, size, "probe-error:fork:%d", errno);
        close(fds[0]);
        close(fds[1]);
        return;
    }
    if (pid == 0) {
        close(fds[0]);
        alarm(PROBE_TIMEOUT_S); /* a probe that blocks shows up as killed:SIGALRM */
        errno = 0;
        long rc = p->run();
        char out[64];
        if (rc < 0)
            errname(errno, out, sizeof(out));
        else
            snprintf(out, sizeof(out), "OK");
        ssize_t unused = write(fds[1], out, strlen(out));
        (void)unused;
        _exit(0);
    }
    close(fds[1]);
    size_t have = 0;
    for (;;) {
        ssize_t n = read(fds[0], result + have, size - 1 - have);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        have += (size_t)n;
        if (have == size - 1)
            break;
    }
    result[have] = '\0';
    close(fds[0]);

    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            snprintf(result, size, "probe-error:waitpid:%d", errno);
            return;
        }
    }
    if (WIFSIGNALED(status))
        signame(WTERMSIG(status), result, size);
    else if (have == 0)
        snprintf(result, size, "exit:%d", WEXITSTATUS(status));
}

int main(int argc, char *argv[])
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s NAME... | --list\n", argv[0]);
        return 2;
    }
    if (strcmp(argv[1], "--list") == 0) {
        for (size_t i = 0; i < NPROBES; i++)
            printf("%s\n", probes[i].name);
        return 0;
    }
    int status = 0;
    for (int a = 1; a < argc; a++) {
        const struct probe *p = NULL;
        for (size_t i = 0; i < NPROBES; i++) {
            if (strcmp(probes[i].name, argv[a]) == 0)
                p = &probes[i];
        }
        char result[96];
        if (p == NULL) {
            snprintf(result, sizeof(result), "UNKNOWN");
            status = 2;
        } else if (p->run == NULL) {
            snprintf(result, sizeof(result), "UNSUPPORTED");
        } else {
            run_probe(p, result, sizeof(result));
        }
        printf("%s %s\n", argv[a], result);
        fflush(stdout);
    }
    return status;
}
