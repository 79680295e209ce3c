"""Small environments for attacks on Karotte's pipeline (custody, grading, nested runs).

Some of these graders are careless on purpose: a task author's grader that crashes,
hangs or returns NaN on what the agent wrote. Karotte must still end the episode in
bounded time with the bottom reward and a reason, never an infrastructure error.
"""
from __future__ import annotations

import inspect
import itertools
import json
import math
import os
import re
import sys
import tarfile
from dataclasses import replace

from karotte.environment import Environment, Grade
from karotte.spec import MiB, SandboxSpec

from .basic import Addition, Doubler

PYTHON = "/usr/bin/python3"


def _reward(result: float | Grade) -> float:
    return result.reward if isinstance(result, Grade) else result


class Inventory(Addition):
    """Addition in a small sandbox, whose grader also reports what the submission holds
    (each path, cut to 100 characters, with its mode and size; 200 entries at most, so
    that the report stays small whatever the agent made), so a test can see what
    reached the grader."""

    limits = SandboxSpec(memory=256 * MiB, disk=32 * MiB, inodes=4096, timeout=20)
    grader_limits = replace(Addition.grader_limits, timeout=30.0)

    def grade(self, ctx):
        result = super().grade(ctx)
        paths = (os.path.join(root, name)
                 for root, dirs, names in os.walk(ctx.submission) for name in dirs + names)
        files = {}
        for path in itertools.islice(paths, 200):
            st = os.lstat(path)
            files[os.path.relpath(path, ctx.submission)[:100]] = [oct(st.st_mode), st.st_size]
        return Grade(_reward(result), {"files": files})


def file_times(top: str) -> dict[str, list[int]]:
    """[atime, mtime] in ns of the directory top (as ".") and of everything under it, 200
    entries at most; each entry is stat'd before anything lists or reads it."""
    st = os.lstat(top)
    found = {".": [st.st_atime_ns, st.st_mtime_ns]}
    for root, dirs, names in os.walk(top):
        for name in dirs + names:
            path = os.path.join(root, name)
            st = os.lstat(path)
            found[os.path.relpath(path, top)[:100]] = [st.st_atime_ns, st.st_mtime_ns]
        if len(found) >= 200:
            break
    return found


class Timestamps(Addition):
    """Addition whose grader also reports file_times of the submission: as the grader
    sees it (/submission), and as a program run by ctx.run sees it (/workspace)."""

    def grade(self, ctx):
        result = super().grade(ctx)
        script = ("import json, os, sys\n\n" + inspect.getsource(file_times)
                  + "\nprint(json.dumps(file_times(sys.argv[1])))\n")
        r = ctx.run([PYTHON, "-I", "-c", script, "/workspace"])
        run = json.loads(r.stdout) if r.exit_code == 0 else r.stderr.decode()[-2000:]
        return Grade(_reward(result), {"grader": file_times(str(ctx.submission)), "run": run})


class GraderProbe(Addition):
    """Addition whose grader also reports how it was started: isolated mode, sys.path,
    the names of its environment variables and its interpreter."""

    def grade(self, ctx):
        return Grade(_reward(super().grade(ctx)),
                     {"isolated": sys.flags.isolated, "path": list(sys.path),
                      "environ": sorted(os.environ), "executable": sys.executable})


class Mean(Environment):
    """Write the mean of the numbers in numbers.txt to answer.txt; a tolerance check
    written positively (finite and close), so NaN and inf cannot pass it."""

    deliverables = ("answer.txt",)
    limits = SandboxSpec(memory=256 * MiB, disk=32 * MiB, timeout=20)

    @staticmethod
    def numbers(seed):
        return [round(1.5 + 0.37 * ((seed * 31 + i * 17) % 23), 2) for i in range(5)]

    def prompt(self, seed):
        return "Write the mean of the numbers in /workspace/numbers.txt to /workspace/answer.txt."

    def workspace_files(self, seed):
        return {"numbers.txt": " ".join(map(str, self.numbers(seed))) + "\n"}

    def hidden_files(self, seed):
        values = self.numbers(seed)
        return {"expected.txt": repr(sum(values) / len(values))}

    def grade(self, ctx):
        expected = float((ctx.hidden / "expected.txt").read_text())
        answer = ctx.read_deliverable("answer.txt", limit=64)
        try:
            x = float(answer) if answer is not None else None
        except ValueError:
            x = None
        ok = (x is not None and math.isfinite(x)
              and abs(x - expected) <= 1e-6 * max(1.0, abs(expected)))
        return Grade(1.0 if ok else 0.0, {"answer": repr(x)})

    def reference_solution(self, seed):
        return ["python3 -c \"import statistics; print(statistics.fmean("
                "map(float, open('numbers.txt').read().split())))\" > answer.txt"]


