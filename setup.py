"""Build the two native parts of Karotte.

* ``karotte._native``: a cffi extension (out-of-line API mode) with the spawn call,
  one clone3 that creates every namespace and execs ``karotte-init``.
* ``karotte/_bin/karotte-init``: the in-sandbox init, a small static executable.
  It sets up the mount plan, pivots, and then serves exec requests as PID 1.
"""
import os
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
        from distutils.ccompiler import new_compiler  # setuptools ships distutils
        from distutils.sysconfig import customize_compiler

        ext_path = Path(self.get_ext_fullpath("karotte._native"))
        bin_dir = ext_path.parent / "_bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        cc = new_compiler()
        customize_compiler(cc)
        objects = cc.compile(
            [str(HERE / "csrc" / "init.c")],
            output_dir=self.build_temp,
            include_dirs=[str(HERE / "csrc")],
            extra_preargs=CFLAGS,
        )
        # Static: the init is exec'd before pivot_root and must not depend on the
        # sandbox's view of /lib, and a static exec skips the dynamic loader's work.
        cc.link_executable(
            objects, "karotte-init", output_dir=str(bin_dir), extra_postargs=["-static"]
        )
        os.chmod(bin_dir / "karotte-init", 0o755)


setup(
    cffi_modules=["karotte/_native_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtWithInit},
)
