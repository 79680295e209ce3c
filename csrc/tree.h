/* A tree of the image store listed in C for its manifest (karotte/images/tree.py's
 * manifest): every path under a directory fd, the root first, then depth first with names
 * in byte order, measured with fstatat(AT_SYMLINK_NOFOLLOW), each directory opened
 * O_NOFOLLOW and checked to be the inode measured, nothing ever followed. A regular file
 * is hashed (sha256, read through an O_NOFOLLOW|O_NONBLOCK fd whose fstat must match)
 * unless the caller already knows its inode at that size (extraction hashed it as it
 * wrote it). Anything but a file, a directory or a symlink, or a path that changed while
 * it was measured, stops the walk with the path named: Python refuses the tree
 * (IMG-TREE-01). Python turns the entries into TreeEntry and escapes the names. */
#ifndef KAROTTE_TREE_H
#define KAROTTE_TREE_H

#include <stddef.h>
#include <stdint.h>

enum { KT_FILE = 0, KT_SYMLINK = 1, KT_DIR = 2 };

/* One path of the tree; its path (components joined by '/', "" for the root) and a
 * symlink's target are text[path_off:+path_len] and text[target_off:+target_len]. */
struct kt_entry {
    uint64_t ino;
    int64_t size;      /* 0 for a directory, the target's length for a symlink */
    uint32_t mode;     /* the permission bits */
    uint32_t uid, gid;
    uint32_t kind;     /* KT_FILE, KT_SYMLINK or KT_DIR */
    uint32_t path_off, path_len, target_off, target_len;
    uint32_t hashed;   /* a file: 1 hashed by the walk, 2 known (its digest given) */
    uint8_t sha256[32];
};

/* The walk's result, in buffers the walk allocates (karotte_tree_free frees them). */
struct kt_tree {
    struct kt_entry *entries;
    size_t n, cap;
    uint8_t *text;
    size_t len, text_cap;
    int err;         /* -1 returned: the errno of the call that failed */
    int changed;     /* 1 returned: 1 if entries[n]'s path changed while measured, else */
    uint32_t bad_type; /* its file type (S_IFMT), which a tree must not hold */
};

/* Walks the tree under root_fd into t (zeroed by the caller). known: n_known pairs
 * (inode, size), sorted, whose files are not read: their sha256 is known_sha[32 * i].
 * Returns 0 when done; 1 when a path stops it (entries[n] names it: the path only); -1
 * when a call fails (t->err). */
int karotte_tree_walk(int root_fd, const int64_t *known, const uint8_t *known_sha,
                      size_t n_known, struct kt_tree *t);

/* manifest.jsonl for the entries of a finished walk, exactly as tree.py's manifest_text
 * writes it, and the bytes of its files into *files; in a buffer of *len bytes that
 * karotte_tree_text_free frees (NULL: memory ran out). An entry whose path or target is
 * not all printable ASCII other than the backslash is a NUL byte in place of its line,
 * and its index in odd (t->n of room), *n_odd of them: Python escapes those. */
uint8_t *karotte_tree_text(const struct kt_tree *t, size_t *len, int64_t *files,
                           uint32_t *odd, size_t *n_odd);

void karotte_tree_text_free(uint8_t *text);

void karotte_tree_free(struct kt_tree *t);

#endif
