/* Spawn of karotte-init: one clone3 with every namespace flag, then exec.
 *
 * The child shares the trainer's memory (CLONE_VM, no fork's page-table copy) and runs
 * only raw syscalls in registers: fd 3 its socket end and every other fd closed, so the
 * trainer's death is EOF; it waits for the go (its id maps are written), becomes root of
 * its user namespace, execs. Why each step: docs/init.md, "The spawn".
 */
#include "spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
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
        "mov $292, %%eax\n\t" /* dup3(child_fd, KAROTTE_CHILD_FD, 0): clears CLOEXEC */
        "mov %%r12, %%rdi\n\t"
        "mov $3, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "js 2f\n\t"
        "mov $436, %%eax\n\t" /* close_range(0, 2, 0): the trainer's stdio */
        "xor %%edi, %%edi\n\t"
        "mov $2, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 2f\n\t"
        "mov $436, %%eax\n\t" /* close_range(4, ~0U, 0): every other fd, child_fd too */
        "mov $4, %%edi\n\t"
        "mov $-1, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 2f\n\t"
        "mov $45, %%eax\n\t" /* recvfrom(3, NULL, 0, MSG_TRUNC, NULL, NULL): wait for go */
        "mov $3, %%edi\n\t"
        "xor %%esi, %%esi\n\t"
        "xor %%edx, %%edx\n\t"
        "mov $0x20, %%r10d\n\t"
        "xor %%r8d, %%r8d\n\t"
        "xor %%r9d, %%r9d\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jle 2f\n\t" /* 0 is EOF: the trainer is gone */
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
        "mov $59, %%eax\n\t" /* execve(path, argv, envp) */
        "mov %%r13, %%rdi\n\t"
        "mov %%r14, %%rsi\n\t"
        "mov %%r15, %%rdx\n\t"
        "syscall\n\t"
        "2:\n\t"
        "mov $231, %%eax\n\t" /* exit_group(127): no go (EOF), no root, or no exec */
        "mov $127, %%edi\n\t"
        "syscall\n\t"
        "1:\n\t"
        : "+r"(rax), "+r"(rdi), "+r"(rsi)
        : "r"(r12), "r"(r13), "r"(r14), "r"(r15)
        : "rcx", "r11", "rdx", "r8", "r9", "r10", "memory", "cc");
    return rax;
}

/* Every clone3 runs in a throwaway thread, so that what it changes stays off the
 * trainer's threads: on cgroup v1 it moves itself into the sandbox's cgroups (no global
 * lock, unlike cgroup.procs), and for a root caller it takes the namespace owner's ids
 * as its effective ids (raw syscalls: this thread only), which also leaves the process
 * non-dumpable while the child shares its memory. The argument: docs/init.md. */
struct spawn_job {
    struct clone_args ca;
    long child_fd;
    const char *path;
    char *const *argv;
    char *const *envp;
    const char *const *tasks;
    const char *freezer_state;
    int64_t owner_uid, owner_gid;
    long result;
    int step;
};

/* A v1 freezer cgroup that is frozen, or being frozen through a parent, would stop
 * the thread the moment it moved in, and the caller with it, in pthread_join. */
static int thawed(const char *state_file)
{
    char buf[16] = {0};
    int fd = open(state_file, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    int err = errno;
    close(fd);
    if (n < 0)
        return -err;
    return strncmp(buf, "THAWED", 6) == 0 ? 0 : -EBUSY;
}

static void *spawn_thread(void *arg)
{
    struct spawn_job *job = arg;
    job->step = KS_SPAWN_CGROUP;
    if (job->freezer_state && (job->result = thawed(job->freezer_state)) < 0)
        return NULL;
    for (const char *const *t = job->tasks; t && *t; t++) {
        int fd = open(*t, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) {
            job->result = -errno;
            if (fd >= 0)
                close(fd);
            return NULL;
        }
        close(fd);
    }
    if (job->owner_uid >= 0) {
        long fsuid = syscall(SYS_setfsuid, -1L), fsgid = syscall(SYS_setfsgid, -1L);
        job->step = KS_SPAWN_OWNER;
        if (syscall(SYS_setresgid, -1L, (long)job->owner_gid, -1L) < 0 ||
            syscall(SYS_setresuid, -1L, (long)job->owner_uid, -1L) < 0) {
            job->result = -errno;
            return NULL;
        }
        syscall(SYS_setfsuid, fsuid);
        syscall(SYS_setfsgid, fsgid);
    }
    job->step = KS_SPAWN_CLONE3;
    job->result = clone3_child_exec(&job->ca, job->child_fd, job->path, job->argv, job->envp);
    return NULL;
}

int karotte_spawn(const char *path, char *const argv[], char *const envp[],
                  int child_fd, int cgroup_fd, char *const tasks[], const char *freezer_state,
                  uint64_t ns_flags, int64_t owner_uid, int64_t owner_gid, int *pidfd_out,
                  int *step_out)
{
    int pidfd = -1;
    struct spawn_job job;
    pthread_t thread;
    sigset_t all, old;
    int err;

    /* dup3 to the same number fails with EINVAL; the caller must pick another fd. */
    if (child_fd == KAROTTE_CHILD_FD || child_fd < 0)
        return -EBADF;

    memset(&job, 0, sizeof(job));
    job.ca.flags = CLONE_VM | CLONE_PIDFD | ns_flags;
    job.ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    job.ca.exit_signal = SIGCHLD;
    if (cgroup_fd >= 0) {
        job.ca.flags |= CLONE_INTO_CGROUP;
        job.ca.cgroup = (uint64_t)cgroup_fd;
    }
    job.child_fd = child_fd;
    job.path = path;
    job.argv = argv;
    job.envp = envp;
    job.tasks = (const char *const *)tasks;
    job.freezer_state = freezer_state;
    job.owner_uid = owner_uid;
    job.owner_gid = owner_gid;

    /* A signal handler running in the child would write to the parent's stack; the
     * thread starts with every signal blocked (it inherits this mask) and the child
     * keeps the full mask through exec; karotte-init sets its own. (SIGKILL and
     * SIGSTOP use no user stack.) */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    /* The default stack: it is only reserved, and glibc places static TLS in it, which
     * a preloaded library can make large. */
    *step_out = KS_SPAWN_THREAD;
    err = pthread_create(&thread, NULL, spawn_thread, &job);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err)
        return -err;
    pthread_join(thread, NULL);
    *step_out = job.step;
    if (job.result < 0)
        return (int)job.result;
    *pidfd_out = pidfd;
    return (int)job.result;
}
