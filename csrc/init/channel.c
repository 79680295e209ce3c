/* The control channel: building, sending and receiving messages (csrc/protocol.h). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "init.h"

char msgbuf[KP_MAX_MSG] __attribute__((aligned(8)));

void out_init(struct out *o, uint32_t type, uint32_t id)
{
    struct kp_header h = {type, id};
    memcpy(o->buf, &h, sizeof(h));
    o->len = sizeof(h);
}

void out_rec(struct out *o, uint32_t tag, const void *data, uint32_t len)
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

void out_u32(struct out *o, uint32_t tag, uint32_t v) { out_rec(o, tag, &v, sizeof(v)); }

int out_send(struct out *o, int fd_to_pass)
{
    return out_send_fds(o, &fd_to_pass, fd_to_pass >= 0 ? 1 : 0);
}

int out_send_fds(struct out *o, const int *fds, int nfds)
{
    struct iovec iov = {o->buf, o->len};
    struct msghdr mh = {0};
    union {
        char buf[CMSG_SPACE(sizeof(int) * (2 + MAX_LISTEN))];
        struct cmsghdr align;
    } ctl;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (nfds > 2 + MAX_LISTEN) {
        errno = EINVAL;
        return -1;
    }
    if (nfds > 0) {
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.buf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t n;
    do
        n = sendmsg(CTL_FD, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n < 0 ? -1 : 0;
}

void send_error(uint32_t type, uint32_t id, uint32_t step, int err, const char *fmt, ...)
{
    struct out o;
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    out_init(&o, type, id);
    out_u32(&o, KT_STEP, step);
    out_u32(&o, KT_ERRNO, (uint32_t)err);
    out_rec(&o, KT_WHAT, what, (uint32_t)strlen(what) + 1);
    out_send(&o, -1);
}

/* Setup failed: say which step (a KS_* code, and in words) and why, then exit.
 * Nothing has run as the agent. */
void __attribute__((noreturn)) setup_fail(uint32_t step, const char *fmt, ...)
{
    int err = errno;
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    send_error(KP_SETUP_ERR, 0, step, err, "%s", what);
    _exit(1);
}

/* Iterate the records of a message. Returns 0 at the end, -1 on a malformed record. */
int next_record(const char **pos, const char *end, uint32_t *tag, const char **data,
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
ssize_t recv_msg(int *fds, int *nfds)
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
