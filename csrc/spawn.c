/* Spawn of karotte-init: one clone3 with every namespace flag, then exec.
 *
 * Why this shape: the host is a trainer process that may hold tens of GiB and many
 * threads. fork() would copy its page tables (latency grows with its size) and the
 * child would run Python-owned memory between fork and exec. Instead the child shares
 * the parent's memory (CLONE_VM) and runs only raw syscalls held in registers: it
 * touches no memory and no stack, so it cannot disturb the parent, which keeps running.
 *
 * The child must exec as root of its new user namespace, or execve would drop the
 * capabilities that init needs to build the mount tree. It can become that root only
 * after the parent has written its uid/gid maps (and, on cgroup v1, placed it in its
 * cgroup), so it first blocks in a zero-length recv on the control socket until the
 * parent sends the go datagram. Then: setresgid(0), setresuid(0), dup3 of the control
 * socket to fd 3, execve; exit_group if any step fails (also when the parent died
 * and the recv returned EOF: the maps are missing and setresgid fails).
 */
#include "spawn.h"

#include <errno.h>
#include <linux/capability.h>
#include <linux/sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__x86_64__)
#error "karotte-spawn: only x86_64 is implemented (the child path is raw syscalls in assembly)"
#endif

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif

static long clone3_child_exec(struct clone_args *ca, long child_fd, const char *path,
                              char *const argv[], char *const envp[])
{
    register long rax asm("rax") = SYS_clone3;
    register long rdi asm("rdi") = (long)ca;
    register long rsi asm("rsi") = (long)sizeof(*ca);
    register long r12 asm("r12") = child_fd;
    register long r13 asm("r13") = (long)path;
    register long r14 asm("r14") = (long)argv;
    register long r15 asm("r15") = (long)envp;
    asm volatile(
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 1f\n\t"
        /* Child: registers only; rcx and r11 are clobbered by syscall, r12-r15 survive. */
        "mov $45, %%eax\n\t" /* recvfrom(child_fd, NULL, 0, 0, NULL, NULL): wait for go */
        "mov %%r12, %%rdi\n\t"
        "xor %%esi, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "xor %%r10d, %%r10d\n\t"
        "xor %%r8d, %%r8d\n\t"
        "xor %%r9d, %%r9d\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "js 2f\n\t"
        "mov $119, %%eax\n\t" /* setresgid(0, 0, 0) */
        "xor %%edi, %%edi\n\t"
        "xor %%esi, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 2f\n\t"
        "mov $117, %%eax\n\t" /* setresuid(0, 0, 0) */
        "xor %%edi, %%edi\n\t"
        "xor %%esi, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 2f\n\t"
        "mov $292, %%eax\n\t" /* dup3(child_fd, KAROTTE_CHILD_FD, 0): clears CLOEXEC */
        "mov %%r12, %%rdi\n\t"
        "mov $3, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "syscall\n\t"
        "mov $59, %%eax\n\t" /* execve(path, argv, envp) */
        "mov %%r13, %%rdi\n\t"
        "mov %%r14, %%rsi\n\t"
        "mov %%r15, %%rdx\n\t"
        "syscall\n\t"
        "2:\n\t"
        "mov $231, %%eax\n\t" /* exit_group(127): no go, no root, or no exec */
        "mov $127, %%edi\n\t"
        "syscall\n\t"
        "1:\n\t"
        : "+r"(rax), "+r"(rdi), "+r"(rsi)
        : "r"(r12), "r"(r13), "r"(r14), "r"(r15)
        : "rcx", "r11", "rdx", "r8", "r9", "r10", "memory", "cc");
    return rax;
}

/* The creator of a user namespace is its owner, and the kernel charges per-user
 * counts made inside it (inotify instances and watches, message-queue bytes, queued
 * signals, nested namespaces) to the creator's uid as well. Created by the trainer's
 * root, every sandbox would draw on root's pools (4 sandboxes took all 128 inotify
 * instances of this host's root, the trainer's included). So a root caller creates it
 * as owner_uid/owner_gid, unused host ids of the sandbox's own range. Raw syscalls:
 * they change the calling thread's credentials only, where glibc's setresuid would
 * change every thread of the trainer. The real and saved ids stay the caller's, so it
 * can take its effective ids back; fsuid goes back to the caller's at once, so that
 * CLONE_INTO_CGROUP's permission check sees the caller. */
