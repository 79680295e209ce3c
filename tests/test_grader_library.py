"""The grader's library: the copy of Karotte that the grading process imports, read-only,
under the system Python. It must hold every module that process imports (a missing one is
a crash in every grading) and nothing more (each extra one is code the grader loads, or
could, and that no test of the grading process covers)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from karotte.grading import LIB_MOUNT, PYTHON, RUNTIME_MODULES, grader_library
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
