/* karotte-init: PID 1 of a Karotte sandbox.
 *
 * It starts in fresh namespaces (made by karotte_spawn's clone3) as root of its
 * user namespace, with fd 3 being its end of the control socket, already in its
 * cgroup. Its first message is KP_CONFIG, the sandbox plan. It builds the root from the mount plan, pivots into it, and serves exec
 * requests: each runs as the unprivileged agent uid, in its own session, with only
 * fds 0-2, no capabilities, no_new_privs, rlimits, and the seccomp filter loaded
 * last before execve.
 *
 * When the host's end of the socket closes (the host process died or dropped the
 * sandbox), init exits; as PID 1 of the namespace its exit makes the kernel kill
 * every process left inside. That is the sandbox's PDEATHSIG, and unlike
 * PR_SET_PDEATHSIG it is not tied to the lifetime of the thread that spawned it.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "protocol.h"

#ifndef CLOSE_RANGE_CLOEXEC /* glibc's unistd.h has it, musl's does not */
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

#define CTL_FD 3
#define STAGING "/tmp"     /* where the staging tmpfs is mounted first; see apply_config */
#define NEWROOT "/newroot" /* the sandbox's root while it is built, inside the staging root */
#define OLDROOT "/oldroot" /* the host's tree while the sandbox's root is built */
#define MAX_EXECS 64
#define MAX_RLIMITS 16
#define MAX_FDS 8 /* stdin, stdout, stderr and up to 5 more for the command (3, 4, ...) */

struct rlimit_rec {
    uint32_t resource;
    uint32_t pad;
    uint64_t cur;
    uint64_t max;
};

struct config {
    uint32_t agent_uid, agent_gid, nested;
    const char *hostname;
    const struct sock_filter *filter;
    unsigned short filter_len;
    struct rlimit_rec rlimits[MAX_RLIMITS];
    int n_rlimits;
    int loopback;
};

struct running {
    uint32_t id;
    pid_t pid;
    int errpipe; /* read end: holds (errno, step) if the child failed before exec */
};

static struct config cfg;
static struct running running[MAX_EXECS];
static char msgbuf[KP_MAX_MSG] __attribute__((aligned(8)));

/* ---- messages ---------------------------------------------------------------- */

struct out {
    char buf[4096];
    size_t len;
};

static void out_init(struct out *o, uint32_t type, uint32_t id)
{
    struct kp_header h = {type, id};
    memcpy(o->buf, &h, sizeof(h));
    o->len = sizeof(h);
}

static void out_rec(struct out *o, uint32_t tag, const void *data, uint32_t len)
{
    struct kp_record r = {tag, len};
    size_t padded = (len + 7u) & ~7u;
    if (o->len + sizeof(r) + padded > sizeof(o->buf))
        return; /* replies are small and fixed; a long error text is cut, not overflowed */
    memcpy(o->buf + o->len, &r, sizeof(r));
    memcpy(o->buf + o->len + sizeof(r), data, len);
    memset(o->buf + o->len + sizeof(r) + len, 0, padded - len);
    o->len += sizeof(r) + padded;
}

static void out_u32(struct out *o, uint32_t tag, uint32_t v) { out_rec(o, tag, &v, sizeof(v)); }

static int out_send(struct out *o, int fd_to_pass)
{
    struct iovec iov = {o->buf, o->len};
    struct msghdr mh = {0};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (fd_to_pass >= 0) {
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof(ctl.buf);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd_to_pass, sizeof(int));
    }
    ssize_t n;
    do
        n = sendmsg(CTL_FD, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n < 0 ? -1 : 0;
}

static void send_error(uint32_t type, uint32_t id, int err, const char *fmt, ...)
{
    struct out o;
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    out_init(&o, type, id);
    out_u32(&o, KT_ERRNO, (uint32_t)err);
    out_rec(&o, KT_WHAT, what, (uint32_t)strlen(what) + 1);
    out_send(&o, -1);
}

/* Setup failed: say which step and why, then exit. Nothing has run as the agent. */
static void __attribute__((noreturn)) setup_fail(const char *fmt, ...)
{
    int err = errno;
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    send_error(KP_SETUP_ERR, 0, err, "%s", what);
    _exit(1);
}

