/* The plain entries of a layer tar, applied in C: karotte/images/extract.py hands over
 * the bytes it has read and the directory its last entry was in; this applies the run of
 * entries that follow, each a regular file or a symlink in that same directory, and
 * stops, consuming nothing of it, at the first entry that is anything else. Python then
 * applies (or refuses) that entry with every rule of extract.py, and calls again.
 *
 * Why it never does what Python would refuse: it refuses nothing itself. Whatever Python
 * would look at twice stops the run: a header that is not one plain ustar or GNU block
 * with octal numbers and a good checksum; any other type (directories, hard links,
 * devices, extended headers); a name with a ".." component, a component starting with
 * ".wh.", a parent other than dir_path, no name at all; a size, a count, a depth or a
 * length over the budget; an entry whose data is not all in buf; a name already there in
 * the directory (O_EXCL fails: Python clears it, fd-relative); any syscall that fails.
 * It writes only below dir_fd, a directory Python opened component by component without
 * following links, and makes each name new (O_CREAT|O_EXCL|O_NOFOLLOW, symlinkat), so it
 * never follows a link the image planted. */
#ifndef KAROTTE_EXTRACT_H
#define KAROTTE_EXTRACT_H

#include <stddef.h>
#include <stdint.h>

struct kx_budget {
    int64_t max_entries, max_bytes, max_file_size, max_depth, max_path_bytes;
};

/* What the layer counted so far (extract.py's entries, read, total), updated. */
struct kx_count {
    int64_t entries, read, total;
};

/* One entry applied: its last component is buf[name_off:name_off + name_len]. */
struct kx_done {
    uint64_t ino;       /* files: the inode written */
    int64_t size;       /* files: bytes of data */
    uint32_t name_off, name_len;
    uint32_t is_file;
    uint8_t sha256[32]; /* files: the sha256 of the data */
};

/* Applies entries from buf[0:len]; returns the bytes consumed (whole entries, each with
 * its data and padding), 0 where the first entry is not one it applies. *n_done gets the
 * entries applied, at most max_done. chown_ids: 1 to give each entry the tar's (uid, gid),
 * ids of 65536 and over becoming 65534 (extract.image_ids), 0 to leave the caller's. */
int64_t karotte_extract_run(const uint8_t *buf, size_t len, int dir_fd,
                            const uint8_t *dir_path, size_t dir_path_len, int chown_ids,
                            const struct kx_budget *budget, struct kx_count *count,
                            struct kx_done *done, size_t max_done, size_t *n_done);

#endif