struct saved_ids {
    long euid, egid;
    int pdeathsig;
    struct __user_cap_header_struct cap_header;
    struct __user_cap_data_struct caps[2];
};

static int take_owner_ids(int64_t uid, int64_t gid, struct saved_ids *saved)
{
    saved->euid = syscall(SYS_geteuid);
    saved->egid = syscall(SYS_getegid);
    saved->pdeathsig = 0;
    prctl(PR_GET_PDEATHSIG, &saved->pdeathsig, 0, 0, 0);
    saved->cap_header.version = _LINUX_CAPABILITY_VERSION_3;
    saved->cap_header.pid = 0;
    if (syscall(SYS_capget, &saved->cap_header, saved->caps) < 0)
        return -errno;
    if (syscall(SYS_setresgid, -1L, (long)gid, -1L) < 0)
        return -errno;
    if (syscall(SYS_setresuid, -1L, (long)uid, -1L) < 0) {
        int err = errno;
        syscall(SYS_setresgid, -1L, saved->egid, -1L);
        return -err;
    }
    syscall(SYS_setfsuid, saved->euid);
    syscall(SYS_setfsgid, saved->egid);
    return 0;
}

static void give_back_ids(const struct saved_ids *saved)
{
    /* Cannot fail (the real and saved ids are the caller's); if it did, this thread
     * would run the trainer's code under the wrong ids: stop instead. */
    if (syscall(SYS_setresuid, -1L, saved->euid, -1L) < 0 ||
        syscall(SYS_setresgid, -1L, saved->egid, -1L) < 0)
        abort();
    /* Taking euid 0 back made the effective capabilities the permitted ones: put back
     * the set the thread had (it may have dropped some). */
    if (syscall(SYS_capset, &saved->cap_header, saved->caps) < 0)
        abort();
    /* The id change reset the thread's parent-death signal: put it back. It also made
     * the process non-dumpable, and that stays: the child shares our memory until its
     * exec, in a user namespace whose owner has every capability over it, so only a
     * non-dumpable mm keeps the owner uid from attaching to it (the child's own setresuid
     * leaves the trainer non-dumpable anyway, as every spawn did before). */
    prctl(PR_SET_PDEATHSIG, saved->pdeathsig, 0, 0, 0);
}

int karotte_spawn(const char *path, char *const argv[], char *const envp[],
                  int child_fd, int cgroup_fd, uint64_t ns_flags, int64_t owner_uid,
                  int64_t owner_gid, int *pidfd_out)
{
    int pidfd = -1;
    struct clone_args ca;
    struct saved_ids saved;
    sigset_t all, old;
    long ret;

    /* dup3 to the same number fails with EINVAL; the caller must pick another fd. */
    if (child_fd == KAROTTE_CHILD_FD || child_fd < 0)
        return -EBADF;

    memset(&ca, 0, sizeof(ca));
    ca.flags = CLONE_VM | CLONE_PIDFD | ns_flags;
    ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    ca.exit_signal = SIGCHLD;
    if (cgroup_fd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)cgroup_fd;
    }

    /* A signal handler running in the child would write to the parent's stack; block
     * everything across the clone. The child keeps the full mask through exec, and
     * karotte-init sets its own. (SIGKILL and SIGSTOP use no user stack.) */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    if (owner_uid >= 0) {
        ret = take_owner_ids(owner_uid, owner_gid, &saved);
        if (ret < 0) {
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            return (int)ret;
        }
    }
    ret = clone3_child_exec(&ca, child_fd, path, argv, envp);
    if (owner_uid >= 0)
        give_back_ids(&saved);
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    if (ret < 0)
        return (int)ret;
    *pidfd_out = pidfd;
    return (int)ret;
}
