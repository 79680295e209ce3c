/* The plain entries of a layer tar applied in C; extract.h says what and why it is safe. */
#include "extract.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define BLOCK 512
#define NOBODY 65534
#define MAX_MTIME 9000000000LL /* extract.py's _MAX_MTIME */
#define NEW_FILE (O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC)

/* A field up to its first NUL, as tarstream's _text. */
static size_t text_len(const uint8_t *field, size_t size) {
    const uint8_t *nul = memchr(field, 0, size);
    return nul ? (size_t)(nul - field) : size;
}

static int is_space(uint8_t c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* An octal field as tarstream's _number reads it; -1 for what Python alone handles
 * (base-256, anything not octal). */
static int64_t octal(const uint8_t *field, size_t size) {
    if (field[0] == 0200 || field[0] == 0377)
        return -1;
    size_t end = text_len(field, size), start = 0;
    while (start < end && is_space(field[start]))
        start++;
    while (end > start && is_space(field[end - 1]))
        end--;
    int64_t n = 0;
    for (size_t i = start; i < end; i++) {
        if (field[i] < '0' || field[i] > '7' || n > (INT64_MAX >> 3))
            return -1;
        n = n * 8 + (field[i] - '0');
    }
    return n;
}

static int checksum_ok(const uint8_t *block) {
    int64_t want = octal(block + 148, 8);
    if (want < 0)
        return 0;
    int64_t unsigned_sum = 256, signed_sum = 256; /* the field counts as 8 spaces */
    for (int i = 0; i < BLOCK; i++) {
        if (i >= 148 && i < 156)
            continue;
        unsigned_sum += block[i];
        signed_sum += (int8_t)block[i];
    }
    return want == unsigned_sum || want == signed_sum;
}

static int all_zero(const uint8_t *block) {
    for (int i = 0; i < BLOCK; i++)
        if (block[i])
            return 0;
    return 1;
}

/* The name's components (as extract.py's _parts: "" and "." dropped), split into the
 * parent's and the last one's; 0 where Python must look at the name. */
struct kx_name {
    size_t parts;                       /* of the parent */
    const uint8_t *part[KX_CHAIN];      /* the parent's components */
    size_t part_len[KX_CHAIN];
    const uint8_t *base;                /* the last component */
    size_t base_len;
};

static int split_name(const uint8_t *prefix, size_t prefix_len, const uint8_t *name,
                      size_t name_len, const struct kx_budget *budget, struct kx_name *out) {
    size_t raw_len = prefix_len ? prefix_len + 1 + name_len : name_len;
    if ((int64_t)raw_len > budget->max_path_bytes)
        return 0;
    const uint8_t *first = prefix_len ? prefix : name;
    if (raw_len == 0 || first[0] == '/')
        return 0;
    int64_t depth = 0;
    out->parts = 0, out->base = NULL, out->base_len = 0;
    for (int part = prefix_len ? 0 : 1; part < 2; part++) {
        const uint8_t *s = part ? name : prefix;
        size_t n = part ? name_len : prefix_len;
        size_t i = 0;
        while (i < n) {
            size_t j = i;
            while (j < n && s[j] != '/')
                j++;
            size_t len = j - i;
            if (len && !(len == 1 && s[i] == '.')) {
                if (len == 2 && s[i] == '.' && s[i + 1] == '.')
                    return 0;
                if (len >= 4 && memcmp(s + i, ".wh.", 4) == 0)
                    return 0;
                if (++depth > budget->max_depth)
                    return 0;
                if (out->base) { /* the component before this one is the parent's */
                    if (out->parts == KX_CHAIN)
                        return 0;
                    out->part[out->parts] = out->base;
                    out->part_len[out->parts++] = out->base_len;
                }
                out->base = s + i, out->base_len = len;
            }
            i = j + 1;
        }
    }
    return out->base != NULL;
}

/* How many of the first directories of nm's parent the chain's first ones are. */
static size_t in_chain(const struct kx_name *nm, const struct kx_chain *chain) {
    size_t at = 0, i = 0;
    for (; i < nm->parts && i < chain->n; i++) {
        size_t len = nm->part_len[i];
        if (at + len > chain->path_len || memcmp(chain->path + at, nm->part[i], len) != 0 ||
            (at + len < chain->path_len && chain->path[at + len] != '/'))
            break;
        at += len + 1;
    }
    return i;
}

/* The chain cut back to its first n directories (those below closed). */
static void leave(struct kx_chain *chain, size_t n) {
    while (chain->n > n)
        close(chain->fds[--chain->n]);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t *slash = memchr(chain->path + at, '/', chain->path_len - at);
        at = slash ? (size_t)(slash - chain->path) + 1 : chain->path_len + 1;
    }
    chain->path_len = n ? at - 1 : 0;
}

