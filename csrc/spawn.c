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
 * cgroup), so it blocks in a recv on the control socket until the parent sends the go
 * datagram. Then: setresgid(0), setresuid(0), execve; exit_group if any step fails.
 *
 * It dies with its parent. clone3 copies the trainer's whole fd table into the child
 * (no CLONE_FILES), the parent ends of every other sandbox's control socket included,
 * and a child waiting for its go with those copies kept every init of the trainer
 * from ever seeing EOF when the trainer was SIGKILLed (and kept its memory mapped).
 * So before it waits, the child moves its end of the socket to fd 3 and closes every
 * other fd (two close_range calls, Linux 5.9+). Then only the trainer holds the
 * parent end, and the trainer's death is EOF: the recv returns 0 (MSG_TRUNC makes
 * the go itself return its length, never 0) and the child exits without exec. An
 * init that has exec'd sees the same EOF and exits, and with it its PID namespace.
 * PR_SET_PDEATHSIG cannot do this: it fires when the creating thread exits, and the
 * clone3 runs in a thread that ends right after it (below). The one window in which
 * a child holds another sandbox's parent end is between its clone3 and its
 * close_range: three syscalls that never block, so another init's EOF is at most that
 * late.
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

/* Every clone3 runs in a thread of its own, created for it and ended after it, for two
 * things that change the calling thread's state, which the trainer's threads must not
 * see:
 *
 * - cgroup v1: the thread first moves itself into the sandbox's cgroups by writing "0"
 *   to each hierarchy's `tasks` file, so the child starts in them. The kernel moves a
 *   thread that moves itself without the global lock that writing another process's
 *   pid to cgroup.procs takes for writing (cgroup_threadgroup_rwsem); on an idle
 *   machine that lock waits for an RCU grace period, 7 to 14 ms here. A throwaway
 *   thread is never the thread-group leader, whose memory cgroup would decide where
 *   the whole trainer's memory is charged, and it never has to move back.
 * - the user namespace's owner: the creator of a user namespace owns it, and the kernel
 *   charges per-user counts made inside it (inotify instances and watches, message-queue
 *   bytes, queued signals, nested namespaces) to the creator's uid as well. Created by
 *   the trainer's root, every sandbox would draw on root's pools (4 sandboxes took all
 *   128 inotify instances of this host's root, the trainer's included). So a root
 *   caller's thread takes owner_uid/owner_gid, host ids of this sandbox's own (no host
 *   account's; the agent runs as owner_uid inside), as its effective ids for the clone3. Raw syscalls change this thread only (glibc's
 *   setresuid would change every thread); fsuid stays the caller's, so that
 *   CLONE_INTO_CGROUP's permission check sees the caller. The change of effective ids
 *   also makes the process non-dumpable, and that stays so: the child shares the
 *   trainer's memory until its exec, in a user namespace whose owner has every
 *   capability over it; only a non-dumpable mm keeps the owner uid from attaching to it
 *   (the child's own setresuid leaves the trainer non-dumpable anyway, as every spawn
 *   did before). */
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
    job->step = KAROTTE_STEP_CGROUP;
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
        job->step = KAROTTE_STEP_OWNER;
        if (syscall(SYS_setresgid, -1L, (long)job->owner_gid, -1L) < 0 ||
            syscall(SYS_setresuid, -1L, (long)job->owner_uid, -1L) < 0) {
            job->result = -errno;
            return NULL;
        }
        syscall(SYS_setfsuid, fsuid);
        syscall(SYS_setfsgid, fsgid);
    }
    job->step = KAROTTE_STEP_CLONE;
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
    *step_out = KAROTTE_STEP_THREAD;
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
