/* The mount plan: a staging root, the sandbox's root built from KM_* records, the pivot. */
#include <errno.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "init.h"

static void write_file(const char *path, const char *data, size_t len, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode);
    if (fd < 0)
        setup_fail(KS_FILE, "create %s", path);
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            setup_fail(KS_FILE, "write %s", path);
        }
        data += n;
        len -= (size_t)n;
    }
    if (fchmod(fd, mode) < 0)
        setup_fail(KS_FILE, "chmod %s", path);
    close(fd);
}

/* mkdir -p below NEWROOT; dst is absolute inside the sandbox. */
static void make_dirs(const char *dst, mode_t mode)
{
    char path[4096];
    if (snprintf(path, sizeof(path), "%s%s", NEWROOT, dst) >= (int)sizeof(path)) {
        errno = ENAMETOOLONG;
        setup_fail(KS_MKDIR, "path %s", dst);
    }
    /* Usually the parent exists (the plan goes top-down): one mkdir. */
    if (mkdir(path, mode) == 0 || errno == EEXIST)
        return;
    if (errno != ENOENT)
        setup_fail(KS_MKDIR, "mkdir %s", dst);
    for (char *p = path + strlen(NEWROOT) + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(path, 0755) < 0 && errno != EEXIST)
            setup_fail(KS_MKDIR, "mkdir %s", path + strlen(NEWROOT));
        *p = '/';
    }
    if (mkdir(path, mode) < 0 && errno != EEXIST)
        setup_fail(KS_MKDIR, "mkdir %s", dst);
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
        setup_fail(KS_MOUNT_SETATTR, "mount_setattr %s", path);
}

/* The root on an image: an overlay whose lower is the tree (read-only, nosuid, nodev) and
 * whose upper and work directories are on a tmpfs of this sandbox's own, made here in its
 * user namespace (userxattr), in place of the root tmpfs. The lower and the tmpfs stay in
 * the staging root, which the pivot detaches: the agent never sees either, only the
 * overlay. docs/image-sandbox.md has the argument. */
