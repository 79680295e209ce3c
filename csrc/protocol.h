/* The control channel between the host and karotte-init.
 *
 * A SOCK_SEQPACKET socketpair: one datagram is one message, so there is no framing
 * to get wrong, and fds travel with SCM_RIGHTS. Every message starts with a header;
 * the payload is a sequence of records (tag, length, bytes). karotte/protocol.py is
 * the Python side of this file and must stay in step with it.
 */
#ifndef KAROTTE_PROTOCOL_H
#define KAROTTE_PROTOCOL_H

#include <stdint.h>

#define KP_MAX_MSG (256 * 1024)

struct kp_header {
    uint32_t type;
    uint32_t id;
};

struct kp_record {
    uint32_t tag;
    uint32_t len;
    /* len bytes follow, then padding to 8 bytes */
};

/* host -> init */
enum {
    KP_GO = 4,     /* to the spawned child, before exec: maps and cgroup are in place */
    KP_CONFIG = 1, /* the sandbox plan, init's first message */
    KP_EXEC = 2,   /* run a command as the agent; fds stdin, stdout, stderr attached,
                      or none with KT_TTY: init then makes a pty for it */
    KP_SIGNAL = 3, /* signal an exec's process group: record KT_SIGNAL */
};

/* init -> host */
enum {
    KP_READY = 101,     /* setup done; a directory fd of /workspace is attached */
    KP_SETUP_ERR = 102, /* setup failed: KT_ERRNO, KT_WHAT; init exits after it */
    KP_EXEC_ERR = 104,  /* exec id could not start: KT_ERRNO, KT_WHAT */
    KP_EXITED = 105,    /* exec id ended: KT_WAIT_STATUS, KT_RUSAGE */
    KP_TTY = 106,       /* exec id runs on a pty; its master fd is attached */
};

/* record tags */
enum {
    /* KP_CONFIG */
    KT_IDS = 1,      /* u32 agent uid, u32 agent gid, u32 nested (agent gets its own userns) */
    KT_HOSTNAME = 2, /* string */
    KT_MOUNT = 3,    /* struct kp_mount, then src\0dst\0 */
    KT_SECCOMP = 4,  /* struct sock_filter[] */
    KT_RLIMIT = 5,   /* u32 resource, u32 pad, u64 cur, u64 max */
    KT_LOOPBACK = 6, /* empty: bring lo up */
    /* KP_EXEC */
    KT_ARGV = 20, /* NUL-separated strings */
    KT_ENV = 21,  /* NUL-separated strings */
    KT_CWD = 22,  /* string */
    KT_TTY = 23,  /* empty: run on a new pty of the sandbox's devpts (sent back as KP_TTY) */
    /* KP_SIGNAL */
    KT_SIGNAL = 30, /* u32 signal number */
    /* replies */
    KT_ERRNO = 40,       /* u32 */
    KT_WHAT = 41,        /* string: which step failed */
    KT_WAIT_STATUS = 43, /* u32, as from waitpid */
    KT_RUSAGE = 44,      /* u64 utime_us, u64 stime_us, u64 maxrss_kib */
};

/* Mount plan operations, executed in order; dst is relative to the new root. */
enum {
    KM_BIND = 1,    /* bind src at dst (recursive), then apply flags */
    KM_TMPFS = 2,   /* tmpfs at dst: size, inodes, mode, uid, gid */
    KM_PROC = 3,    /* a fresh proc for the sandbox's PID namespace */
    KM_DEVPTS = 4,  /* a private devpts instance, /dev/ptmx pointing into it */
    KM_SYMLINK = 5, /* symlink dst -> src */
    KM_DIR = 6,     /* mkdir dst with mode, uid, gid */
    KM_FILE = 7,    /* file dst with content src (len in size), mode */
};

#define KMF_RDONLY 0x1 /* read-only */
#define KMF_DEV 0x2    /* keep device access: only for single device-node binds */

struct kp_mount {
    uint32_t op;
    uint32_t flags;
    uint32_t mode;
    uint32_t uid;
    uint32_t gid;
    uint32_t pad;
    uint64_t size;
    uint64_t inodes;
};

#endif
