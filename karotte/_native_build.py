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
    """
)
ffibuilder.set_source(
    "karotte._native",
    '#include "spawn.h"',
    sources=[f"{CSRC}/spawn.c"],
    include_dirs=[CSRC],
    depends=[f"{CSRC}/spawn.h", f"{CSRC}/protocol.h"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-D_GNU_SOURCE"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
