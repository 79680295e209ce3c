"""Environments on images, for tests/test_env_images.py. The tests set `image` and
`grader_image` on these classes to the trees they make; the grader imports the classes
again for grade(), which reports what it sees: its interpreter, its root, and what the
agent's program run with ctx.run sees.

Python 3.9 code: the graders run under the images' interpreters, the oldest 3.9.
"""
from __future__ import annotations

import json
import sys

from karotte.environment import Environment, Grade

# A file of the host's /usr that no test image has (the tests check that the host has it).
HOST_ONLY = "/usr/bin/umoci"
# Where a Python runs: its version and executable, its root's os-release, whether the
# host-only file is there, the directories /usr/lib/python3*, and where pytest comes from.
# The grader runs it in its own process; ctx.run runs it as the agent's program.
REPORT = f"""
import glob, os, platform, sys


def report():
    try:
        with open("/etc/os-release") as f:
            release = f.read()
    except OSError:
        release = None
    try:
        import pytest
        where = pytest.__file__
    except ImportError:
        where = None
    return {{"version": platform.python_version(), "executable": sys.executable,
            "os_release": release, "host_only": os.path.exists({HOST_ONLY!r}),
            "usr_lib_python": sorted(glob.glob("/usr/lib/python3*")), "pytest": where,
            "no_site": sys.flags.no_site}}
"""
_names: dict = {}
exec(compile(REPORT, "<report>", "exec"), _names)
report = _names["report"]


class GraderReports(Environment):
    """Its grade() reports where the grader runs."""

    deliverables = ("answer.txt",)

    def prompt(self, seed: int) -> str:
        return "Do nothing."

    def grade(self, ctx) -> Grade:
        return Grade(1.0, {"grader": report()})


class RunReports(Environment):
    """Its grade() reports where the grader runs and where the agent's program run by
    ctx.run does (as `python3`, from the PATH of the agent's image)."""

    deliverables = ("answer.txt",)

    def prompt(self, seed: int) -> str:
        return "Do nothing."

    def grade(self, ctx) -> Grade:
        run = ctx.run(["python3", "-c", REPORT + "import json; print(json.dumps(report()))"])
        try:
            seen = json.loads(run.stdout)
        except ValueError:
            seen = {"exit": run.exit_code, "stderr": run.stderr.decode()[-2000:]}
        return Grade(1.0, {"grader": report(), "run": seen})


class AgentWrites(Environment):
    """The agent writes 42 to answer.txt; reward 1 for it. A workspace file is placed, so
    that tar runs at reset."""

    deliverables = ("answer.txt",)

    def prompt(self, seed: int) -> str:
        return "Write 42 to /workspace/answer.txt."

    def workspace_files(self, seed: int):
        return {"notes.txt": "the answer is 42\n"}

    def grade(self, ctx) -> Grade:
        answer = ctx.read_deliverable("answer.txt", limit=16)
        return Grade(1.0 if answer is not None and answer.strip() == b"42" else 0.0,
                     {"python": sys.version.split()[0]})

    def reference_solution(self, seed: int):
        return ["echo 42 > answer.txt"]