static void overlay_root(const struct kp_mount *m, const char *tree)
{
    char opts[256];
    if (mkdir(LOWER, 0755) < 0 || mkdir(LAYER, 0755) < 0)
        setup_fail(KS_STAGING_DIRS, "the overlay's staging directories");
    if (cfg.tree_fd >= 0) {
        /* A root caller idmapped the tree onto our user namespace (karotte/imageroot.py):
         * its uid 0 is our root, its uid 1000 the agent. */
        if (syscall(SYS_move_mount, cfg.tree_fd, "", AT_FDCWD, LOWER, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            setup_fail(KS_OVERLAY_LOWER, "move the image tree %s into place", tree);
        close(cfg.tree_fd);
        cfg.tree_fd = -1;
    } else {
        /* An unprivileged caller: the tree as it is, the caller's files our root's. */
        char source[4096];
        if (snprintf(source, sizeof(source), "%s%s", OLDROOT, tree) >= (int)sizeof(source)) {
            errno = ENAMETOOLONG;
            setup_fail(KS_OVERLAY_LOWER, "image tree %s", tree);
        }
        if (mount(source, LOWER, NULL, MS_BIND | MS_REC, NULL) < 0)
            setup_fail(KS_OVERLAY_LOWER, "bind the image tree %s", tree);
    }
    set_mount_attrs(LOWER, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 1);
    snprintf(opts, sizeof(opts), "size=%llu,nr_inodes=%llu,mode=0755",
             (unsigned long long)m->size, (unsigned long long)m->inodes);
    if (mount("tmpfs", LAYER, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
        setup_fail(KS_OVERLAY_UPPER, "tmpfs for the overlay's upper (%s)", opts);
    if (mkdir(LAYER "/upper", 0755) < 0 || mkdir(LAYER "/work", 0755) < 0)
        setup_fail(KS_OVERLAY_UPPER, "the overlay's upper and work directories");
    /* The overlay replaces the (still empty) root tmpfs. */
    if (umount2(NEWROOT, MNT_DETACH) < 0)
        setup_fail(KS_OVERLAY, "detach the root tmpfs");
    if (mount("overlay", NEWROOT, "overlay", MS_NOSUID | MS_NODEV,
              "lowerdir=" LOWER ",upperdir=" LAYER "/upper,workdir=" LAYER "/work,userxattr") < 0)
        setup_fail(KS_OVERLAY, "overlay of the image tree %s (userxattr)", tree);
    cfg.image = 1;
}

void do_mount(const struct kp_mount *m, const char *src, const char *dst, uint32_t srclen)
{
    static int planned; /* a mount of the plan has been made: the root is in use */
    char target[4096];
    struct stat st;
    char opts[256];
    snprintf(target, sizeof(target), "%s%s", NEWROOT, dst);

    if (m->op == KM_OVERLAY) {
        if (planned || strcmp(dst, "/") != 0) {
            errno = EINVAL;
            setup_fail(KS_MOUNT_OP, "the overlay root must be the plan's first mount, at /");
        }
        planned = 1;
        overlay_root(m, src);
        return;
    }
    planned = 1;
    switch (m->op) {
    case KM_BIND: {
        char source[4096];
        if (snprintf(source, sizeof(source), "%s%s", OLDROOT, src) >= (int)sizeof(source)) {
            errno = ENAMETOOLONG;
            setup_fail(KS_BIND_SOURCE, "bind source %s", src);
        }
        if (stat(source, &st) < 0)
            setup_fail(KS_BIND_SOURCE, "bind source %s", src);
        struct stat existing;
        if (S_ISDIR(st.st_mode)) {
            make_dirs(dst, 0755);
        } else if (stat(target, &existing) < 0) {
            /* A file's mount point is made only where there is none: one that exists
             * may be in a read-only mount (/etc/hosts in the sandbox's /etc). */
            make_parent_dirs(dst);
            int fd = open(target, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
            if (fd < 0)
                setup_fail(KS_BIND_TARGET, "bind target %s", dst);
            close(fd);
        }
        if (mount(source, target, NULL, MS_BIND | MS_REC, NULL) < 0)
            setup_fail(KS_BIND, "bind %s -> %s", src, dst);
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
            setup_fail(KS_TMPFS, "tmpfs %s (%s)", dst, opts);
        return;
    case KM_PROC:
        make_dirs(dst, 0555);
        if (mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            setup_fail(KS_MOUNT_PROC, "mount proc at %s", dst);
        return;
    case KM_DEVPTS: {
        char ptmx[4200];
        make_dirs(dst, 0755);
        if (mount("devpts", target, "devpts", MS_NOSUID | MS_NOEXEC,
                  /* max: this instance's own cap; without it every sandbox draws on
                   * one host-wide pool (kernel.pty.max less the reserve) and one agent
                   * could take every pty of every other sandbox and container. */
                  "newinstance,ptmxmode=0666,mode=0620,max=64") < 0)
            setup_fail(KS_MOUNT_DEVPTS, "mount devpts at %s", dst);
        snprintf(ptmx, sizeof(ptmx), "%s/dev/ptmx", NEWROOT);
        unlink(ptmx);
        if (symlink("pts/ptmx", ptmx) < 0)
            setup_fail(KS_PTMX, "symlink /dev/ptmx");
        return;
    }
    case KM_SYMLINK:
        make_parent_dirs(dst);
        if (symlink(src, target) < 0 && errno != EEXIST)
            setup_fail(KS_SYMLINK, "symlink %s -> %s", dst, src);
        return;
    case KM_DIR:
        make_dirs(dst, m->mode);
        if (chown(target, m->uid, m->gid) < 0)
            setup_fail(KS_DIR, "chown %s", dst);
        if (chmod(target, m->mode) < 0)
            setup_fail(KS_DIR, "chmod %s", dst);
        return;
    case KM_FILE:
        make_parent_dirs(dst);
        write_file(target, src, srclen, m->mode);
        return;
    }
    errno = EINVAL;
    setup_fail(KS_MOUNT_OP, "unknown mount op %u", m->op);
}

/* Our mount namespace made private, and a staging root to build the sandbox's in. */
void enter_staging(void)
{
    /* Every mount below happens in our own mount namespace; make it private first
     * so nothing we do propagates back to the host's mounts. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        setup_fail(KS_MOUNT_PRIVATE, "make / private");
    /* A staging tmpfs becomes the root, with the host's tree moved to /oldroot, so
     * bind sources are reachable under /oldroot whatever their path (had we mounted
     * the new root over a host directory, that directory could not be bound). The
     * sandbox's real root is another tmpfs at /newroot inside it. */
    if (mount("tmpfs", STAGING, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=16,mode=0755") < 0)
        setup_fail(KS_STAGING_TMPFS, "staging tmpfs");
    if (chdir(STAGING) < 0 || mkdir("." NEWROOT, 0755) < 0 || mkdir("." OLDROOT, 0755) < 0)
        setup_fail(KS_STAGING_DIRS, "staging directories");
    if (syscall(SYS_pivot_root, ".", "." OLDROOT) < 0)
        setup_fail(KS_STAGING_PIVOT, "pivot_root into the staging tmpfs");
    if (chdir("/") < 0)
        setup_fail(KS_CHDIR_ROOT, "chdir /");
    if (mount("tmpfs", NEWROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=0755") < 0)
        setup_fail(KS_NEWROOT_TMPFS, "tmpfs for the new root");
}

void enter_root(void)
{
    /* Drop the host's tree, then pivot into the sandbox's root: pivot_root(".", ".")
     * stacks the staging root under it and the detach drops that too. chdir("/")
     * after it closes the classic escape through a cwd left in an old root. */
    if (umount2(OLDROOT, MNT_DETACH) < 0)
        setup_fail(KS_DETACH_HOST, "detach the host's tree");
    if (chdir(NEWROOT) < 0)
        setup_fail(KS_CHDIR_NEWROOT, "chdir new root");
    if (syscall(SYS_pivot_root, ".", ".") < 0)
        setup_fail(KS_PIVOT_ROOT, "pivot_root");
    if (umount2(".", MNT_DETACH) < 0)
        setup_fail(KS_DETACH_STAGING, "detach the staging root");
    if (chdir("/") < 0)
        setup_fail(KS_CHDIR_ROOT, "chdir /");
    /* The root directory itself is read-only; writable places are their own mounts. On an
     * image the root is the overlay, writable: its upper is a tmpfs with the disk limit. */
    set_mount_attrs("/", (cfg.image ? 0 : MOUNT_ATTR_RDONLY) | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
                    0);
}
