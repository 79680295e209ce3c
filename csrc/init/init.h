/* karotte-init: PID 1 of a Karotte sandbox, one static binary built from csrc/init/.
 *
 * It starts in fresh namespaces as root of its user namespace, fd 3 its end of the
 * control socket; it builds the root from the KP_CONFIG plan, pivots, and serves exec
 * requests as the agent. Its exit kills the sandbox. The argument: docs/init.md.
 *
 * channel.c  messages on the control socket    mounts.c  the mount plan and the root
 * net.c      the loopback                      agent.c   an exec's child, up to execve
 * serve.c    exec requests, signals, reaping   main.c    the config and the setup order
 */
#ifndef KAROTTE_INIT_H
#define KAROTTE_INIT_H

#include <linux/filter.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "protocol.h"

#ifndef CLOSE_RANGE_CLOEXEC /* glibc's unistd.h has it, musl's does not */
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

#define CTL_FD 3
#define STAGING "/tmp"     /* where the staging tmpfs is mounted first; see enter_staging */
#define NEWROOT "/newroot" /* the sandbox's root while it is built, inside the staging root */
#define OLDROOT "/oldroot" /* the host's tree while the sandbox's root is built */
#define LOWER "/lower"     /* on an image: the overlay's lower, in the staging root */
#define LAYER "/layer"     /* on an image: the tmpfs of its upper and work, in the staging root */
#define CHANGES "/changes" /* on an image: the vetted diff laid over the tree (KM_LAYER) */
#define POINTS "/points"   /* on an image: the layer of the plan's mount points, over them all */
#define MAX_EXECS 64
#define MAX_RLIMITS 16
#define MAX_LISTEN 4 /* egress listeners: the forward proxy and up to 3 upstreams */
#define MAX_FDS 8 /* stdin, stdout, stderr and up to 5 more for the command (3, 4, ...) */

struct config {
    uint32_t agent_uid, agent_gid, nested;
    uint64_t agent_caps; /* KT_CAPS: what the agent holds, within KP_ROOT_CAPS; 0 by default */
    const char *hostname;
    const struct sock_filter *filter;
    unsigned short filter_len;
    struct kp_rlimit rlimits[MAX_RLIMITS];
    int n_rlimits;
    int loopback;
    int tree_fd;  /* the image's tree as a detached idmapped mount (KP_CONFIG's fd), or -1 */
    int layer_fd; /* the vetted diff likewise (KP_CONFIG's second fd), or -1 */
    const char *layer; /* KM_LAYER's src, the vetted diff's host path, or NULL */
    int upper_fd; /* the overlay's upper directory, for the host with KP_READY, or -1 */
    int image;    /* the root is an overlay of an image (KM_OVERLAY): it stays writable */
};

/* What an exec's child writes to its errpipe when it fails before execve. */
struct exec_failure {
    int err;
    uint32_t step; /* enum kp_step */
    char what[252];
};

extern struct config cfg;
extern char msgbuf[KP_MAX_MSG];

/* channel.c */
struct out {
    char buf[4096];
    size_t len;
};

void out_init(struct out *o, uint32_t type, uint32_t id);
void out_rec(struct out *o, uint32_t tag, const void *data, uint32_t len);
void out_u32(struct out *o, uint32_t tag, uint32_t v);
int out_send(struct out *o, int fd_to_pass);
int out_send_fds(struct out *o, const int *fds, int nfds); /* at most 2 + MAX_LISTEN */
void send_error(uint32_t type, uint32_t id, uint32_t step, int err, const char *fmt, ...);
void __attribute__((noreturn)) setup_fail(uint32_t step, const char *fmt, ...);
int next_record(const char **pos, const char *end, uint32_t *tag, const char **data,
                uint32_t *len);
ssize_t recv_msg(int *fds, int *nfds);

/* mounts.c */
void enter_staging(void);
int mount_record(const char *data, uint32_t rlen, struct kp_mount *m, const char **src,
                 const char **dst, uint32_t *srclen);
void do_mount(const struct kp_mount *m, const char *src, const char *dst, uint32_t srclen,
              const char *rest, const char *end);
void enter_root(void);

/* net.c */
int set_listeners(const char *data, uint32_t len);
void bring_up_loopback(void);
int ready_fds(int *fds, int n); /* the listeners after fds[0..n): the new count */
void close_listeners(void);

/* agent.c */
int drop_bounding_set(uint64_t keep);
int load_filter(void);
void __attribute__((noreturn)) agent_child(char **argv, char **envp, const char *cwd, int tty,
                                           int nfds, int errpipe);

/* serve.c */
void serve(void);

#endif