/* Iterate the records of a message. Returns 0 at the end, -1 on a malformed record. */
static int next_record(const char **pos, const char *end, uint32_t *tag, const char **data,
                       uint32_t *len)
{
    struct kp_record r;
    if (*pos == end)
        return 0;
    if ((size_t)(end - *pos) < sizeof(r))
        return -1;
    memcpy(&r, *pos, sizeof(r));
    size_t padded = ((size_t)r.len + 7u) & ~(size_t)7u;
    if ((size_t)(end - *pos) - sizeof(r) < padded)
        return -1;
    *tag = r.tag;
    *data = *pos + sizeof(r);
    *len = r.len;
    *pos += sizeof(r) + padded;
    return 1;
}

/* Receive one message and up to MAX_FDS fds. Returns its length, 0 on EOF, -1 on error. */
static ssize_t recv_msg(int *fds, int *nfds)
{
    struct iovec iov = {msgbuf, sizeof(msgbuf)};
    union {
        char buf[CMSG_SPACE(MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr mh = {0};
    ssize_t n;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof(ctl.buf);
    do
        n = recvmsg(CTL_FD, &mh, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    *nfds = 0;
    if (n <= 0)
        return n;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (*nfds < MAX_FDS)
                fds[(*nfds)++] = fd;
            else
                close(fd);
        }
    }
    if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        for (int i = 0; i < *nfds; i++)
            close(fds[i]);
        *nfds = 0;
        errno = EMSGSIZE;
        return -1;
    }
    return n;
}

/* ---- setup ------------------------------------------------------------------- */

static void write_file(const char *path, const char *data, size_t len, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode);
    if (fd < 0)
        setup_fail("create %s", path);
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            setup_fail("write %s", path);
        }
        data += n;
        len -= (size_t)n;
    }
    if (fchmod(fd, mode) < 0)
        setup_fail("chmod %s", path);
    close(fd);
}

static void set_sysctl(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, value, strlen(value)) != (ssize_t)strlen(value))
        setup_fail("set %s to %s", path, value);
    close(fd);
}

/* mkdir -p below NEWROOT; dst is absolute inside the sandbox. */
static void make_dirs(const char *dst, mode_t mode)
{
    char path[4096];
    if (snprintf(path, sizeof(path), "%s%s", NEWROOT, dst) >= (int)sizeof(path)) {
        errno = ENAMETOOLONG;
        setup_fail("path %s", dst);
    }
    /* Usually the parent exists (the plan goes top-down): one mkdir. */
    if (mkdir(path, mode) == 0 || errno == EEXIST)
        return;
    if (errno != ENOENT)
        setup_fail("mkdir %s", dst);
    for (char *p = path + strlen(NEWROOT) + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(path, 0755) < 0 && errno != EEXIST)
            setup_fail("mkdir %s", path + strlen(NEWROOT));
        *p = '/';
    }
    if (mkdir(path, mode) < 0 && errno != EEXIST)
        setup_fail("mkdir %s", dst);
}

static void make_parent_dirs(const char *dst)
{
    char parent[4096];
    snprintf(parent, sizeof(parent), "%s", dst);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = '\0';
        make_dirs(parent, 0755);
    }
}

/* Set mount attributes on the whole tree at path. In a user namespace the kernel
 * only lets us add restrictions (ro, nosuid, nodev, noexec), never lift the ones a
 * host mount already has, so this cannot weaken anything. */
static void set_mount_attrs(const char *path, uint64_t attrs, int recursive)
{
    struct mount_attr a = {0};
    a.attr_set = attrs;
    a.propagation = MS_PRIVATE;
    if (syscall(SYS_mount_setattr, AT_FDCWD, path, recursive ? AT_RECURSIVE : 0, &a, sizeof(a)) < 0)
        setup_fail("mount_setattr %s", path);
}

