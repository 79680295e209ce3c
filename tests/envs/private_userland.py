"""For tests/test_private_userland.py: a grader that checks the agent's program on the hidden
input, then times it on that same input against a baseline, as a grader with one fixed
hidden test does. The agent's program is tests/helpers/cache_link.c: it marks its answer
in the page cache of a file of its image (BLOB) in the check run, and answers the timed
run from the marks. The tests set `image` to a tree they make (with BLOB and the
baseline); the grader runs on the host's userland.

Python 3.9 code: the grader runs under the host's system Python.
"""
from __future__ import annotations

from karotte.environment import Environment, Grade
from karotte.grader_runtime import GraderError
from karotte.spec import MiB, SandboxSpec

BLOB = "/data/blob"  # a file of the image: 256 pages, cold when the tests begin
PROGRAM = "/opt/cache_link"  # cache_link built into the image: the baseline, with "baseline"
SECRET = 123456789  # the hidden input


class CheckThenTimed(Environment):
    """Check run, then compare_speed, both on the agent's image as it is."""

    PRIVATE = False
    image = "host"
    grader_image = "host"
    deliverables = ("solve",)
    grader_limits = SandboxSpec(memory=1024 * MiB, pids=128, timeout=120, disk=16 * MiB)
    reward_range = (0.0, 1000.0)
    deep = True

    def prompt(self, seed: int) -> str:
        return "Write /workspace/solve, which prints f(S) for S on stdin, fast."

    def hidden_files(self, seed: int):
        return {"input.txt": str(SECRET)}

    def grade(self, ctx) -> Grade:
        secret = (ctx.hidden / "input.txt").read_bytes()
        try:
            check = ctx.run(["/workspace/solve", BLOB], stdin=secret,
                            private_userland=self.PRIVATE)
        except GraderError as exc:
            return Grade(0.0, {"error": str(exc)})
        cmp = ctx.compare_speed(["/workspace/solve", BLOB], [PROGRAM, BLOB, "baseline"],
                                [secret], timeout=30, private_userland=self.PRIVATE)
        return Grade(cmp.speedup if cmp.ok else 0.0,
                     {"speedup": cmp.speedup, "check_output": check.stdout.decode(),
                      "check_seconds": check.wall_seconds,
                      "candidate_seconds": cmp.candidate_seconds,
                      "baseline_seconds": cmp.baseline_seconds,
                      "failures": list(cmp.failures)})


class CheckThenTimedPrivately(CheckThenTimed):
    """The same grader, every run on a private copy of the image."""

    PRIVATE = True