/* The directory fd appended to the chain as its component name[0:len]. */
static void push(struct kx_chain *chain, int fd, const uint8_t *name, size_t len) {
    chain->fds[chain->n++] = fd;
    if (chain->path_len)
        chain->path[chain->path_len++] = '/';
    memcpy(chain->path + chain->path_len, name, len);
    chain->path_len += len;
}

/* The chain made nm's parent: cut back to the first `common` directories, which it shares,
 * then each further one opened below, a directory already there (O_NOFOLLOW: never through
 * a symlink) with owner rwx (else extract.py, which opens one up when unprivileged). 0
 * where one is missing, is not such a directory or does not fit: extract.py does that
 * entry, from the chain as it is then (each fd the directory of its path). */
static int reach(struct kx_chain *chain, const struct kx_name *nm, size_t common) {
    leave(chain, common);
    for (size_t i = common; i < nm->parts; i++) {
        size_t len = nm->part_len[i];
        char part[256];
        if (chain->n == KX_CHAIN || chain->path_len + 1 + len > KX_PATH || len >= sizeof part)
            return 0;
        memcpy(part, nm->part[i], len);
        part[len] = 0;
        int parent = chain->n ? chain->fds[chain->n - 1] : chain->root;
        int fd = openat(parent, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0)
            return 0;
        struct stat st;
        if (fstat(fd, &st) != 0 || (st.st_mode & 0700) != 0700) {
            close(fd);
            return 0;
        }
        push(chain, fd, nm->part[i], len);
    }
    return 1;
}

static int owner(int chown_ids, int64_t uid, int64_t gid, uid_t *u, gid_t *g) {
    if (!chown_ids)
        return 0;
    *u = uid < 65536 ? (uid_t)uid : NOBODY;
    *g = gid < 65536 ? (gid_t)gid : NOBODY;
    return 1;
}