static void do_mount(const struct kp_mount *m, const char *src, const char *dst, uint32_t srclen)
{
    char target[4096];
    struct stat st;
    char opts[256];
    snprintf(target, sizeof(target), "%s%s", NEWROOT, dst);

    switch (m->op) {
    case KM_BIND: {
        char source[4096];
        if (snprintf(source, sizeof(source), "%s%s", OLDROOT, src) >= (int)sizeof(source)) {
            errno = ENAMETOOLONG;
            setup_fail("bind source %s", src);
        }
        if (stat(source, &st) < 0)
            setup_fail("bind source %s", src);
        struct stat existing;
        if (S_ISDIR(st.st_mode)) {
            make_dirs(dst, 0755);
        } else if (stat(target, &existing) < 0) {
            /* A file's mount point is made only where there is none: one that exists
             * may be in a read-only mount (/etc/hosts in the sandbox's /etc). */
            make_parent_dirs(dst);
            int fd = open(target, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
            if (fd < 0)
                setup_fail("bind target %s", dst);
            close(fd);
        }
        if (mount(source, target, NULL, MS_BIND | MS_REC, NULL) < 0)
            setup_fail("bind %s -> %s", src, dst);
        uint64_t attrs = MOUNT_ATTR_NOSUID;
        /* Device nodes need device access on their own bind; every other mount is nodev
         * so a device node that appears anywhere else cannot be opened. */
        if (!(m->flags & KMF_DEV))
            attrs |= MOUNT_ATTR_NODEV;
        if (m->flags & KMF_RDONLY)
            attrs |= MOUNT_ATTR_RDONLY;
        set_mount_attrs(target, attrs, 1);
        return;
    }
    case KM_TMPFS:
        make_dirs(dst, 0755);
        snprintf(opts, sizeof(opts), "size=%llu,nr_inodes=%llu,mode=%o,uid=%u,gid=%u",
                 (unsigned long long)m->size, (unsigned long long)m->inodes, m->mode, m->uid,
                 m->gid);
        if (mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
            setup_fail("tmpfs %s (%s)", dst, opts);
        return;
    case KM_PROC:
        make_dirs(dst, 0555);
        if (mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            setup_fail("mount proc at %s", dst);
        return;
    case KM_DEVPTS: {
        char ptmx[4200];
        make_dirs(dst, 0755);
        if (mount("devpts", target, "devpts", MS_NOSUID | MS_NOEXEC,
                  /* max: this instance's own cap; without it every sandbox draws on
                   * one host-wide pool (kernel.pty.max less the reserve) and one agent
                   * could take every pty of every other sandbox and container. */
                  "newinstance,ptmxmode=0666,mode=0620,max=64") < 0)
            setup_fail("mount devpts at %s", dst);
        snprintf(ptmx, sizeof(ptmx), "%s/dev/ptmx", NEWROOT);
        unlink(ptmx);
        if (symlink("pts/ptmx", ptmx) < 0)
            setup_fail("symlink /dev/ptmx");
        return;
    }
    case KM_SYMLINK:
        make_parent_dirs(dst);
        if (symlink(src, target) < 0 && errno != EEXIST)
            setup_fail("symlink %s -> %s", dst, src);
        return;
    case KM_DIR:
        make_dirs(dst, m->mode);
        if (chown(target, m->uid, m->gid) < 0)
            setup_fail("chown %s", dst);
        if (chmod(target, m->mode) < 0)
            setup_fail("chmod %s", dst);
        return;
    case KM_FILE:
        make_parent_dirs(dst);
        write_file(target, src, srclen, m->mode);
        return;
    }
    errno = EINVAL;
    setup_fail("unknown mount op %u", m->op);
}

static void bring_up_loopback(void)
{
    struct ifreq ifr = {0};
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        setup_fail("socket for loopback");
    snprintf(ifr.ifr_name, IFNAMSIZ, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        setup_fail("get lo flags");
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        setup_fail("bring lo up");
    close(s);
}

/* Parse KP_CONFIG: identity, hostname, seccomp, rlimits; mounts run in order. */
static void apply_config(const char *msg, size_t len)
{
    const char *pos = msg + sizeof(struct kp_header), *end = msg + len, *data;
    uint32_t tag = 0, rlen;
    int r;

    /* Every mount below happens in our own mount namespace; make it private first
     * so nothing we do propagates back to the host's mounts. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        setup_fail("make / private");
    /* A staging tmpfs becomes the root, with the host's tree moved to /oldroot, so
     * bind sources are reachable under /oldroot whatever their path (had we mounted
     * the new root over a host directory, that directory could not be bound). The
     * sandbox's real root is another tmpfs at /newroot inside it. */
    if (mount("tmpfs", STAGING, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=16,mode=0755") < 0)
        setup_fail("staging tmpfs");
    if (chdir(STAGING) < 0 || mkdir("." NEWROOT, 0755) < 0 || mkdir("." OLDROOT, 0755) < 0)
        setup_fail("staging directories");
    if (syscall(SYS_pivot_root, ".", "." OLDROOT) < 0)
        setup_fail("pivot_root into the staging tmpfs");
    if (chdir("/") < 0)
        setup_fail("chdir /");
    if (mount("tmpfs", NEWROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=0755") < 0)
        setup_fail("tmpfs for the new root");

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
            if (rlen != sizeof(struct rlimit_rec) || cfg.n_rlimits >= MAX_RLIMITS)
                goto bad;
            memcpy(&cfg.rlimits[cfg.n_rlimits++], data, sizeof(struct rlimit_rec));
            break;
        case KT_LOOPBACK:
            cfg.loopback = 1;
            break;
        case KT_MOUNT: {
            struct kp_mount m;
            if (rlen < sizeof(m))
                goto bad;
            memcpy(&m, data, sizeof(m));
            const char *src = data + sizeof(m);
            size_t rest = rlen - sizeof(m);
            /* KM_FILE carries m.size bytes of content, then dst; others src\0dst\0 */
            size_t srclen = m.op == KM_FILE ? m.size : strnlen(src, rest) + 1;
            if (srclen >= rest)
                goto bad;
            const char *dst = src + srclen;
            size_t dstlen = strnlen(dst, rest - srclen);
            if (dstlen == rest - srclen || dst[0] != '/')
                goto bad;
            do_mount(&m, src, dst, (uint32_t)srclen);
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
    setup_fail("malformed config record %u", tag);
}

static void enter_root(void)
{
    /* Drop the host's tree, then pivot into the sandbox's root: pivot_root(".", ".")
     * stacks the staging root under it and the detach drops that too. chdir("/")
     * after it closes the classic escape through a cwd left in an old root. */
    if (umount2(OLDROOT, MNT_DETACH) < 0)
        setup_fail("detach the host's tree");
    if (chdir(NEWROOT) < 0)
        setup_fail("chdir new root");
    if (syscall(SYS_pivot_root, ".", ".") < 0)
        setup_fail("pivot_root");
    if (umount2(".", MNT_DETACH) < 0)
        setup_fail("detach the staging root");
    if (chdir("/") < 0)
        setup_fail("chdir /");
    /* The root directory itself is read-only; writable places are their own mounts. */
    set_mount_attrs("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0);
}

/* ---- exec -------------------------------------------------------------------- */

static void drop_bounding_set(void)
{
    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            return;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

static int load_filter(void)
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

/* Child side of an exec: become the agent, then exec. Failures go to errpipe as
 * (errno, step) and the child exits 127; it never returns. */
static void __attribute__((noreturn)) agent_child(char **argv, char **envp, const char *cwd,
                                                  int tty, int nfds, int errpipe)
{
    const char *step;
    sigset_t none;
    char map[64], what[256];

    sigemptyset(&none);
    /* init may be exempt from the OOM killer (the host sets it when it can); the
     * agent must not inherit that, or an OOM could find nothing to kill. */
    step = "reset oom_score_adj";
    if (write_proc_self("oom_score_adj", "0") < 0)
        goto fail;
    step = "reset signal mask";
    if (sigprocmask(SIG_SETMASK, &none, NULL) < 0)
        goto fail;
    /* Its own session: no controlling tty shared with anything outside, and a
     * process group the host can kill as a whole. */
    step = "setsid";
    if (setsid() < 0)
        goto fail;
    step = "set the controlling tty";
    if (tty && ioctl(0, TIOCSCTTY, 0) < 0)
        goto fail;
    /* Only fds 0-2, and any extra fds the host passed for this command (a grader's
     * channel), cross into the agent; errpipe is CLOEXEC. */
    step = "close fds";
    if (syscall(SYS_close_range, nfds > 3 ? nfds : 3, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
        goto fail;
    for (int i = 0; i < cfg.n_rlimits; i++) {
        struct rlimit rl = {cfg.rlimits[i].cur, cfg.rlimits[i].max};
        step = "setrlimit";
        if (setrlimit((int)cfg.rlimits[i].resource, &rl) < 0)
            goto fail;
    }
    if (cfg.nested) {
        /* The host gave us a single uid; the agent gets a user namespace of its own
         * in which that uid is agent_uid, so it is never root of init's namespace. */
        step = "unshare the agent's user namespace";
        if (unshare(CLONE_NEWUSER) < 0)
            goto fail;
        snprintf(map, sizeof(map), "%u 0 1\n", cfg.agent_uid);
        step = "write the agent's uid_map";
        if (write_proc_self("setgroups", "deny") < 0 || write_proc_self("uid_map", map) < 0)
            goto fail;
        snprintf(map, sizeof(map), "%u 0 1\n", cfg.agent_gid);
        step = "write the agent's gid_map";
        if (write_proc_self("gid_map", map) < 0)
            goto fail;
        drop_bounding_set();
    } else {
        step = "drop supplementary groups";
        if (setgroups(0, NULL) < 0)
            goto fail;
        step = "setresgid";
        if (setresgid(cfg.agent_gid, cfg.agent_gid, cfg.agent_gid) < 0)
            goto fail;
    }
    /* All three uids non-zero: the kernel clears permitted and effective caps. */
    step = "setresuid";
    if (setresuid(cfg.agent_uid, cfg.agent_uid, cfg.agent_uid) < 0)
        goto fail;
    /* The steps that take a path name it: "chdir /x: No such file or directory". */
    snprintf(what, sizeof(what), "chdir %s", cwd);
    step = what;
    if (chdir(cwd) < 0)
        goto fail;
    step = "no_new_privs";
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        goto fail;
    /* Otherwise init loaded it before READY and this process inherited it. */
    if (cfg.nested && cfg.filter_len) {
        /* Last: after this, the agent's own syscalls are the only ones left. */
        step = "load seccomp filter";
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
    step = what;
    errno = exec_err;
fail : {
    int err = errno;
    char rec[256];
    memcpy(rec, &err, sizeof(err));
    size_t n = strlen(step);
    if (n > sizeof(rec) - sizeof(err) - 1)
        n = sizeof(rec) - sizeof(err) - 1;
    memcpy(rec + sizeof(err), step, n);
    if (write(errpipe, rec, sizeof(err) + n) < 0) {
        /* nothing left to report to */
    }
    _exit(127);
}
}

/* Split a NUL-separated list into a NULL-terminated vector (pointers into data). */
static char **split_list(const char *data, uint32_t len)
{
    size_t n = 0;
    for (uint32_t i = 0; i < len; i++)
        n += data[i] == '\0';
    if (len > 0 && data[len - 1] != '\0')
        return NULL;
    char **v = calloc(n + 1, sizeof(char *));
    if (!v)
        return NULL;
    size_t k = 0;
    for (uint32_t i = 0; i < len; i += (uint32_t)strlen(data + i) + 1)
        v[k++] = (char *)data + i;
    return v;
}

static void handle_exec(uint32_t id, const char *msg, size_t len, int *fds, int nfds)
{
    const char *pos = msg + sizeof(struct kp_header), *end = msg + len, *data;
    uint32_t tag, rlen;
    char **argv = NULL, **envp = NULL;
    const char *cwd = "/workspace";
    int tty = 0, slot = -1, r, errpipe[2] = {-1, -1}, master = -1;

    for (int i = 0; i < MAX_EXECS; i++)
        if (running[i].pid == 0) {
            slot = i;
            break;
        }
    if (slot < 0) {
        send_error(KP_EXEC_ERR, id, EAGAIN, "too many execs at once");
        goto out;
    }
    while ((r = next_record(&pos, end, &tag, &data, &rlen)) > 0) {
        if (tag == KT_ARGV && !argv)
            argv = split_list(data, rlen);
        else if (tag == KT_ENV && !envp)
            envp = split_list(data, rlen);
        else if (tag == KT_CWD && rlen > 0 && data[rlen - 1] == '\0')
            cwd = data;
        else if (tag == KT_TTY)
            tty = 1;
    }
    if (r < 0 || !argv || !argv[0] || !envp || (tty ? nfds != 0 : nfds < 3)) {
        send_error(KP_EXEC_ERR, id, EPROTO, "malformed exec request");
        goto out;
    }
    if (tty) {
        /* A terminal from the sandbox's own devpts: the agent's tty names resolve
         * inside, and no terminal of the host is ever its controlling tty. */
        int unlock = 0;
        master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || ioctl(master, TIOCSPTLCK, &unlock) < 0) {
            send_error(KP_EXEC_ERR, id, errno, "open a pty");
            goto out;
        }
        int slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (slave < 0) {
            send_error(KP_EXEC_ERR, id, errno, "open the pty's terminal");
            goto out;
        }
        fds[0] = slave;
        nfds = 1; /* the child puts it at 0, 1 and 2 */
    }
    if (pipe2(errpipe, O_CLOEXEC) < 0) {
        send_error(KP_EXEC_ERR, id, errno, "pipe");
        goto out;
    }
    pid_t pid = fork();
    if (pid < 0) {
        send_error(KP_EXEC_ERR, id, errno, "fork (the sandbox's pids limit may be reached)");
        goto out;
    }
    if (pid == 0) {
        close(errpipe[0]);
        /* Move the received fds (and errpipe) out of the way first, so placing one at
         * its number cannot overwrite another that is still to be placed. */
        if ((errpipe[1] = fcntl(errpipe[1], F_DUPFD_CLOEXEC, 64)) < 0)
            _exit(127);
        for (int i = 0; i < nfds; i++)
            if ((fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 64)) < 0)
                _exit(127);
        for (int i = 0; i < nfds; i++)
            if (dup2(fds[i], i) < 0)
                _exit(127);
        if (tty) {
            dup2(0, 1);
            dup2(0, 2);
        }
        agent_child(argv, envp, cwd, tty, tty ? 3 : nfds, errpipe[1]);
    }
    if (tty) {
        struct out o;
        out_init(&o, KP_TTY, id);
        out_send(&o, master); /* before any exit report: we reap only after returning */
    }
    /* Not waiting for the exec here: a child that is stopped before it execs must
     * not stall init. reap() reads errpipe once the child is gone. */
    running[slot].id = id;
    running[slot].pid = pid;
    running[slot].errpipe = errpipe[0];
    errpipe[0] = -1;
out:
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    if (master >= 0)
        close(master);
    if (errpipe[0] >= 0)
        close(errpipe[0]);
    if (errpipe[1] >= 0)
        close(errpipe[1]);
    free(argv);
    free(envp);
}

static void handle_signal(uint32_t id, const char *msg, size_t len)
{
    const char *pos = msg + sizeof(struct kp_header), *end = msg + len, *data;
    uint32_t tag, rlen, sig = 0;
    while (next_record(&pos, end, &tag, &data, &rlen) > 0)
        if (tag == KT_SIGNAL && rlen == 4)
            memcpy(&sig, data, 4);
    for (int i = 0; i < MAX_EXECS; i++) {
        if (!running[i].pid || running[i].id != id)
            continue;
        /* The exec's whole process group, which exists only once the child has called
         * setsid(): a signal sent before would be lost (ESRCH) and the command run on.
         * SIGKILL goes to the child itself first: dead, it can make no group, and what it
         * started after its setsid() is in the group the second kill reaches. Another
         * signal goes to the child alone when there is no group yet (it has forked
         * nothing before setsid()). */
        if (sig == SIGKILL)
            kill(running[i].pid, SIGKILL);
        if (kill(-running[i].pid, (int)sig) < 0 && errno == ESRCH && sig != SIGKILL)
            kill(running[i].pid, (int)sig);
    }
}

static void reap(void)
{
    int status;
    struct rusage ru;
    pid_t pid;
    while ((pid = wait4(-1, &status, WNOHANG, &ru)) > 0) {
        for (int i = 0; i < MAX_EXECS; i++) {
            if (running[i].pid != pid)
                continue;
            char rec[256];
            ssize_t n = read(running[i].errpipe, rec, sizeof(rec) - 1);
            close(running[i].errpipe);
            running[i].pid = 0;
            if (n >= (ssize_t)sizeof(int)) {
                int err;
                memcpy(&err, rec, sizeof(err));
                rec[n] = '\0';
                send_error(KP_EXEC_ERR, running[i].id, err, "%s", rec + sizeof(err));
                break;
            }
            uint64_t usage[3] = {
                (uint64_t)ru.ru_utime.tv_sec * 1000000u + (uint64_t)ru.ru_utime.tv_usec,
                (uint64_t)ru.ru_stime.tv_sec * 1000000u + (uint64_t)ru.ru_stime.tv_usec,
                (uint64_t)ru.ru_maxrss,
            };
            struct out o;
            out_init(&o, KP_EXITED, running[i].id);
            out_u32(&o, KT_WAIT_STATUS, (uint32_t)status);
            out_rec(&o, KT_RUSAGE, usage, sizeof(usage));
            out_send(&o, -1);
            break;
        }
        /* anything else is an orphan reparented to us: reaped, nothing to report */
    }
}

static void serve(void)
{
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0)
        setup_fail("signalfd");
    for (;;) {
        struct pollfd p[2] = {{CTL_FD, POLLIN, 0}, {sfd, POLLIN, 0}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            _exit(1);
        }
        if (p[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof(si)) > 0) {
            }
            reap();
        }
        if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            int fds[MAX_FDS], nfds;
            ssize_t n = recv_msg(fds, &nfds);
            if (n == 0 || (n < 0 && errno != EMSGSIZE && errno != EAGAIN))
                _exit(0); /* host gone: our exit takes every process inside with it */
            if (n < 0) {
                send_error(KP_EXEC_ERR, 0, EMSGSIZE, "request too large");
                continue;
            }
            if ((size_t)n < sizeof(struct kp_header)) {
                for (int i = 0; i < nfds; i++)
                    close(fds[i]);
                continue;
            }
            struct kp_header h;
            memcpy(&h, msgbuf, sizeof(h));
            if (h.type == KP_EXEC) {
                handle_exec(h.id, msgbuf, (size_t)n, fds, nfds);
            } else {
                for (int i = 0; i < nfds; i++)
                    close(fds[i]);
                if (h.type == KP_SIGNAL)
                    handle_signal(h.id, msgbuf, (size_t)n);
            }
        }
    }
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
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    if (n <= 0)
        _exit(1); /* host went away before configuring us */
    struct kp_header h;
    memcpy(&h, msgbuf, sizeof(h));
    if ((size_t)n < sizeof(h) || h.type != KP_CONFIG) {
        errno = EPROTO;
        setup_fail("first message is not a config");
    }
    /* On cgroup v1 the host moved us into our cgroup after clone3 made our cgroup
     * namespace; re-root it at the sandbox's own cgroup so nothing above shows. */
    if (unshare(CLONE_NEWCGROUP) < 0)
        setup_fail("unshare the cgroup namespace");
    /* Copy the config out of msgbuf: it is reused for requests. */
    static char config[KP_MAX_MSG] __attribute__((aligned(8)));
    memcpy(config, msgbuf, (size_t)n);
    apply_config(config, (size_t)n);
    if (!cfg.nested && setgroups(0, NULL) < 0)
        setup_fail("drop supplementary groups");
    enter_root();
    /* inotify instances and watches are counted per user and, on the host, against the
     * user namespace's creator: cap what this sandbox can take from that shared pool.
     * These files are the limits of our own user namespace (we are its root). */
    set_sysctl("/proc/sys/user/max_inotify_instances", "32");
    set_sysctl("/proc/sys/user/max_inotify_watches", "16384");
    if (cfg.hostname && sethostname(cfg.hostname, strlen(cfg.hostname)) < 0)
        setup_fail("sethostname");
    if (cfg.loopback)
        bring_up_loopback();
    if (cfg.filter_len) {
        /* A kernel without seccomp (or without the actions the policy returns) must
         * refuse the sandbox now, not fail every exec later. */
        uint32_t actions[] = {SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW};
        for (size_t i = 0; i < sizeof(actions) / sizeof(actions[0]); i++)
            if (syscall(SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0, &actions[i]) < 0)
                setup_fail("seccomp filter support (action 0x%x)", actions[i]);
    }
    if (setsid() < 0)
        setup_fail("setsid");
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* setresuid above reset it */
    if (!cfg.nested) {
        /* The agent's empty bounding set and its seccomp filter, once for every
         * command: each command's process inherits both through fork, and so skips a
         * filter load (BPF conversion, JIT and the kernel's verdict cache) per exec.
         * Neither takes anything init uses from here on: the bounding set limits only
         * what an execve grants, and the policy allows fork, wait, signals, the
         * socket and every step agent_child takes. In nested mode each command first
         * makes a user namespace, which the filter forbids and which refills the
         * bounding set, so there agent_child does both itself. */
        drop_bounding_set();
        if (cfg.filter_len && load_filter() < 0)
            setup_fail("load seccomp filter");
    }

    /* Hand the host a directory fd of the workspace: it keeps the tmpfs reachable
     * for the scanner after every process inside is gone. */
    int ws = open("/workspace", O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (ws < 0)
        setup_fail("open /workspace");
    struct out o;
    out_init(&o, KP_READY, 0);
    if (out_send(&o, ws) < 0)
        _exit(1);
    close(ws);
    serve();
    return 0;
}
