/* The control channel between the host and karotte-init.
 *
 * A SOCK_SEQPACKET socketpair: one datagram is one message, so there is no framing
 * to get wrong, and fds travel with SCM_RIGHTS. Every message starts with a header;
 * the payload is a sequence of records (tag, length, bytes). karotte/protocol.py takes
 * this file's numbers and layouts from karotte/_protocol_h.py, which
 * scripts/protocol_h.py generates from it with the C compiler: run that after an edit
 * here (tests/test_protocol.py fails until you do). Every struct spells out its padding.
 */
#ifndef KAROTTE_PROTOCOL_H
#define KAROTTE_PROTOCOL_H

#include <stdint.h>

#define KP_MAX_MSG (256 * 1024)

/* The most an agent may hold (KT_CAPS, SandboxSpec.agent_user="root"): the file-ownership
 * capabilities of root of the sandbox's user namespace, bits CHOWN 0, DAC_OVERRIDE 1,
 * FOWNER 3, FSETID 4, KILL 5, SETGID 6, SETUID 7. init refuses a config with any other.
 * Why these suffice and what stays out: docs/image-sandbox.md, "Root inside". */
#define KP_ROOT_CAPS 0xfbULL

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
    KP_CONFIG = 1, /* the sandbox plan, init's first message; on an image, from a root
                      caller, the image's tree attached: a detached idmapped mount (KM_OVERLAY),
                      and after it the vetted diff's, if the plan has a KM_LAYER */
    KP_EXEC = 2,   /* run a command as the agent; fds stdin, stdout, stderr attached,
                      or none with KT_TTY: init then makes a pty for it */
    KP_SIGNAL = 3, /* signal an exec's process group: record KT_SIGNAL */
};

/* init -> host */
enum {
    KP_READY = 101,     /* setup done; fds: a directory of /workspace, on an image
                           (KM_OVERLAY) one of the overlay's upper after it, then the
                           egress listeners */
    KP_SETUP_ERR = 102, /* setup failed: KT_STEP, KT_ERRNO, KT_WHAT; init exits after it */
    KP_EXEC_ERR = 104,  /* exec id could not start: KT_STEP, KT_ERRNO, KT_WHAT */
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
    KT_RLIMIT = 5,   /* struct kp_rlimit */
    KT_LOOPBACK = 6, /* bring lo up; u32 ports of the egress listeners to make on it, if any */
    KT_CAPS = 7,     /* u64: the agent's capabilities, within KP_ROOT_CAPS; absent: none */
    /* KP_EXEC */
    KT_ARGV = 20, /* NUL-separated strings */
    KT_ENV = 21,  /* NUL-separated strings */
    KT_CWD = 22,  /* string */
    KT_TTY = 23,  /* empty: run on a new pty of the sandbox's devpts (sent back as KP_TTY) */
    /* KP_SIGNAL */
    KT_SIGNAL = 30, /* u32 signal number */
    /* replies */
    KT_ERRNO = 40,       /* u32 */
    KT_WHAT = 41,        /* string: the failed step in words, for people (may name a path) */
    KT_STEP = 42,        /* u32: the failed step, enum kp_step */
    KT_WAIT_STATUS = 43, /* u32, as from waitpid */
    KT_RUSAGE = 44,      /* struct kp_rusage */
};

/* The step at which a sandbox's start or an exec failed: KT_STEP of KP_SETUP_ERR and
 * KP_EXEC_ERR, and karotte_spawn's *step_out (KS_SPAWN_*). One code per step; what
 * each means for `karotte-sandbox check` is karotte/steps.py. */
