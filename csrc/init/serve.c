/* Serving the host: exec requests, signals to an exec's group, exit reports. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "init.h"

struct running {
    uint32_t id;
    pid_t pid;
    int errpipe; /* read end: holds a struct exec_failure if the child failed before exec */
};

static struct running running[MAX_EXECS];

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
        send_error(KP_EXEC_ERR, id, KS_EXEC_SLOTS, EAGAIN, "too many execs at once");
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
        send_error(KP_EXEC_ERR, id, KS_EXEC_REQUEST, EPROTO, "malformed exec request");
        goto out;
    }
    if (tty) {
        /* A terminal from the sandbox's own devpts: the agent's tty names resolve
         * inside, and no terminal of the host is ever its controlling tty. */
        int unlock = 0;
        master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || ioctl(master, TIOCSPTLCK, &unlock) < 0) {
            send_error(KP_EXEC_ERR, id, KS_PTY, errno, "open a pty");
            goto out;
        }
        int slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (slave < 0) {
            send_error(KP_EXEC_ERR, id, KS_PTY, errno, "open the pty's terminal");
            goto out;
        }
        fds[0] = slave;
        nfds = 1; /* the child puts it at 0, 1 and 2 */
    }
    if (pipe2(errpipe, O_CLOEXEC) < 0) {
        send_error(KP_EXEC_ERR, id, KS_PIPE, errno, "pipe");
        goto out;
    }
    pid_t pid = fork();
    if (pid < 0) {
        send_error(KP_EXEC_ERR, id, KS_FORK, errno, "fork (the sandbox's pids limit may be reached)");
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
            struct exec_failure f;
            ssize_t n = read(running[i].errpipe, &f, sizeof(f) - 1);
            close(running[i].errpipe);
            running[i].pid = 0;
            if (n >= (ssize_t)offsetof(struct exec_failure, what)) {
                ((char *)&f)[n] = '\0';
                send_error(KP_EXEC_ERR, running[i].id, f.step, f.err, "%s", f.what);
                break;
            }
            struct kp_rusage usage = {
                (uint64_t)ru.ru_utime.tv_sec * 1000000u + (uint64_t)ru.ru_utime.tv_usec,
                (uint64_t)ru.ru_stime.tv_sec * 1000000u + (uint64_t)ru.ru_stime.tv_usec,
                (uint64_t)ru.ru_maxrss,
            };
            struct out o;
            out_init(&o, KP_EXITED, running[i].id);
            out_u32(&o, KT_WAIT_STATUS, (uint32_t)status);
            out_rec(&o, KT_RUSAGE, &usage, sizeof(usage));
            out_send(&o, -1);
            break;
        }
        /* anything else is an orphan reparented to us: reaped, nothing to report */
    }
}

void serve(void)
{
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0)
        setup_fail(KS_SIGNALFD, "signalfd");
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
                send_error(KP_EXEC_ERR, 0, KS_EXEC_REQUEST, EMSGSIZE, "request too large");
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
