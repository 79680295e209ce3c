"""cffi builder for karotte._native (out-of-line API mode, compiled by setup.py)."""
from cffi import FFI

# Relative to the project root, where setup.py runs (setuptools refuses absolute paths).
CSRC = "csrc"

ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define KAROTTE_CHILD_FD ...
    int karotte_spawn(const char *path, char *const argv[], char *const envp[],
                      int child_fd, int cgroup_fd, char *const tasks[],
                      const char *freezer_state, uint64_t ns_flags, int64_t owner_uid,
                      int64_t owner_gid, int *pidfd_out, int *step_out);

    struct kx_budget {
        int64_t max_entries, max_bytes, max_file_size, max_depth, max_path_bytes;
    };
    struct kx_count { int64_t entries, read, total; int64_t open_max, open; };
    #define KX_CHAIN 256
    #define KX_PATH 4096
    struct kx_chain {
        int root; size_t n; int fds[256]; size_t path_len; uint8_t path[4096];
    };
    #define KX_FILE 0
    #define KX_SYMLINK 1
    #define KX_DIR 2
    struct kx_done {
        uint64_t ino; int64_t size; uint64_t data_off; int64_t mode; int64_t mtime;
        uint32_t path_off, path_len; uint32_t kind; uint32_t new_parent;
        uint8_t sha256[32]; int32_t fd, err;
    };
    int64_t karotte_extract_run(const uint8_t *buf, size_t len, struct kx_chain *chain,
                                int chown_ids, const struct kx_budget *budget,
                                struct kx_count *count, struct kx_done *done,
                                size_t max_done, size_t *n_done, uint8_t *paths,
                                size_t paths_cap, size_t *paths_len, size_t *need);
    size_t karotte_extract_finish(const uint8_t *buf, struct kx_done *done, size_t n,
                                  struct kx_count *count, int hash);

    struct kt_entry {
        uint64_t ino; int64_t size; uint32_t mode; uint32_t uid, gid; uint32_t kind;
        uint32_t path_off, path_len, target_off, target_len; uint32_t hashed;
        uint8_t sha256[32];
    };
    struct kt_tree {
        struct kt_entry *entries; size_t n, cap; uint8_t *text; size_t len, text_cap;
        int err; int changed; uint32_t bad_type;
    };
    int karotte_tree_walk(int root_fd, const int64_t *known, const uint8_t *known_sha,
                          size_t n_known, struct kt_tree *t);
    uint8_t *karotte_tree_text(const struct kt_tree *t, size_t *len, int64_t *files,
                               uint32_t *odd, size_t *n_odd);
    void karotte_tree_text_free(uint8_t *text);
    void karotte_tree_free(struct kt_tree *t);

    #define KC_KEEP ...
    void *karotte_chunk_alloc(size_t size);
    void karotte_chunk_free(void *p);
    void karotte_chunk_hold(void);
    void karotte_chunk_release(void);
    size_t karotte_chunk_kept(void);
    """
)
ffibuilder.set_source(
    "karotte._native",
    '#include "spawn.h"\n#include "extract.h"\n#include "tree.h"\n#include "chunks.h"',
    sources=[f"{CSRC}/spawn.c", f"{CSRC}/extract.c", f"{CSRC}/tree.c",
             f"{CSRC}/chunks.c"],
    include_dirs=[CSRC],
    depends=[f"{CSRC}/spawn.h", f"{CSRC}/protocol.h", f"{CSRC}/extract.h",
             f"{CSRC}/tree.h", f"{CSRC}/chunks.h"],
    libraries=["crypto"],  # extract.c's and tree.c's sha256: OpenSSL's, as hashlib's
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-D_GNU_SOURCE"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
