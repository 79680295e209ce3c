/* seccomp_exec FILTER PROGRAM [ARG...]
 *
 * Test tool: loads the classic BPF program in FILTER (struct sock_filter[], as written
 * by karotte.seccomp.compile_policy) the way karotte-init does, then execs PROGRAM with
 * the ARGs. No_new_privs first: it is what lets an unprivileged process load a filter,
 * and it keeps the filter from being shed by a setuid exec.
 *
 * Exit status 125 and a message on stderr when anything fails before the exec.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SETUP_FAILED 125

static struct sock_filter insns[BPF_MAXINSNS];

int main(int argc, char *argv[])
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s FILTER PROGRAM [ARG...]\n", argv[0]);
        return SETUP_FAILED;
    }

    int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "seccomp_exec: open %s: %s\n", argv[1], strerror(errno));
        return SETUP_FAILED;
    }
    size_t have = 0;
    char *buf = (char *)insns;
    for (;;) {
        /* Read one byte past the limit so that an oversized file is noticed. */
        char extra;
        ssize_t n = have < sizeof(insns) ? read(fd, buf + have, sizeof(insns) - have)
                                         : read(fd, &extra, 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            fprintf(stderr, "seccomp_exec: read %s: %s\n", argv[1], strerror(errno));
            return SETUP_FAILED;
        }
        if (n == 0)
            break;
        if (have == sizeof(insns)) {
            fprintf(stderr, "seccomp_exec: %s holds more than %d instructions\n", argv[1],
                    BPF_MAXINSNS);
            return SETUP_FAILED;
        }
        have += (size_t)n;
    }
    close(fd);
    if (have == 0 || have % sizeof(struct sock_filter) != 0) {
        fprintf(stderr, "seccomp_exec: %s is %zu bytes, not a whole number of 8-byte "
                        "instructions\n", argv[1], have);
        return SETUP_FAILED;
    }

    struct sock_fprog prog = {
        .len = (unsigned short)(have / sizeof(struct sock_filter)),
        .filter = insns,
    };
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        fprintf(stderr, "seccomp_exec: PR_SET_NO_NEW_PRIVS: %s\n", strerror(errno));
        return SETUP_FAILED;
    }
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) {
        fprintf(stderr, "seccomp_exec: seccomp(SECCOMP_SET_MODE_FILTER): %s\n", strerror(errno));
        return SETUP_FAILED;
    }
    execv(argv[2], argv + 2);
    fprintf(stderr, "seccomp_exec: exec %s: %s\n", argv[2], strerror(errno));
    return SETUP_FAILED;
}
