/* One clone3 into fresh namespaces, then exec of karotte-init. */
#ifndef KAROTTE_SPAWN_H
#define KAROTTE_SPAWN_H

#include <stdint.h>

#include "protocol.h"

/* The fd number at which karotte-init finds its end of the control socket. */
#define KAROTTE_CHILD_FD 3

/* Returns the child's pid (> 0) or -errno. *pidfd_out receives a pidfd for it.
 * ns_flags: CLONE_NEW* flags. cgroup_fd: a cgroup v2 directory to start the child
 * in (CLONE_INTO_CGROUP), or -1. child_fd is the child's end of the control socket
 * (SOCK_SEQPACKET); the child moves it to fd 3, closes every other fd it got from the
 * caller, waits for one datagram on it (the go, sent after its id maps are written),
 * then becomes root of its user namespace and execs path. It exits instead when the
 * caller's end closes first (the caller died): the caller must hold that end in no
 * other process, so that its death is EOF for the child.
 * tasks: NULL, or a NULL-terminated list of cgroup v1 `tasks` files to start the child
 * in (the clone3 runs in a thread of its own, which first moves itself there);
 * freezer_state: NULL, or the freezer.state file of that cgroup, which must read THAWED.
 * owner_uid, owner_gid: when >= 0 (a root caller), the host ids that create and own the
 * new user namespace, in place of the caller's: that thread takes them as its effective
 * ids for the clone3 (-EPERM if it cannot). The caller's own thread changes in nothing.
 * step_out: which step failed when it returns -errno, a KS_SPAWN_* code of enum kp_step
 * (protocol.h), one table with karotte-init's steps. */
int karotte_spawn(const char *path, char *const argv[], char *const envp[],
                  int child_fd, int cgroup_fd, char *const tasks[], const char *freezer_state,
                  uint64_t ns_flags, int64_t owner_uid, int64_t owner_gid, int *pidfd_out,
                  int *step_out);

#endif
