"""Build the two native parts of Karotte.

* ``karotte._native``: a cffi extension (out-of-line API mode) with the spawn call,
  one clone3 that creates every namespace and execs ``karotte-init``.
* ``karotte/_bin/karotte-init``: the in-sandbox init, a small static executable.
  It sets up the mount plan, pivots, and then serves exec requests as PID 1.
"""
import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-fno-strict-aliasing"]


class BuildExtWithInit(build_ext):
    """build_ext that also links the init executable next to the extension."""

    def run(self):
        super().run()
        self._build_init()

    def _build_init(self):
        ext_path = Path(self.get_ext_fullpath("karotte._native"))
        bin_dir = ext_path.parent / "_bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        out = bin_dir / "karotte-init"
        # Static: the init is exec'd before pivot_root and must not depend on the
        # sandbox's view of /lib. With musl where it is installed: a static glibc's
        # start-up runs cpuid dozens of times, which traps to the hypervisor in a VM
        # (about 0.27 ms per sandbox on our machines; musl's start-up makes no such call).
        musl = shutil.which("musl-gcc")
        headers = _kernel_headers(Path(self.build_temp)) if musl else None
        if musl and headers:
            cmd = [musl, *CFLAGS, "-static", "-isystem", str(headers)]
        else:
            cmd = [*shlex.split(sysconfig.get_config_var("CC") or "cc"), *CFLAGS, "-static"]
        sources = sorted(str(c) for c in (HERE / "csrc" / "init").glob("*.c"))
        cmd += ["-I", str(HERE / "csrc"), *sources, "-o", str(out)]
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)
        os.chmod(out, 0o755)


def _kernel_headers(build_temp: Path) -> Path | None:
    """A directory with only the kernel's uapi headers (linux/, asm/, asm-generic/):
    musl-gcc searches musl's own headers, which leave these to the kernel's."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    sources = {"linux": Path("/usr/include/linux"),
               "asm-generic": Path("/usr/include/asm-generic"),
               "asm": Path("/usr/include") / multiarch / "asm"}
    if not all((src / "types.h").is_file() for src in sources.values()):
        return None
    top = build_temp / "kernel-headers"
    top.mkdir(parents=True, exist_ok=True)
    for name, src in sources.items():
        link = top / name
        if not link.is_symlink() or link.resolve() != src.resolve():
            link.unlink(missing_ok=True)
            link.symlink_to(src)
    return top

setup(
    cffi_modules=["karotte/_native_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtWithInit},
)
