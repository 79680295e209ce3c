"""The grader's library: the copy of Karotte that the grading process imports, read-only,
under the system Python. It must hold every module that process imports (a missing one is
a crash in every grading) and nothing more (each extra one is code the grader loads, or
could, and that no test of the grading process covers)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest

from karotte.grading import LIB_MOUNT, MIN_PYTHON, PYTHON, RUNTIME_MODULES, grader_library
from karotte.sandbox import Sandbox
from karotte.spec import Bind, SandboxSpec

LOADED = ("import json, sys; sys.path[:0] = [%r]; import karotte.grader_main; "
          "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'karotte')))"
          % LIB_MOUNT)


def test_grader_library_holds_exactly_what_the_grading_process_imports(no_leaks):
    lib = grader_library("envs")
    copied = {n for n in os.listdir(Path(lib, "karotte")) if n != "__pycache__"}
    assert copied == set(RUNTIME_MODULES)
    with Sandbox(SandboxSpec(binds=(Bind(lib, LIB_MOUNT),))) as sb:
        r = sb.exec([PYTHON, "-I", "-S", "-B", "-c", LOADED])
    assert r.exit_code == 0, r.stderr.decode()[-2000:]
    modules = {"karotte" if n == "__init__.py" else f"karotte.{n.removesuffix('.py')}"
               for n in RUNTIME_MODULES}
    assert set(json.loads(r.stdout)) == modules


PYENV = os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")), "versions")
# The library's code under each Python a grader image may have, from MIN_PYTHON on: it is
# imported and its channel and context used, with no sandbox (tests/test_env_images.py
# grades in sandboxes on trees of these same interpreters).
USE = """
import socket, sys
sys.path[:0] = [%r]
from karotte.grader_runtime import GradeContext, recv_message, send_message
from karotte.environment import Grade, load
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
send_message(a, b"x" * 100000)
assert recv_message(b, 200000) == b"x" * 100000
ctx = GradeContext(1, a)
assert ctx.read_deliverable("none") is None
for name in ("q3_revenue:Q3Revenue", "fix_tests:FixTests", "fix_tests_pytest:FixTestsPytest",
             "speedup:Speedup"):
    load("karotte.examples." + name)()
assert Grade(1).reward == 1.0
print(sys.version.split()[0])
"""


@pytest.mark.parametrize("minor", [f"3.{m}" for m in range(MIN_PYTHON[1], 14)])
def test_grader_library_works_under_every_python_from_the_oldest_a_grader_image_may_have(
        minor, tmp_path):
    found = sorted(glob.glob(os.path.join(PYENV, f"{minor}.*[0-9]", "bin", f"python{minor}")))
    if not found:
        pytest.skip(f"no CPython {minor} in {PYENV} (pyenv install {minor})")
    lib = grader_library("karotte")
    r = subprocess.run([found[-1], "-I", "-S", "-B", "-c", USE % lib],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith(minor + ".")
