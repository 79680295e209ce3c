/* The plain entries of a layer tar, applied in C: karotte/images/extract.py hands over
 * the bytes it has read and the chain of directories its last entry was in; this applies
 * the run of entries that follow, each a regular file, a symlink or a new directory whose
 * parent is a directory of that chain, one this run made, or one already there below
 * them that the run opens itself (O_DIRECTORY|O_NOFOLLOW, a directory with owner rwx:
 * Python opens up one without, when unprivileged), and stops,
 * consuming nothing of it, at the first entry that is anything else. Python then applies
 * (or refuses) that entry with every rule of extract.py, and calls again.
 *
 * Why it never does what Python would refuse: it refuses nothing itself. Whatever Python
 * would look at twice stops the run: a header that is not one plain ustar or GNU block
 * with octal numbers and a good checksum; any other type (hard links, devices, extended
 * headers); a name with a ".." component, a component starting with ".wh.", a parent
 * that is missing, not a directory, a symlink or without owner rwx, no name at all; a
 * size, a count, a depth or a length over the budget; an entry whose data is not all in
 * buf (*need says how many bytes it takes, so that the caller can read on and call
 * again); a directory already there where a file or a symlink goes, or any name already
 * there where a directory goes (Python removes a directory whole, fd-relative, and merges
 * a directory over a directory); any syscall that fails. A file or a symlink already there is unlinked first (fstatat, unlinkat: its
 * bytes freed as extract.py's _clear frees them), then the name is made new. It writes
 * only below the chain's directories, which Python or this run opened component by
 * component without following links, or this run made new, and makes
 * each name new (O_CREAT|O_EXCL|O_NOFOLLOW, symlinkat, mkdirat), so it never follows a
 * link the image planted.
 *
 * Files are not hashed here: karotte_extract_finish hashes a run's files from the same
 * bytes, on the thread that keeps the hashes (karotte/images/tree.py's FileHashes), beside
 * the next run's writes. Where count->open_max allows, it writes their data there too:
 * the run makes each file new, sized (ftruncate, so that a later entry that replaces it
 * frees its bytes as extract.py counts them), owned and moded, and leaves its fd open for
 * that thread, which writes the data, sets the mtime and closes it. Nothing reads a file
 * during extraction, and a name replaced or whited out meanwhile only unlinks an inode
 * still being written; the tree is read only once every run is finished. */
#ifndef KAROTTE_EXTRACT_H
#define KAROTTE_EXTRACT_H

#include <stddef.h>
#include <stdint.h>

#define KX_CHAIN 256  /* directories of a chain at most; a deeper entry stops the run */
#define KX_PATH 4096  /* bytes of a chain's path at most; a longer one stops the run */

struct kx_budget {
    int64_t max_entries, max_bytes, max_file_size, max_depth, max_path_bytes;
};

/* What the layer counted so far (extract.py's entries, read, total), updated. */
struct kx_count {
    int64_t entries, read, total;
    /* Files whose data is written later (karotte_extract_finish) while fewer than
     * open_max are open in the whole process (every run's): 0 writes every file in the
     * run. open (this layer's) is updated with atomics: the thread that finishes a run is
     * not the one that runs the next. */
    int64_t open_max, open;
};

/* The directories below the root that the current entry is in: fds[i] is the directory
 * named by the first i + 1 components of path ("a/b": fds[0] is a, fds[1] a/b). A run
 * closes those it leaves and appends those it makes; the caller owns them after. */
struct kx_chain {
    int root;
    size_t n;
    int fds[KX_CHAIN];
    size_t path_len;
    uint8_t path[KX_PATH];
};

enum { KX_FILE = 0, KX_SYMLINK = 1, KX_DIR = 2 };

/* One entry applied; its path (components joined by '/') is paths[path_off:+path_len]. */
struct kx_done {
    uint64_t ino;      /* files: the inode written */
    int64_t size;      /* files: bytes of data */
    uint64_t data_off; /* files: where the data starts in buf */
    int64_t mode;      /* directories: the tar's permission bits, set by Python at the end */
    int64_t mtime;     /* directories: the tar's mtime, likewise; files: set by the finish */
    uint32_t path_off, path_len;
    uint32_t kind;       /* KX_FILE, KX_SYMLINK or KX_DIR */
    uint32_t new_parent; /* its parent is not the entry's before it in this run */
    uint8_t sha256[32];  /* files: the sha256 of the data, once karotte_extract_finish ran */
    int32_t fd;  /* files: left open, the data to write (karotte_extract_finish); else -1 */
    int32_t err; /* files: the errno of the finish's failed write or futimens, else 0 */
};

/* Applies entries from buf[0:len] below chain; returns the bytes consumed (whole entries,
 * each with its data and padding), 0 where the first entry is not one it applies.
 * *n_done gets the entries applied, at most max_done; their paths go to paths (each
 * followed by a NUL), *paths_len bytes of it, at most paths_cap. *need: 0, or the bytes
 * from the end of what was consumed that the next entry (plain but for its data not all
 * being in buf) takes. chown_ids: 1 to give each
 * entry the tar's (uid, gid), ids of 65536 and over becoming 65534 (extract.image_ids), 0
 * to leave the caller's. */
int64_t karotte_extract_run(const uint8_t *buf, size_t len, struct kx_chain *chain,
                            int chown_ids, const struct kx_budget *budget,
                            struct kx_count *count, struct kx_done *done, size_t max_done,
                            size_t *n_done, uint8_t *paths, size_t paths_cap,
                            size_t *paths_len, size_t *need);

/* Each file of done[0:n] (whose data_off and size are in buf) finished: where the run
 * left it open, its data written, its mtime set and its fd closed (count->open less; a
 * failure's errno in err, the file then refused by Python); and, if hash, the sha256 of
 * its data into its sha256, read while the write left the bytes in this core's cache.
 * Each file once: its fd is -1 after. The index of the first file that failed, plus one;
 * 0 where none did. */
size_t karotte_extract_finish(const uint8_t *buf, struct kx_done *done, size_t n,
                              struct kx_count *count, int hash);

#endif
