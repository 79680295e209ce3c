/* The agent's side of an exec: drop to the agent's ids and limits, then execve. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "init.h"

/* The step being taken, for the report if it fails: its code and its words. */
#define STEP(c, words) (code = (c), step = (words))


/* ---- exec -------------------------------------------------------------------- */

_Static_assert(KP_ROOT_CAPS == (1ULL << CAP_CHOWN | 1ULL << CAP_DAC_OVERRIDE | 1ULL << CAP_FOWNER |
                                1ULL << CAP_FSETID | 1ULL << CAP_KILL | 1ULL << CAP_SETGID |
                                1ULL << CAP_SETUID),
               "KP_ROOT_CAPS is the file-ownership capabilities and CAP_KILL");

/* The bounding set is the ceiling of every execve below: nothing the agent runs can gain
 * a capability outside it (docs/image-sandbox.md, "Root inside"). keep: the agent's own. */
int drop_bounding_set(uint64_t keep)
{
    for (int cap = 0; cap <= 63; cap++) {
        if (keep & (1ULL << cap))
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
            if (errno == EINVAL) /* past the last capability this kernel knows */
                break;
            return -1;
        }
    }
    return prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

/* Effective and permitted exactly caps, inheritable none (so ambient none too). As uid 0
 * an execve then gives permitted = bounding set | inheritable = caps again; as any other
 * uid, nothing. */
static int set_caps(uint64_t caps)
{
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {
        {(uint32_t)caps, (uint32_t)caps, 0},
        {(uint32_t)(caps >> 32), (uint32_t)(caps >> 32), 0},
    };
    return (int)syscall(SYS_capset, &hdr, data);
}

int load_filter(void)
{
    struct sock_fprog prog = {cfg.filter_len, (struct sock_filter *)cfg.filter};
    return (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog);
}

static int write_proc_self(const char *name, const char *text)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/%s", name);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    int err = errno;
    close(fd);
    errno = err;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* Child side of an exec: become the agent, then exec. A failure goes to errpipe as a
 * struct exec_failure and the child exits 127; it never returns. */
void __attribute__((noreturn)) agent_child(char **argv, char **envp, const char *cwd, int tty,
                                           int nfds, int errpipe)
{
    const char *step;
    uint32_t code;
    sigset_t none;
    char map[64], what[256];

    sigemptyset(&none);
    /* init may be exempt from the OOM killer (the host sets it when it can); the
     * agent must not inherit that, or an OOM could find nothing to kill. */
    STEP(KS_OOM_SCORE, "reset oom_score_adj");
    if (write_proc_self("oom_score_adj", "0") < 0)
        goto fail;
    STEP(KS_SIGMASK, "reset signal mask");
    if (sigprocmask(SIG_SETMASK, &none, NULL) < 0)
        goto fail;
    /* Its own session: no controlling tty shared with anything outside, and a
     * process group the host can kill as a whole. */
    STEP(KS_SETSID, "setsid");
    if (setsid() < 0)
        goto fail;
    STEP(KS_CTTY, "set the controlling tty");
    if (tty && ioctl(0, TIOCSCTTY, 0) < 0)
        goto fail;
    /* Only fds 0-2, and any extra fds the host passed for this command (a grader's
     * channel), cross into the agent; errpipe is CLOEXEC. */
    STEP(KS_CLOSE_FDS, "close fds");
    if (syscall(SYS_close_range, nfds > 3 ? nfds : 3, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
        goto fail;
    for (int i = 0; i < cfg.n_rlimits; i++) {
        struct rlimit rl = {cfg.rlimits[i].cur, cfg.rlimits[i].max};
        STEP(KS_RLIMIT, "setrlimit");
        if (setrlimit((int)cfg.rlimits[i].resource, &rl) < 0)
            goto fail;
    }
    if (cfg.nested) {
        /* The host gave us a single uid; the agent gets a user namespace of its own
         * in which that uid is agent_uid, so it is never root of init's namespace (with
         * agent_user="root", agent_uid 0: root of its own, a child of init's). */
        STEP(KS_AGENT_USERNS, "unshare the agent's user namespace");
        if (unshare(CLONE_NEWUSER) < 0)
            goto fail;
        snprintf(map, sizeof(map), "%u 0 1\n", cfg.agent_uid);
        STEP(KS_AGENT_UID_MAP, "write the agent's uid_map");
        if (write_proc_self("setgroups", "deny") < 0 || write_proc_self("uid_map", map) < 0)
            goto fail;
        snprintf(map, sizeof(map), "%u 0 1\n", cfg.agent_gid);
        STEP(KS_AGENT_GID_MAP, "write the agent's gid_map");
        if (write_proc_self("gid_map", map) < 0)
            goto fail;
        STEP(KS_BOUNDING_SET, "reduce the bounding set to the agent's capabilities");
        if (drop_bounding_set(cfg.agent_caps) < 0)
            goto fail;
    } else {
        STEP(KS_SETGROUPS, "drop supplementary groups");
        if (setgroups(0, NULL) < 0)
            goto fail;
        STEP(KS_SETRESGID, "setresgid");
        if (setresgid(cfg.agent_gid, cfg.agent_gid, cfg.agent_gid) < 0)
            goto fail;
    }
    /* All three uids non-zero: the kernel clears permitted and effective caps. */
    STEP(KS_SETRESUID, "setresuid");
    if (setresuid(cfg.agent_uid, cfg.agent_uid, cfg.agent_uid) < 0)
        goto fail;
    /* Exactly the config's capabilities whatever the uid: uid 0 keeps only KT_CAPS of
     * init's (or, nested, of its fresh namespace's) full set; uid 1000 has none already. */
    STEP(KS_AGENT_CAPS, "set the agent's capabilities");
    if (set_caps(cfg.agent_caps) < 0)
        goto fail;
    /* The steps that take a path name it: "chdir /x: No such file or directory". */
    snprintf(what, sizeof(what), "chdir %s", cwd);
    STEP(KS_CHDIR, what);
    if (chdir(cwd) < 0)
        goto fail;
    STEP(KS_NO_NEW_PRIVS, "no_new_privs");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        goto fail;
    /* Otherwise init loaded it before READY and this process inherited it. */
    if (cfg.nested && cfg.filter_len) {
        /* Last: after this, the agent's own syscalls are the only ones left. */
        STEP(KS_SECCOMP_LOAD, "load seccomp filter");
        if (load_filter() < 0)
            goto fail;
    }
    extern char **environ;
    environ = envp;
    execvp(argv[0], argv);
    int exec_err = errno;
    snprintf(what, sizeof(what), "execvp %s%s", argv[0],
             exec_err == ENOEXEC ? " (not a binary this kernel runs; a script needs a #! line)"
                                 : "");
    STEP(KS_EXECVE, what);
    errno = exec_err;
fail : {
    struct exec_failure f = {errno, code, {0}};
    size_t n = strlen(step);
    if (n > sizeof(f.what) - 1)
        n = sizeof(f.what) - 1;
    memcpy(f.what, step, n);
    if (write(errpipe, &f, offsetof(struct exec_failure, what) + n) < 0) {
        /* nothing left to report to */
    }
    _exit(127);
}
}
