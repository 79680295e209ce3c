/* A store tree listed for its manifest; tree.h says what and why it never follows a link. */
#include "tree.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DIR_OPEN (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
#define FILE_OPEN (O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC)
#define MAX_DEPTH 4096 /* directories deep at most (ELOOP past it): frames are small, data on the heap */
#define READ (1 << 20)
#define TARGET 4096 /* bytes of a symlink's target at most (PATH_MAX) */

static int grow(void **buf, size_t *cap, size_t need, size_t unit) {
    if (need <= *cap)
        return 0;
    size_t cap2 = *cap ? *cap : 1024;
    while (cap2 < need)
        cap2 *= 2;
    void *p = realloc(*buf, cap2 * unit);
    if (!p)
        return -1;
    *buf = p, *cap = cap2;
    return 0;
}

/* bytes appended to the text; their offset, or -1 (EOVERFLOW past what an entry's
 * 32-bit offsets reach). */
static int64_t put_text(struct kt_tree *t, const void *data, size_t n) {
    if (t->len + n > UINT32_MAX) {
        errno = EOVERFLOW;
        return -1;
    }
    if (grow((void **)&t->text, &t->text_cap, t->len + n, 1) != 0)
        return -1;
    memcpy(t->text + t->len, data, n);
    t->len += n;
    return (int64_t)(t->len - n);
}

static struct kt_entry *put_entry(struct kt_tree *t, const struct stat *st, uint32_t kind,
                                  size_t path_off, size_t path_len) {
    if (grow((void **)&t->entries, &t->cap, t->n + 1, sizeof *t->entries) != 0)
        return NULL;
    struct kt_entry *e = &t->entries[t->n];
    memset(e, 0, sizeof *e);
    e->ino = st->st_ino;
    e->size = kind == KT_DIR ? 0 : st->st_size;
    e->mode = st->st_mode & 07777;
    e->uid = st->st_uid, e->gid = st->st_gid;
    e->kind = kind;
    e->path_off = (uint32_t)path_off, e->path_len = (uint32_t)path_len;
    return e;
}

/* The index of the file's (inode, size) in known, or -1. */
static int64_t known_file(const int64_t *known, size_t n, const struct stat *st) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        uint64_t ino = (uint64_t)known[2 * mid];
        if (ino == st->st_ino)
            return known[2 * mid + 1] == st->st_size ? (int64_t)mid : -1;
        if (ino < st->st_ino)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

/* 0 hashed; 1 changed while read; -1 failed. buf: READ bytes to read into. */
static int hash_file(int dir_fd, const char *name, const struct stat *st, uint8_t *out,
                     uint8_t *buf) {
    int fd = openat(dir_fd, name, FILE_OPEN);
    if (fd < 0)
        return errno == ELOOP || errno == ENOENT ? 1 : -1;
    struct stat now;
    int rc = -1;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || fstat(fd, &now) != 0)
        goto out;
    rc = 1;
    if (now.st_ino != st->st_ino || now.st_size != st->st_size || !S_ISREG(now.st_mode))
        goto out;
    rc = -1;
    if (EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1)
        goto out;
    int64_t total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, READ);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            goto out;
        if (n == 0)
            break;
        total += n;
        if (EVP_DigestUpdate(md, buf, (size_t)n) != 1)
            goto out;
    }
    unsigned int len = 0;
    rc = total != st->st_size ? 1 : EVP_DigestFinal_ex(md, out, &len) == 1 ? 0 : -1;
out:
    if (rc < 0 && !errno)
        errno = EIO;
    int saved = errno;
    EVP_MD_CTX_free(md);
    close(fd);
    errno = saved;
    return rc;
}

struct name {
    const char *s;
    size_t len;
};

static int by_bytes(const void *a, const void *b) {
    const struct name *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->s, y->s, n);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* The names in the directory fd (a dup of it is read), sorted; in *store, freed by the
 * caller. -1 on failure. */
