"""Graders that use ctx.run's files, env and cwd, and report what the run saw or what
was refused."""
from __future__ import annotations

import base64
import json

from karotte.environment import Grade
from karotte.grader_runtime import GraderError
from karotte.spec import MiB

from .basic import Doubler

PYTHON = "/usr/bin/python3"

# Runs in the nested sandbox from the files the grader placed: what it sees, where it
# may write, and the agent's double() imported next to it.
PROBE = r'''
import json, os, sys
sys.path.append("/workspace")
seen = {"cwd": os.getcwd(), "mode": os.environ.get("KAROTTE_MODE"),
        "tests": sorted(os.listdir("/tests")), "cases": open("data/cases.txt").read()}
for path in ("/tests/probe.py", "/tests/new.txt", "/workspace/solution.py"):
    try:
        open(path, "a").close()
        seen[path] = "written"
    except OSError as exc:
        seen[path] = os.strerror(exc.errno)
seen["mount"] = [line.split()[3].split(",")[0] for line in open("/proc/self/mounts")
                 if line.split()[1] == "/tests"]
from solution import double
seen["double"] = double(int(seen["cases"]))
print(json.dumps(seen))
'''


class RunWithFiles(Doubler):
    """Runs PROBE, placed with its data by files=, in /tests with a variable of its own;
    then a second run, to see whether the files outlive the first."""

    def grade(self, ctx):
        r = ctx.run([PYTHON, "-I", "/tests/probe.py"], cwd="/tests",
                    files={"probe.py": PROBE, "data/cases.txt": b"21"},
                    env={"KAROTTE_MODE": "hidden-suite"})
        later = ctx.run([PYTHON, "-I", "-c", "import os; print(os.path.exists('/tests'))"])
        return Grade(0.0, {"seen": json.loads(r.stdout) if r.exit_code == 0 else
                           r.stderr.decode(errors="replace")[-2000:],
                           "tests_in_a_later_run": later.stdout.decode().strip()})


# Requests that a careless or broken grader could send straight to the host, past the
# grader-side check of ctx.run.
RAW = {
    "parent": {"files": {"../../karotte-escaped": "eA=="}},
    "absolute": {"files": {"/tmp/karotte-escaped": "eA=="}},
    "file-and-directory": {"files": {"a": "eA==", "a/b": "eA=="}},
    "loader": {"env": {"LD_PRELOAD": "/workspace/evil.so"}},
    "not-a-mapping": {"files": ["a"]},
    "relative-cwd": {"cwd": "workspace"},
    "too-many": {"files": {f"f{i}": "" for i in range(5000)}},
    "huge-output": {"output_limit": 1 << 40},  # the host would hold up to 2 TiB of output
}


class RawRunRequests(Doubler):
    """Sends each RAW request to the host as is, and reports the host's answer."""

    def grade(self, ctx):
        answers = {}
        for name, extra in RAW.items():
            request = {"op": "run", "argv": ["true"], "timeout": 5.0, "stdin": "",
                       "memory": 64 * MiB, "pids": 8, "cpus": 1.0, "output_limit": 4096,
                       **extra}
            try:
                ctx._call(request, reply_limit=1 << 20)
                answers[name] = "ran"
            except GraderError as exc:
                answers[name] = str(exc)
        return Grade(0.0, {"answers": answers, "b64": base64.b64encode(b"x").decode()})


class FractionReward(Doubler):
    """grade() returns a bare real number that is not a float (a Fraction, as numpy's
    float32 would be): a number, so it scores as one."""

    def grade(self, ctx):
        import fractions
        return fractions.Fraction(1, 2)
