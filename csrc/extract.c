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

/* The name's components (as extract.py's _parts: "" and "." dropped) checked against
 * dir_path; the last one's place in buf. 0 where Python must look at the name. */
static int plain_name(const uint8_t *prefix, size_t prefix_len, const uint8_t *name,
                      size_t name_len, const uint8_t *dir, size_t dir_len,
                      const struct kx_budget *budget, const uint8_t **base, size_t *base_len) {
    size_t raw_len = prefix_len ? prefix_len + 1 + name_len : name_len;
    if ((int64_t)raw_len > budget->max_path_bytes)
        return 0;
    const uint8_t *first = prefix_len ? prefix : name;
    if (raw_len == 0 || first[0] == '/')
        return 0;
    int64_t depth = 0;
    size_t matched = 0; /* bytes of dir matched so far */
    const uint8_t *last = NULL;
    size_t last_len = 0;
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
                if (last) { /* the component before this one must be dir's next */
                    size_t at = matched ? matched + 1 : 0;
                    if (at + last_len > dir_len || memcmp(dir + at, last, last_len) != 0 ||
                        (at + last_len < dir_len && dir[at + last_len] != '/'))
                        return 0;
                    matched = at + last_len;
                }
                last = s + i, last_len = len;
            }
            i = j + 1;
        }
    }
    if (!last || matched != dir_len)
        return 0;
    *base = last, *base_len = last_len;
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

/* One regular file, new in dir_fd; 0 where Python must do it (nothing is left behind). */
static int put_file(int dir_fd, const char *base, const uint8_t *data, int64_t size,
                    int64_t mode, int chown_ids, int64_t uid, int64_t gid, int64_t mtime,
                    struct kx_done *done) {
    int fd = openat(dir_fd, base, NEW_FILE, 0600);
    if (fd < 0)
        return 0;
    uid_t u;
    gid_t g;
    struct timespec times[2] = {{mtime, 0}, {mtime, 0}};
    struct stat st;
    unsigned int md_len = 0;
    int ok = write_all(fd, data, (size_t)size) == 0 &&
             EVP_Digest(data, (size_t)size, done->sha256, &md_len, EVP_sha256(), NULL) == 1 &&
             (!owner(chown_ids, uid, gid, &u, &g) || fchown(fd, u, g) == 0) &&
             /* IMG-SETUID-01: the permission bits only; after chown, which clears them. */
             fchmod(fd, (mode_t)(mode & 0777)) == 0 && futimens(fd, times) == 0 &&
             fstat(fd, &st) == 0;
    close(fd);
    if (!ok) {
        unlinkat(dir_fd, base, 0);
        return 0;
    }
    done->ino = st.st_ino;
    done->size = size;
    done->is_file = 1;
    return 1;
}

static int put_symlink(int dir_fd, const char *base, const char *target, int chown_ids,
                       int64_t uid, int64_t gid, int64_t mtime, struct kx_done *done) {
    /* Kept as the image has it, absolute or not; nothing here ever follows it. */
    if (symlinkat(target, dir_fd, base) != 0)
        return 0;
    uid_t u;
    gid_t g;
    struct timespec times[2] = {{mtime, 0}, {mtime, 0}};
    if ((owner(chown_ids, uid, gid, &u, &g) &&
         fchownat(dir_fd, base, u, g, AT_SYMLINK_NOFOLLOW) != 0) ||
        utimensat(dir_fd, base, times, AT_SYMLINK_NOFOLLOW) != 0) {
        unlinkat(dir_fd, base, 0);
        return 0;
    }
    done->ino = 0, done->size = 0, done->is_file = 0;
    return 1;
}

int64_t karotte_extract_run(const uint8_t *buf, size_t len, int dir_fd,
                            const uint8_t *dir_path, size_t dir_path_len, int chown_ids,
                            const struct kx_budget *budget, struct kx_count *count,
                            struct kx_done *done, size_t max_done, size_t *n_done) {
    size_t off = 0;
    *n_done = 0;
    while (*n_done < max_done && len - off >= BLOCK) {
        const uint8_t *h = buf + off;
        if (all_zero(h) || !checksum_ok(h))
            break;
        uint8_t type = h[156];
        int file = type == '0' || type == 0 || type == '7', link = type == '2';
        size_t name_len = text_len(h, 100), prefix_len = text_len(h + 345, 155);
        if (!(file || link) || (type == 0 && name_len && h[name_len - 1] == '/'))
            break;
        int64_t mode = octal(h + 100, 8), uid = octal(h + 108, 8), gid = octal(h + 116, 8),
                size = octal(h + 124, 12), mtime = octal(h + 136, 12);
        if (mode < 0 || uid < 0 || gid < 0 || size < 0 || mtime < 0 || mtime > MAX_MTIME)
            break;
        if (count->entries + 1 > budget->max_entries)
            break;
        const uint8_t *base;
        size_t base_len;
        char name[256], target[101];
        if (!plain_name(h + 345, prefix_len, h, name_len, dir_path, dir_path_len, budget,
                        &base, &base_len) || base_len >= sizeof name)
            break;
        memcpy(name, base, base_len);
        name[base_len] = 0;
        struct kx_done *d = &done[*n_done];
        if (file) {
            size_t span = BLOCK + (size_t)size + (size_t)(-size & (BLOCK - 1));
            if (size > budget->max_file_size || count->read + size > budget->max_bytes ||
                count->total + size > budget->max_bytes || span > len - off)
                break;
            if (!put_file(dir_fd, name, h + BLOCK, size, mode, chown_ids, uid, gid, mtime, d))
                break;
            count->read += size, count->total += size;
            off += span;
        } else {
            size_t target_len = text_len(h + 157, 100);
            if (target_len == 0 || (int64_t)target_len > budget->max_path_bytes)
                break;
            memcpy(target, h + 157, target_len);
            target[target_len] = 0;
            if (!put_symlink(dir_fd, name, target, chown_ids, uid, gid, mtime, d))
                break;
            off += BLOCK; /* a symlink has no data, as tarfile reads it */
        }
        d->name_off = (uint32_t)(base - buf);
        d->name_len = (uint32_t)base_len;
        count->entries++;
        (*n_done)++;
    }
    return (int64_t)off;
}
