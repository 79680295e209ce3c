/* The mount plan: a staging root, the sandbox's root built from KM_* records, the pivot. */
#include <errno.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "init.h"

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

#ifndef MOUNT_ATTR_NOSYMFOLLOW
#define MOUNT_ATTR_NOSYMFOLLOW 0x00200000 /* linux/mount.h before 5.14 */
#endif

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

/* Parse a KT_MOUNT record: struct kp_mount, then src (KM_FILE: m.size bytes of content;
 * the others a string) and dst, an absolute path. Returns -1 if it is malformed. */
int mount_record(const char *data, uint32_t rlen, struct kp_mount *m, const char **src,
                 const char **dst, uint32_t *srclen)
{
    if (rlen < sizeof(*m))
        return -1;
    memcpy(m, data, sizeof(*m));
    *src = data + sizeof(*m);
    size_t rest = rlen - sizeof(*m);
    uint64_t len = m->op == KM_FILE ? m->size : strnlen(*src, rest) + 1;
    if (len >= rest)
        return -1;
    *dst = *src + len;
    size_t dstlen = strnlen(*dst, rest - len);
    if (dstlen == rest - len || (*dst)[0] != '/')
        return -1;
    *srclen = (uint32_t)len;
    return 0;
}

/* A lower of the overlay at `at`, read-only, nosuid and nodev: the attached mount that a root
 * caller idmapped onto our user namespace (karotte/imageroot.py: its uid 0 is our root, its
 * uid 1000 the agent), or for an unprivileged caller a bind of the host path as it is (the
 * caller's files are our root's). */