enum kp_step {
    /* karotte_spawn (csrc/spawn.c) */
    KS_SPAWN_THREAD = 1, /* pthread_create */
    KS_SPAWN_CGROUP = 2, /* the v1 freezer was not THAWED (EBUSY), or a tasks write */
    KS_SPAWN_OWNER = 3,  /* taking the namespace owner ids */
    KS_SPAWN_CLONE3 = 4, /* clone3 itself */
    /* setup: the config (csrc/init/main.c) */
    KS_CONFIG_MESSAGE = 10, /* the first message is not KP_CONFIG */
    KS_CONFIG_RECORD = 11,  /* a malformed config record */
    KS_CGROUP_NAMESPACE = 12,
    KS_SETGROUPS = 13, /* drop supplementary groups (init, or an exec's child) */
    KS_SYSCTL = 14,    /* the user namespace's inotify limits */
    KS_HOSTNAME = 15,
    KS_SECCOMP_SUPPORT = 16, /* SECCOMP_GET_ACTION_AVAIL for the policy's actions */
    KS_SETSID = 17,          /* init's session, or an exec's child's */
    KS_SECCOMP_LOAD = 18,    /* by init, or by an exec's child in nested mode */
    KS_WORKSPACE = 19,       /* open /workspace for the host */
    KS_SIGNALFD = 20,
    KS_BOUNDING_SET = 21, /* reduce it to the agent's capabilities: by init, or by an exec's
                             child in nested mode */
    KS_HIDE_INIT = 22,    /* agent_user "root": remount /proc hidepid=2, so init is hidden */
    /* setup: the roots (csrc/init/mounts.c) */
    KS_MOUNT_PRIVATE = 30, /* make / private */
    KS_STAGING_TMPFS = 31,
    KS_STAGING_DIRS = 32,
    KS_STAGING_PIVOT = 33, /* pivot_root into the staging tmpfs */
    KS_CHDIR_ROOT = 34,    /* chdir / after a pivot */
    KS_NEWROOT_TMPFS = 35, /* the tmpfs of the sandbox's root */
    KS_DETACH_HOST = 36,   /* detach the host's tree */
    KS_CHDIR_NEWROOT = 37,
    KS_PIVOT_ROOT = 38, /* pivot_root into the sandbox's root */
    KS_DETACH_STAGING = 39,
    /* setup: the mount plan (csrc/init/mounts.c) */
    KS_MKDIR = 50, /* a mount point's directories */
    KS_BIND_SOURCE = 51,
    KS_BIND_TARGET = 52,
    KS_BIND = 53,
    KS_MOUNT_SETATTR = 54,
    KS_TMPFS = 55,
    KS_MOUNT_PROC = 56,
    KS_MOUNT_DEVPTS = 57,
    KS_PTMX = 58, /* the /dev/ptmx symlink into the devpts */
    KS_SYMLINK = 59,
    KS_DIR = 60,  /* KM_DIR's owner or mode */
    KS_FILE = 61, /* KM_FILE's create, write or mode */
    KS_MOUNT_OP = 62, /* an unknown KM_* operation, or KM_OVERLAY not first */
    KS_OVERLAY_LOWER = 63, /* a lower: the image's tree or the vetted diff, moved into place or
                              bound; the layer of the plan's mount points */
    KS_OVERLAY_UPPER = 64, /* the tmpfs of the upper and work directories */
    KS_OVERLAY = 65,       /* the overlay mount of the root */
    /* setup: the network (csrc/init/net.c) */
    KS_LOOPBACK = 70,
    /* exec: the request (csrc/init/serve.c) */
    KS_EXEC_SLOTS = 80,   /* too many execs at once */
    KS_EXEC_REQUEST = 81, /* malformed or too large */
    KS_PTY = 82,
    KS_PIPE = 83,
    KS_FORK = 84,
    /* exec: the agent's child (csrc/init/agent.c) */
    KS_OOM_SCORE = 90, /* reset oom_score_adj */
    KS_SIGMASK = 91,
    KS_CTTY = 92,
    KS_CLOSE_FDS = 93,
    KS_RLIMIT = 94,
    KS_AGENT_USERNS = 95, /* nested mode: the agent's own user namespace */
    KS_AGENT_UID_MAP = 96,
    KS_AGENT_GID_MAP = 97,
    KS_SETRESGID = 98,
    KS_SETRESUID = 99,
    KS_CHDIR = 100, /* the exec's cwd */
    KS_NO_NEW_PRIVS = 101,
    KS_EXECVE = 102,
    KS_AGENT_CAPS = 103, /* capset to exactly KT_CAPS */
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
    KM_OVERLAY = 8, /* the root (dst /), first of the plan (after a KM_LAYER): an overlay whose
                       lower is the tree src (read-only, nosuid, nodev; the attached idmapped
                       mount if the config has one), upper and work on a tmpfs of size and
                       inodes, and above the lower a layer of the plan's mount points */
    KM_LAYER = 9,   /* (dst /) a vetted diff src, laid read-only over the tree by the next
                       KM_OVERLAY: the config's second fd if the tree came as one */
};

#define KMF_RDONLY 0x1 /* read-only */
#define KMF_DEV 0x2    /* keep device access: only for single device-node binds */
#define KMF_NOSYMFOLLOW 0x4 /* (KM_BIND) follow no symlink in it (Linux 5.14); readlink works */

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

struct kp_rlimit {
    uint32_t resource;
    uint32_t pad;
    uint64_t cur;
    uint64_t max;
};

struct kp_rusage {
    uint64_t utime_us;
    uint64_t stime_us;
    uint64_t maxrss_kib;
};

#endif