static int write_all(int fd, const uint8_t *data, size_t n) {
    while (n) {
        ssize_t w = write(fd, data, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        data += w, n -= (size_t)w;
    }
    return 0;
}

/* Files left open for karotte_extract_finish by every run of this process: open_max
 * bounds these, so that imports in threads of one process share its descriptors. */
static int64_t open_all;

#define THERE 2 /* put_file's and put_symlink's: the name is taken (clear it, then again) */

/* What a lower layer (or an earlier entry) left at base, unless a directory, unlinked as
 * extract.py's _clear unlinks it; the bytes that frees (its last link) into *freed.
 * 0 where Python must do it: a directory (removed whole, fd-relative), a failing call. */
static int clear(int dir_fd, const char *base, int64_t *freed) {
    struct stat st;
    if (fstatat(dir_fd, base, &st, AT_SYMLINK_NOFOLLOW) != 0 || S_ISDIR(st.st_mode))
        return 0;
    if (unlinkat(dir_fd, base, 0) != 0)
        return 0;
    *freed = S_ISREG(st.st_mode) && st.st_nlink == 1 ? st.st_size : 0;
    return 1;
}

/* One regular file, new in dir_fd; 0 where Python must do it (nothing is left behind),
 * THERE where the name is taken. Deferred (count->open_max allows it): made, sized, owned
 * and moded, its fd left open in done->fd for karotte_extract_finish, which writes it. */
static int put_file(int dir_fd, const char *base, const uint8_t *data, int64_t size,
                    int64_t mode, int chown_ids, int64_t uid, int64_t gid, int64_t mtime,
                    struct kx_count *count, struct kx_done *done) {
    /* IMG-SETUID-01: the permission bits only. Made with them, so that fchmod is needed
     * only where the umask took some (and fchown only where the owner is not already
     * the one to give): fstat says, as it says the inode. */
    mode_t want = (mode_t)(mode & 0777);
    int fd = openat(dir_fd, base, NEW_FILE, want);
    if (fd < 0)
        return errno == EEXIST ? THERE : 0;
    int defer = count->open_max > 0 &&
                __atomic_load_n(&open_all, __ATOMIC_RELAXED) < count->open_max;
    uid_t u;
    gid_t g;
    struct timespec times[2] = {{mtime, 0}, {mtime, 0}};
    struct stat st;
    int ok = fstat(fd, &st) == 0 &&
             (defer ? size == 0 || ftruncate(fd, size) == 0
                    : write_all(fd, data, (size_t)size) == 0) &&
             (!owner(chown_ids, uid, gid, &u, &g) || (st.st_uid == u && st.st_gid == g) ||
              fchown(fd, u, g) == 0) &&
             ((st.st_mode & 07777) == want || fchmod(fd, want) == 0) &&
             (defer || futimens(fd, times) == 0);
    if (!ok) {
        close(fd);
        unlinkat(dir_fd, base, 0);
        return 0;
    }
    if (defer) {
        done->fd = fd;
        __atomic_add_fetch(&count->open, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&open_all, 1, __ATOMIC_RELAXED);
    } else {
        close(fd);
    }
    done->ino = st.st_ino;
    done->size = size;
    done->mtime = mtime;
    done->kind = KX_FILE;
    return 1;
}

static int put_symlink(int dir_fd, const char *base, const char *target, int chown_ids,
                       int64_t uid, int64_t gid, int64_t mtime, struct kx_done *done) {
    /* Kept as the image has it, absolute or not; nothing here ever follows it. */
    if (symlinkat(target, dir_fd, base) != 0)
        return errno == EEXIST ? THERE : 0;
    uid_t u;
    gid_t g;
    struct timespec times[2] = {{mtime, 0}, {mtime, 0}};
    if ((owner(chown_ids, uid, gid, &u, &g) &&
         fchownat(dir_fd, base, u, g, AT_SYMLINK_NOFOLLOW) != 0) ||
        utimensat(dir_fd, base, times, AT_SYMLINK_NOFOLLOW) != 0) {
        unlinkat(dir_fd, base, 0);
        return 0;
    }
    done->kind = KX_SYMLINK;
    return 1;
}

/* A new directory in dir_fd, made 0700 as extract.py's _dir makes it (its mode and mtime
 * are set when the layer ends), and its fd; -1 where Python must do it (nothing left). */
static int put_dir(int dir_fd, const char *base, int chown_ids, int64_t uid, int64_t gid,
                   int64_t mode, int64_t mtime, struct kx_done *done) {
    if (mkdirat(dir_fd, base, 0700) != 0)
        return -1;
    int fd = openat(dir_fd, base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    uid_t u;
    gid_t g;
    struct stat st;
    if (fd < 0 || (owner(chown_ids, uid, gid, &u, &g) &&
                   (fstat(fd, &st) != 0 || ((st.st_uid != u || st.st_gid != g) &&
                                            fchown(fd, u, g) != 0)))) {
        if (fd >= 0)
            close(fd);
        unlinkat(dir_fd, base, AT_REMOVEDIR);
        return -1;
    }
    done->kind = KX_DIR;
    done->mode = mode;
    done->mtime = mtime;
    return fd;
}

/* The entry's path (the chain's, cut to its parent, then its name) and a NUL appended to
 * paths; 0 where it does not fit. */
static int put_path(const struct kx_chain *chain, const struct kx_name *nm, uint8_t *paths,
                    size_t cap, size_t *len, struct kx_done *done) {
    size_t parent = chain->path_len;
    size_t need = parent + (parent ? 1 : 0) + nm->base_len + 1;
    if (need > cap - *len)
        return 0;
    uint8_t *at = paths + *len;
    memcpy(at, chain->path, parent);
    at += parent;
    if (parent)
        *at++ = '/';
    memcpy(at, nm->base, nm->base_len);
    at[nm->base_len] = 0;
    done->path_off = (uint32_t)*len;
    done->path_len = (uint32_t)(need - 1);
    *len += need;
    return 1;
}

int64_t karotte_extract_run(const uint8_t *buf, size_t len, struct kx_chain *chain,
                            int chown_ids, const struct kx_budget *budget,
                            struct kx_count *count, struct kx_done *done, size_t max_done,
                            size_t *n_done, uint8_t *paths, size_t paths_cap,
                            size_t *paths_len, size_t *need) {
    size_t off = 0;
    size_t last_parent = (size_t)-1; /* the chain length the entry before was in */
    struct kx_name nm;
    *n_done = 0;
    *paths_len = 0;
    *need = 0;
    while (*n_done < max_done && len - off >= BLOCK) {
        const uint8_t *h = buf + off;
        if (all_zero(h) || !checksum_ok(h))
            break;
        uint8_t type = h[156];
        size_t name_len = text_len(h, 100), prefix_len = text_len(h + 345, 155);
        int file = type == '0' || type == '7' || (type == 0 && !(name_len && h[name_len - 1] == '/'));
        int dir = type == '5' || (type == 0 && !file);
        int link = type == '2';
        if (!(file || link || dir))
            break;
        int64_t mode = octal(h + 100, 8), uid = octal(h + 108, 8), gid = octal(h + 116, 8),
                size = octal(h + 124, 12), mtime = octal(h + 136, 12);
        if (mode < 0 || uid < 0 || gid < 0 || size < 0 || mtime < 0 || mtime > MAX_MTIME)
            break;
        if (count->entries + 1 > budget->max_entries)
            break;
        char name[256], target[101];
        if (!split_name(h + 345, prefix_len, h, name_len, budget, &nm) ||
            nm.base_len >= sizeof name)
            break;
        memcpy(name, nm.base, nm.base_len);
        name[nm.base_len] = 0;
        size_t span = BLOCK; /* a symlink or a directory has no data, as tarfile reads it */
        if (file) {
            span += (size_t)size + (size_t)(-size & (BLOCK - 1));
            if (size > budget->max_file_size || count->read + size > budget->max_bytes ||
                count->total + size > budget->max_bytes)
                break;
            if (span > len - off) { /* all else plain: the caller may read on and call again */
                *need = span;
                break;
            }
        } else if (link) {
            size_t target_len = text_len(h + 157, 100);
            if (target_len == 0 || (int64_t)target_len > budget->max_path_bytes)
                break;
            memcpy(target, h + 157, target_len);
            target[target_len] = 0;
        }
        size_t common = in_chain(&nm, chain);
        int moved = common < nm.parts; /* a parent below the chain's: reached, opened */
        if (moved ? !reach(chain, &nm, common) : (leave(chain, nm.parts), 0))
            break;
        if (dir && (chain->n == KX_CHAIN || chain->path_len + 1 + nm.base_len > KX_PATH))
            break;
        int dir_fd = chain->n ? chain->fds[chain->n - 1] : chain->root;
        struct kx_done *d = &done[*n_done];
        memset(d, 0, sizeof *d);
        d->fd = -1;
        if (!put_path(chain, &nm, paths, paths_cap, paths_len, d))
            break;
        int ok;
        int64_t freed = 0;
        if (file || link) {
            for (int again = 0; again < 2; again++) {
                ok = file ? put_file(dir_fd, name, h + BLOCK, size, mode, chown_ids, uid, gid,
                                     mtime, count, d)
                          : put_symlink(dir_fd, name, target, chown_ids, uid, gid, mtime, d);
                if (ok != THERE || again || !clear(dir_fd, name, &freed))
                    break;
                count->total -= freed; /* the name is free now, whatever comes next */
            }
            ok = ok == 1;
            d->data_off = off + BLOCK;
        } else {
            int fd = put_dir(dir_fd, name, chown_ids, uid, gid, mode, mtime, d);
            if ((ok = fd >= 0)) /* the entries a tar lists after a directory are its own */
                push(chain, fd, nm.base, nm.base_len);
        }
        if (!ok) {
            *paths_len = d->path_off;
            break;
        }
        d->new_parent = moved || nm.parts != last_parent;
        last_parent = dir ? (size_t)-1 : nm.parts;
        if (file)
            count->read += size, count->total += size;
        off += span;
        count->entries++;
        (*n_done)++;
    }
    return (int64_t)off;
}

size_t karotte_extract_finish(const uint8_t *buf, struct kx_done *done, size_t n,
                              struct kx_count *count, int hash) {
    size_t failed = 0;
    for (size_t i = 0; i < n; i++) {
        struct kx_done *d = &done[i];
        if (d->kind != KX_FILE)
            continue;
        const uint8_t *data = buf + d->data_off;
        if (d->fd >= 0) {
            struct timespec times[2] = {{d->mtime, 0}, {d->mtime, 0}};
            if (write_all(d->fd, data, (size_t)d->size) != 0 || futimens(d->fd, times) != 0) {
                d->err = errno;
                if (!failed)
                    failed = i + 1;
            }
            close(d->fd);
            d->fd = -1;
            __atomic_sub_fetch(&count->open, 1, __ATOMIC_RELAXED);
            __atomic_sub_fetch(&open_all, 1, __ATOMIC_RELAXED);
        }
        unsigned int md_len = 0;
        if (hash)
            EVP_Digest(data, (size_t)d->size, d->sha256, &md_len, EVP_sha256(), NULL);
    }
    return failed;
}
