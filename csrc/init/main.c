/* karotte-init's main: read the config, set the sandbox up in order, then serve. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "init.h"

struct config cfg;

static void set_sysctl(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, value, strlen(value)) != (ssize_t)strlen(value))
        setup_fail(KS_SYSCTL, "set %s to %s", path, value);
    close(fd);
}

/* Parse KP_CONFIG: identity, hostname, seccomp, rlimits; mounts run in order. */
static void apply_config(const char *msg, size_t len)
{
    const char *pos = msg + sizeof(struct kp_header), *end = msg + len, *data;
    uint32_t tag = 0, rlen;
    int r;

    enter_staging();
    while ((r = next_record(&pos, end, &tag, &data, &rlen)) > 0) {
        switch (tag) {
        case KT_IDS:
            if (rlen != 12)
                goto bad;
            memcpy(&cfg.agent_uid, data, 4);
            memcpy(&cfg.agent_gid, data + 4, 4);
            memcpy(&cfg.nested, data + 8, 4);
            break;
        case KT_HOSTNAME:
            if (rlen == 0 || data[rlen - 1] != '\0')
                goto bad;
            cfg.hostname = data;
            break;
        case KT_SECCOMP:
            if (rlen == 0 || rlen % sizeof(struct sock_filter) != 0 ||
                rlen / sizeof(struct sock_filter) > BPF_MAXINSNS)
                goto bad;
            cfg.filter = (const struct sock_filter *)data; /* 8-aligned in msgbuf */
            cfg.filter_len = (unsigned short)(rlen / sizeof(struct sock_filter));
            break;
        case KT_RLIMIT:
            if (rlen != sizeof(struct kp_rlimit) || cfg.n_rlimits >= MAX_RLIMITS)
                goto bad;
            memcpy(&cfg.rlimits[cfg.n_rlimits++], data, sizeof(struct kp_rlimit));
            break;
        case KT_CAPS:
            /* A host bug must not hand the agent SYS_ADMIN: only what KP_ROOT_CAPS allows. */
            if (rlen != 8)
                goto bad;
            memcpy(&cfg.agent_caps, data, 8);
            if (cfg.agent_caps & ~KP_ROOT_CAPS)
                goto bad;
            break;
        case KT_LOOPBACK: /* u32 ports of the egress listeners, if any (csrc/init/net.c) */
            if (set_listeners(data, rlen) < 0)
                goto bad;
            cfg.loopback = 1;
            break;
        case KT_MOUNT: {
            struct kp_mount m;
            const char *src, *dst;
            uint32_t srclen;
            if (mount_record(data, rlen, &m, &src, &dst, &srclen) < 0)
                goto bad;
            /* The records after this one: on an image, the overlay makes their mount
             * points first (mounts.c, points_layer). */
            do_mount(&m, src, dst, srclen, pos, end);
            break;
        }
        default:
            goto bad;
        }
    }
    if (r < 0)
        goto bad;
    return;
bad:
    errno = EPROTO;
    setup_fail(KS_CONFIG_RECORD, "malformed config record %u", tag);
}