static int read_names(int fd, struct name **names, size_t *count, char **store) {
    int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0)
        return -1;
    DIR *dir = fdopendir(dup_fd);
    if (!dir) {
        close(dup_fd);
        return -1;
    }
    rewinddir(dir);
    size_t len = 0, cap = 0, n = 0, ncap = 0;
    char *text = NULL;
    size_t *offs = NULL;
    struct dirent *de;
    errno = 0;
    while ((de = readdir(dir)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        size_t l = strlen(de->d_name) + 1;
        if (grow((void **)&text, &cap, len + l, 1) != 0 ||
            grow((void **)&offs, &ncap, n + 1, sizeof *offs) != 0)
            goto fail;
        memcpy(text + len, de->d_name, l);
        offs[n++] = len;
        len += l;
        errno = 0;
    }
    if (errno)
        goto fail;
    closedir(dir);
    *names = malloc((n ? n : 1) * sizeof **names);
    if (!*names) {
        free(text), free(offs);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        (*names)[i].s = text + offs[i], (*names)[i].len = strlen(text + offs[i]);
    free(offs);
    qsort(*names, n, sizeof **names, by_bytes);
    *count = n, *store = text;
    return 0;
fail: {
    int saved = errno ? errno : ENOMEM;
    closedir(dir);
    free(text), free(offs);
    errno = saved;
    return -1;
}
}

/* The entries below the directory fd whose path is text[path_off:+path_len]. */
/* What the walk reads with: the known files, a buffer for file data and one for a
 * symlink's target (on the heap: the walk recurses once per directory level). */
struct known {
    const int64_t *pairs;
    const uint8_t *sha;
    size_t n;
    uint8_t *data;  /* READ bytes */
    char *target;   /* TARGET + 1 bytes */
};

static int walk_dir(int fd, size_t path_off, size_t path_len, int depth,
                    const struct known *known, struct kt_tree *t) {
    if (depth > MAX_DEPTH) {
        errno = ELOOP;
        return -1;
    }
    struct name *names = NULL;
    size_t count = 0;
    char *store = NULL;
    if (read_names(fd, &names, &count, &store) != 0)
        return -1;
    int rc = 0;
    for (size_t i = 0; i < count && rc == 0; i++) {
        const char *name = names[i].s;
        size_t nlen = names[i].len;
        /* The child's path: the parent's, a slash, the name (the text may move: copy). */
        size_t child_len = path_len + (path_len ? 1 : 0) + nlen;
        if (t->len + child_len > UINT32_MAX) { /* what an entry's 32-bit offsets reach */
            errno = EOVERFLOW;
            rc = -1;
            break;
        }
        if (grow((void **)&t->text, &t->text_cap, t->len + child_len, 1) != 0) {
            rc = -1;
            break;
        }
        size_t child_off = t->len;
        memmove(t->text + child_off, t->text + path_off, path_len);
        t->len += path_len;
        if (path_len)
            t->text[t->len++] = '/';
        memcpy(t->text + t->len, name, nlen);
        t->len += nlen;
        struct stat st;
        if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            rc = -1;
            break;
        }
        struct kt_entry *e;
        if (S_ISDIR(st.st_mode)) {
            int cfd = openat(fd, name, DIR_OPEN);
            struct stat now;
            if (cfd < 0 && errno != ELOOP && errno != ENOTDIR && errno != ENOENT) {
                rc = -1;
                break;
            }
            if (cfd < 0 || fstat(cfd, &now) != 0 || now.st_ino != st.st_ino) {
                if (cfd >= 0)
                    close(cfd);
                if (!put_entry(t, &st, KT_DIR, child_off, child_len)) {
                    rc = -1;
                    break;
                }
                t->changed = 1;
                rc = 1;
                break;
            }
            if (!put_entry(t, &st, KT_DIR, child_off, child_len)) {
                close(cfd);
                rc = -1;
                break;
            }
            t->n++;
            rc = walk_dir(cfd, child_off, child_len, depth + 1, known, t);
            close(cfd);
        } else if (S_ISLNK(st.st_mode)) {
            char *target = known->target;
            ssize_t n = readlinkat(fd, name, target, TARGET + 1);
            if (n < 0 || n == TARGET + 1 || n != st.st_size) {
                if (n < 0 && errno != EINVAL && errno != ENOENT) {
                    rc = -1;
                    break;
                }
                if (!put_entry(t, &st, KT_SYMLINK, child_off, child_len)) {
                    rc = -1;
                    break;
                }
                t->changed = 1;
                rc = 1;
                break;
            }
            int64_t at = put_text(t, target, (size_t)n);
            if (at < 0 || !(e = put_entry(t, &st, KT_SYMLINK, child_off, child_len))) {
                rc = -1;
                break;
            }
            e->target_off = (uint32_t)at, e->target_len = (uint32_t)n;
            t->n++;
        } else if (S_ISREG(st.st_mode)) {
            if (!(e = put_entry(t, &st, KT_FILE, child_off, child_len))) {
                rc = -1;
                break;
            }
            int64_t at = known_file(known->pairs, known->n, &st);
            if (at >= 0) {
                memcpy(e->sha256, known->sha + 32 * at, 32);
                e->hashed = 2;
            } else {
                int h = hash_file(fd, name, &st, e->sha256, known->data);
                if (h != 0) {
                    t->changed = h == 1;
                    rc = h;
                    break;
                }
                e->hashed = 1;
            }
            t->n++;
        } else {
            if (!put_entry(t, &st, KT_FILE, child_off, child_len)) {
                rc = -1;
                break;
            }
            t->bad_type = st.st_mode & S_IFMT;
            rc = 1;
        }
    }
    if (rc < 0 && !t->err)
        t->err = errno ? errno : ENOMEM;
    free(names);
    free(store);
    return rc;
}