static void place_lower(int *fd, const char *host_path, const char *at, const char *what)
{
    if (*fd >= 0) {
        if (syscall(SYS_move_mount, *fd, "", AT_FDCWD, at, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            setup_fail(KS_OVERLAY_LOWER, "move %s %s into place", what, host_path);
        close(*fd);
        *fd = -1;
    } else {
        char source[4096];
        if (snprintf(source, sizeof(source), "%s%s", OLDROOT, host_path) >= (int)sizeof(source)) {
            errno = ENAMETOOLONG;
            setup_fail(KS_OVERLAY_LOWER, "%s %s", what, host_path);
        }
        if (mount(source, at, NULL, MS_BIND | MS_REC, NULL) < 0)
            setup_fail(KS_OVERLAY_LOWER, "bind %s %s", what, host_path);
    }
    set_mount_attrs(at, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 1);
}

/* The mount points' layer, a new directory there: the mode and owner of the directory the
 * layers below have at that path (the diff's, else the tree's), so that /home still looks
 * as the image has it; 0755 and our root's where they have none, or reach it only through
 * a symlink. */
/* fstat of the directory at inside (absolute) within layer, resolved beneath it with no
 * symlink followed: a link that the diff or the image planted (/home -> /oldroot/...)
 * must not make init stat a path of the host, which is still at OLDROOT here. */
static int stat_beneath(const char *layer, const char *inside, struct stat *st)
{
    int root = open(layer, O_PATH | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (root < 0)
        return -1;
    struct open_how how = {.flags = O_PATH | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
                                      RESOLVE_NO_MAGICLINKS};
    while (*inside == '/')
        inside++;
    int fd = (int)syscall(SYS_openat2, root, *inside ? inside : ".", &how, sizeof(how));
    close(root);
    if (fd < 0)
        return -1;
    int r = fstat(fd, st);
    close(fd);
    return r;
}

static void point_dir(const char *path)
{
    const char *inside = path + strlen(POINTS);
    struct stat st;
    mode_t mode = 0755;
    uid_t uid = 0;
    gid_t gid = 0;
    for (int i = 0; i < 2; i++) {
        const char *layer = i == 0 ? (cfg.layer ? CHANGES : NULL) : LOWER;
        if (layer && stat_beneath(layer, inside, &st) == 0 && S_ISDIR(st.st_mode)) {
            mode = st.st_mode & 07777;
            uid = st.st_uid;
            gid = st.st_gid;
            break;
        }
    }
    if (mkdir(path, 0700) < 0 && errno != EEXIST)
        setup_fail(KS_OVERLAY_LOWER, "mount point %s", inside);
    /* An unprivileged caller's tree shows ids we do not map (EINVAL): those stay ours. */
    if (chown(path, uid, gid) < 0 && errno != EINVAL)
        setup_fail(KS_OVERLAY_LOWER, "owner of the mount point %s", inside);
    if (chmod(path, mode) < 0)
        setup_fail(KS_OVERLAY_LOWER, "mode of the mount point %s", inside);
}

/* Whether the record at data is a mount of the plan whose point the layer holds; *dst then
 * names it. Symlinks and files of the plan are made inside its mounts (/dev), not points. */
static int plan_point(uint32_t tag, const char *data, uint32_t len, const char **dst,
                      struct kp_mount *m, const char **src)
{
    uint32_t srclen;
    if (tag != KT_MOUNT || mount_record(data, len, m, src, dst, &srclen) < 0)
        return 0;
    return m->op == KM_BIND || m->op == KM_TMPFS || m->op == KM_PROC || m->op == KM_DEVPTS ||
           m->op == KM_DIR;
}

static int path_below(const char *path, const char *top)
{
    size_t n = strlen(top);
    return strncmp(path, top, n) == 0 && path[n] == '/';
}

/* The top lower of an image's overlay: a small tmpfs holding the mount point of every mount
 * of the rest of the plan (rest..end) that is not inside another one, a directory or, for a
 * file's bind, an empty file. The plan's mkdirs then find them there, so that init writes
 * nothing into the upper: it holds only what the agent changed, which custody scans as the
 * agent's diff (karotte/changes.py). */
static void points_layer(const char *rest, const char *end)
{
    const char *pos = rest, *data, *dst, *src;
    uint32_t tag, len;
    struct kp_mount m;
    if (mount("tmpfs", POINTS, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=1024,mode=0755") < 0)
        setup_fail(KS_OVERLAY_LOWER, "tmpfs for the layer of the mount points");
    while (next_record(&pos, end, &tag, &data, &len) > 0) {
        if (!plan_point(tag, data, len, &dst, &m, &src))
            continue;
        const char *other_pos = rest, *other_data, *other_dst, *other_src;
        uint32_t other_tag, other_len;
        struct kp_mount other;
        int inside = 0;
        while (!inside && other_pos < pos &&
               next_record(&other_pos, end, &other_tag, &other_data, &other_len) > 0 &&
               other_data < data)
            inside = plan_point(other_tag, other_data, other_len, &other_dst, &other, &other_src) &&
                     path_below(dst, other_dst);
        if (inside)
            continue;
        char path[4200];
        if (snprintf(path, sizeof(path), "%s%s", POINTS, dst) >= (int)sizeof(path)) {
            errno = ENAMETOOLONG;
            setup_fail(KS_OVERLAY_LOWER, "mount point %s", dst);
        }
        for (char *p = path + strlen(POINTS) + 1; *p; p++) {
            if (*p != '/')
                continue;
            *p = '\0';
            point_dir(path);
            *p = '/';
        }
        char source[4200];
        struct stat st;
        snprintf(source, sizeof(source), "%s%s", OLDROOT, src);
        if (m.op == KM_BIND && stat(source, &st) == 0 && !S_ISDIR(st.st_mode)) {
            int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
            if (fd < 0)
                setup_fail(KS_OVERLAY_LOWER, "mount point %s", dst);
            close(fd);
        } else {
            point_dir(path);
        }
    }
    set_mount_attrs(POINTS, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0);
}

/* The root on an image: an overlay whose lowers are, top down, the layer of the plan's
 * mount points, the vetted diff of KM_LAYER if any, and the tree (each read-only, nosuid,
 * nodev), and whose upper and work directories are on a tmpfs of this sandbox's own, made
 * here in its user namespace (userxattr), in place of the root tmpfs. The lowers and the
 * tmpfs stay in the staging root, which the pivot detaches: the agent never sees them, only
 * the overlay. The host gets a directory fd of the upper with READY (custody's scan of the
 * agent's diff). docs/image-sandbox.md has the argument. */
static void overlay_root(const struct kp_mount *m, const char *tree, const char *rest,
                         const char *end)
{
    char opts[256];
    if (mkdir(LOWER, 0755) < 0 || mkdir(LAYER, 0755) < 0 || mkdir(POINTS, 0755) < 0 ||
        (cfg.layer && mkdir(CHANGES, 0755) < 0))
        setup_fail(KS_STAGING_DIRS, "the overlay's staging directories");
    if (cfg.layer && (cfg.tree_fd >= 0) != (cfg.layer_fd >= 0)) {
        /* Both idmapped, or both as they are: never a diff whose ids mean something else. */
        errno = EINVAL;
        setup_fail(KS_OVERLAY_LOWER, "the tree and the vetted diff %s came apart", cfg.layer);
    }
    place_lower(&cfg.tree_fd, tree, LOWER, "the image tree");
    if (cfg.layer)
        place_lower(&cfg.layer_fd, cfg.layer, CHANGES, "the vetted diff");
    points_layer(rest, end);
    snprintf(opts, sizeof(opts), "size=%llu,nr_inodes=%llu,mode=0755",
             (unsigned long long)m->size, (unsigned long long)m->inodes);
    if (mount("tmpfs", LAYER, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
        setup_fail(KS_OVERLAY_UPPER, "tmpfs for the overlay's upper (%s)", opts);
    if (mkdir(LAYER "/upper", 0755) < 0 || mkdir(LAYER "/work", 0755) < 0)
        setup_fail(KS_OVERLAY_UPPER, "the overlay's upper and work directories");
    cfg.upper_fd = open(LAYER "/upper", O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (cfg.upper_fd < 0)
        setup_fail(KS_OVERLAY_UPPER, "open the overlay's upper for the host");
    /* The overlay replaces the (still empty) root tmpfs. Its options keep the upper plain
     * for custody: no metacopy (every copied-up file holds its data), no index, and
     * redirects neither made nor followed (nofollow: userxattr refuses redirect_dir=off,
     * which this kernel reads as "follow"). docs/image-sandbox.md, "The upper as the diff". */
    if (umount2(NEWROOT, MNT_DETACH) < 0)
        setup_fail(KS_OVERLAY, "detach the root tmpfs");
    const char *lowers = cfg.layer ? POINTS ":" CHANGES ":" LOWER : POINTS ":" LOWER;
    char ovl[256];
    snprintf(ovl, sizeof(ovl), "lowerdir=%s,upperdir=" LAYER "/upper,workdir=" LAYER "/work,"
             "userxattr,redirect_dir=nofollow,metacopy=off,index=off", lowers);
    if (mount("overlay", NEWROOT, "overlay", MS_NOSUID | MS_NODEV, ovl) < 0)
        setup_fail(KS_OVERLAY, "overlay of the image tree %s (%s)", tree, ovl);
    cfg.image = 1;
}

void do_mount(const struct kp_mount *m, const char *src, const char *dst, uint32_t srclen,
              const char *rest, const char *end)
{
    static int planned; /* a mount of the plan has been made: the root is in use */
    char target[4096];
    struct stat st;
    char opts[256];
    snprintf(target, sizeof(target), "%s%s", NEWROOT, dst);

    if (m->op == KM_LAYER) {
        if (planned || cfg.layer || strcmp(dst, "/") != 0) {
            errno = EINVAL;
            setup_fail(KS_MOUNT_OP, "a vetted diff must come once, before the overlay root");
        }
        cfg.layer = src; /* in the config's buffer, which outlives the setup */
        return;
    }
    if (m->op == KM_OVERLAY) {
        if (planned || strcmp(dst, "/") != 0) {
            errno = EINVAL;
            setup_fail(KS_MOUNT_OP, "the overlay root must be the plan's first mount, at /");
        }
        planned = 1;
        overlay_root(m, src, rest, end);
        return;
    }
    if (cfg.layer && !cfg.image) {
        errno = EINVAL;
        setup_fail(KS_MOUNT_OP, "a vetted diff needs the overlay root right after it");
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
        if (m->flags & KMF_NOSYMFOLLOW) {
            /* A call of its own, so that a kernel without the attribute (before 5.14:
             * EINVAL) fails the start naming it, instead of leaving the links followable. */
            struct mount_attr a = {0};
            a.attr_set = MOUNT_ATTR_NOSYMFOLLOW;
            if (syscall(SYS_mount_setattr, AT_FDCWD, target, AT_RECURSIVE, &a, sizeof(a)) < 0)
                setup_fail(KS_MOUNT_SETATTR, "mount_setattr nosymfollow %s (needs Linux 5.14)",
                           dst);
        }
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