int main(void)
{
    sigset_t all;
    int fds[MAX_FDS], nfds;

    /* Inherited from the trainer: drop every fd but the control socket, and put
     * /dev/null at 0-2 so init holds none of the trainer's stdio. */
    syscall(SYS_close_range, CTL_FD + 1, ~0U, 0);
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int i = 0; i < 3 && null >= 0; i++)
        dup2(null, i);
    if (null > 2)
        close(null);
    /* Signals stay blocked (as the spawn left them); SIGCHLD is read from a signalfd.
     * As PID 1 we receive no signal from inside the sandbox anyway. */
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    /* No core dumps and no ptrace or /proc/1/mem access from the agent's uid. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);

    ssize_t n = recv_msg(fds, &nfds);
    /* The config's fds, if any, are the image's tree (KM_OVERLAY takes it) and the vetted
     * diff laid over it (KM_LAYER). */
    cfg.tree_fd = nfds > 0 ? fds[0] : -1;
    cfg.layer_fd = nfds > 1 ? fds[1] : -1;
    cfg.upper_fd = -1;
    for (int i = 2; i < nfds; i++)
        close(fds[i]);
    if (n <= 0)
        _exit(1); /* host went away before configuring us */
    struct kp_header h;
    memcpy(&h, msgbuf, sizeof(h));
    if ((size_t)n < sizeof(h) || h.type != KP_CONFIG) {
        errno = EPROTO;
        setup_fail(KS_CONFIG_MESSAGE, "first message is not a config");
    }
    /* On cgroup v1 the host moved us into our cgroup after clone3 made our cgroup
     * namespace; re-root it at the sandbox's own cgroup so nothing above shows. */
    if (unshare(CLONE_NEWCGROUP) < 0)
        setup_fail(KS_CGROUP_NAMESPACE, "unshare the cgroup namespace");
    /* Copy the config out of msgbuf: it is reused for requests. */
    static char config[KP_MAX_MSG] __attribute__((aligned(8)));
    memcpy(config, msgbuf, (size_t)n);
    apply_config(config, (size_t)n);
    if (cfg.tree_fd >= 0) /* a tree with no overlay in the plan */
        close(cfg.tree_fd);
    if (cfg.layer_fd >= 0)
        close(cfg.layer_fd);
    if (!cfg.nested && setgroups(0, NULL) < 0)
        setup_fail(KS_SETGROUPS, "drop supplementary groups");
    enter_root();
    if (cfg.agent_caps || cfg.nested) {
        /* An agent that is init's own host uid (a root agent; every agent of an
         * unprivileged caller) owns init's /proc/1 files: it could raise init's
         * oom_score_adj, so that its next OOM kills init (ROOT-OOM-01). hidepid=2 shows a
         * process only to those who may ptrace it, and no agent may ptrace init. */
        if (mount(NULL, "/proc", NULL, MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "hidepid=2") < 0)
            setup_fail(KS_HIDE_INIT, "remount /proc with hidepid=2");
    }
    /* inotify instances and watches are counted per user and, on the host, against the
     * user namespace's creator: cap what this sandbox can take from that shared pool.
     * These files are the limits of our own user namespace (we are its root). */
    set_sysctl("/proc/sys/user/max_inotify_instances", "32");
    set_sysctl("/proc/sys/user/max_inotify_watches", "16384");
    if (cfg.hostname && sethostname(cfg.hostname, strlen(cfg.hostname)) < 0)
        setup_fail(KS_HOSTNAME, "sethostname");
    if (cfg.loopback)
        bring_up_loopback();
    if (cfg.filter_len) {
        /* A kernel without seccomp (or without the actions the policy returns) must
         * refuse the sandbox now, not fail every exec later. */
        uint32_t actions[] = {SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW};
        for (size_t i = 0; i < sizeof(actions) / sizeof(actions[0]); i++)
            if (syscall(SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0, &actions[i]) < 0)
                setup_fail(KS_SECCOMP_SUPPORT, "seccomp filter support (action 0x%x)", actions[i]);
    }
    if (setsid() < 0)
        setup_fail(KS_SETSID, "setsid");
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* setresuid above reset it */
    if (!cfg.nested) {
        /* The agent's bounding set and filter, once: every command inherits both
         * through fork, and neither takes what init still uses (docs/init.md). In
         * nested mode agent_child does both itself. */
        if (drop_bounding_set(cfg.agent_caps) < 0)
            setup_fail(KS_BOUNDING_SET, "reduce the bounding set to the agent's capabilities");
        if (cfg.filter_len && load_filter() < 0)
            setup_fail(KS_SECCOMP_LOAD, "load seccomp filter");
    }

    /* Hand the host a directory fd of the workspace, and on an image one of the overlay's
     * upper (opened before the pivot detached it): they keep both tmpfs reachable for
     * custody's scan after every process inside is gone. Then the egress listeners, for
     * the host's proxy to accept on. init keeps none of them. */
    int ready[2 + MAX_LISTEN] = {open("/workspace", O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW),
                    cfg.upper_fd};
    if (ready[0] < 0)
        setup_fail(KS_WORKSPACE, "open /workspace");
    struct out o;
    out_init(&o, KP_READY, 0);
    if (out_send_fds(&o, ready, ready_fds(ready, cfg.upper_fd >= 0 ? 2 : 1)) < 0)
        _exit(1);
    close(ready[0]);
    if (cfg.upper_fd >= 0)
        close(cfg.upper_fd);
    close_listeners();
    serve();
    return 0;
}