int karotte_tree_walk(int root_fd, const int64_t *pairs, const uint8_t *known_sha,
                      size_t n_known, struct kt_tree *t) {
    struct known known = {pairs, known_sha, n_known, malloc(READ), malloc(TARGET + 1)};
    struct stat st;
    int rc = -1, fd = openat(root_fd, ".", DIR_OPEN);
    if (!known.data || !known.target)
        errno = ENOMEM;
    else if (fd >= 0 && fstat(fd, &st) == 0 && put_entry(t, &st, KT_DIR, 0, 0)) {
        t->n++;
        rc = walk_dir(fd, 0, 0, 0, &known, t);
    } else if (fd >= 0 && !errno) {
        errno = ENOMEM;
    }
    if (rc < 0 && !t->err)
        t->err = errno ? errno : ENOMEM;
    if (fd >= 0)
        close(fd);
    free(known.data), free(known.target);
    return rc;
}

void karotte_tree_free(struct kt_tree *t) {
    free(t->entries);
    free(t->text);
    t->entries = NULL, t->text = NULL;
}

/* A path or target as JSON: quoted, '"' escaped; 0 where it is not all printable ASCII
 * other than the backslash. */
static int plain(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] > 0x7e || s[i] == '\\')
            return 0;
    return 1;
}

static uint8_t *put_json(uint8_t *at, const uint8_t *s, size_t n) {
    *at++ = '"';
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '"')
            *at++ = '\\';
        *at++ = s[i];
    }
    *at++ = '"';
    return at;
}

static uint8_t *put_str(uint8_t *at, const char *s) {
    size_t n = strlen(s);
    memcpy(at, s, n);
    return at + n;
}

static uint8_t *put_int(uint8_t *at, int64_t v) {
    char digits[24];
    int n = snprintf(digits, sizeof digits, "%lld", (long long)v);
    memcpy(at, digits, (size_t)n);
    return at + n;
}

uint8_t *karotte_tree_text(const struct kt_tree *t, size_t *len, int64_t *files,
                           uint32_t *odd, size_t *n_odd) {
    static const char hex[] = "0123456789abcdef";
    size_t need = 0;
    for (size_t i = 0; i < t->n; i++) {
        const struct kt_entry *e = &t->entries[i];
        /* the fixed text, five numbers, the sha256, a path and a target, each doubled */
        need += 160 + 5 * 21 + 64 + 2 * (e->path_len + e->target_len) + 1;
    }
    uint8_t *out = malloc(need ? need : 1), *at = out;
    if (!out)
        return NULL;
    *files = 0, *n_odd = 0;
    for (size_t i = 0; i < t->n; i++) {
        const struct kt_entry *e = &t->entries[i];
        if (e->kind == KT_FILE)
            *files += e->size;
        if (!plain(t->text + e->path_off, e->path_len) ||
            !plain(t->text + e->target_off, e->target_len)) {
            *at++ = 0; /* Python writes this line: its names need escaping */
            odd[(*n_odd)++] = (uint32_t)i;
            continue;
        }
        at = put_str(at, "{\"gid\": ");
        at = put_int(at, e->gid);
        at = put_str(at, ", \"mode\": ");
        at = put_int(at, e->mode);
        at = put_str(at, ", \"path\": ");
        at = e->path_len ? put_json(at, t->text + e->path_off, e->path_len)
                         : put_str(at, "\".\"");
        at = put_str(at, ", \"sha256\": ");
        if (e->kind == KT_FILE) {
            *at++ = '"';
            for (int b = 0; b < 32; b++)
                *at++ = hex[e->sha256[b] >> 4], *at++ = hex[e->sha256[b] & 15];
            *at++ = '"';
        } else {
            at = put_str(at, "null");
        }
        at = put_str(at, ", \"size\": ");
        at = put_int(at, e->size);
        at = put_str(at, ", \"target\": ");
        at = e->kind == KT_SYMLINK ? put_json(at, t->text + e->target_off, e->target_len)
                                   : put_str(at, "null");
        at = put_str(at, e->kind == KT_FILE      ? ", \"type\": \"file\""
                         : e->kind == KT_SYMLINK ? ", \"type\": \"symlink\""
                                                 : ", \"type\": \"dir\"");
        at = put_str(at, ", \"uid\": ");
        at = put_int(at, e->uid);
        at = put_str(at, "}\n");
    }
    *len = (size_t)(at - out);
    return out;
}

void karotte_tree_text_free(uint8_t *text) {
    free(text);
}