class Closeness(Addition):
    """A careless grader: the reward is 1 - |answer - sum| / sum, on the agent's number as
    it comes (NaN, inf and huge values included)."""

    def grade(self, ctx):
        expected = float((ctx.hidden / "expected.txt").read_text())
        answer = ctx.read_deliverable("answer.txt", limit=64)
        return 1.0 - abs(float(answer) - expected) / expected


class SloppyParser(Addition):
    """A careless grader: int() on whatever the agent wrote, so junk crashes it."""

    def grade(self, ctx):
        expected = int((ctx.hidden / "expected.txt").read_text())
        return 1.0 if int(ctx.read_deliverable("answer.txt").decode()) == expected else 0.0


class RegexValidated(Addition):
    """A careless grader: validates the answer with a regex that backtracks
    exponentially on a long run of digits that does not match."""

    grader_limits = replace(Addition.grader_limits, timeout=4.0)

    def grade(self, ctx):
        answer = ctx.read_deliverable("answer.txt", limit=4096) or b""
        if re.fullmatch(rb"(\d+)+\s*", answer) is None:
            return 0.0
        return super().grade(ctx)


class NaiveUntar(Addition):
    """The answer comes as answer.tar.gz holding answer.txt; a careless grader extracts
    it whole, with no filter and no caps, into its /tmp."""

    deliverables = ("answer.tar.gz",)
    grader_limits = SandboxSpec(memory=512 * MiB, pids=64, disk=16 * MiB, tmp_size=32 * MiB,
                                timeout=20)

    def prompt(self, seed):
        return super().prompt(seed) + " Deliver it as answer.tar.gz holding answer.txt."

    def grade(self, ctx):
        expected = (ctx.hidden / "expected.txt").read_text().strip()
        with tarfile.open(ctx.submission / "answer.tar.gz") as tar:
            tar.extractall("/tmp/unpacked")
        with open("/tmp/unpacked/answer.txt", "rb") as f:
            return 1.0 if f.read(64).strip() == expected.encode() else 0.0

    def reference_solution(self, seed):
        return ["read a b < numbers.txt; mkdir -p /tmp/p; echo $((a + b)) > /tmp/p/answer.txt; "
                "tar -czf answer.tar.gz -C /tmp/p answer.txt"]


class Runs(Doubler):
    """Doubler with small limits on each run of the agent's program: one second, 64 MiB,
    16 processes. Reports how each run ended."""

    grader_limits = replace(Doubler.grader_limits, timeout=30.0)

    def grade(self, ctx):
        cases = (ctx.hidden / "inputs.txt").read_text().split()
        passed, runs = 0, []
        for case in cases:
            r = ctx.run([PYTHON, "-I", "/workspace/solution.py"], stdin=case + "\n", timeout=1.0,
                        memory=64 * MiB, pids=16)
            runs.append({"exit": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                         "oom": r.oom_killed, "stdout_bytes": len(r.stdout),
                         "truncated": r.stdout_truncated, "wall": r.wall_seconds})
            if r.exit_code == 0 and r.stdout.strip() == str(2 * int(case)).encode():
                passed += 1
        return Grade(passed / len(cases), {"passed": passed, "runs": runs})


class RunReport(Doubler):
    """Doubler whose grader also runs solution.py once without input and reports what it
    printed: what the agent's code meets in the sandbox nested under the grader's."""

    def grade(self, ctx):
        r = ctx.run([PYTHON, "-I", "/workspace/solution.py"], timeout=10.0)
        return Grade(_reward(super().grade(ctx)),
                     {"exit": r.exit_code, "stdout": r.stdout.decode(errors="replace")[:4096],
                      "stderr": r.stderr.decode(errors="replace")[-4096:]})
