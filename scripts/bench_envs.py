"""The environment scripts/bench_episode.py measures: a minimal answer-file task.

A top-level module on purpose: the grader imports the environment again inside its
sandbox, from a copy of this very file, so it must be a real file importable as
``bench_envs`` (scripts/ on sys.path). Standard library and karotte's grader runtime
only: that is all the grading sandbox has.

The grader stamps its own progress with time.perf_counter_ns(). On Linux that is
CLOCK_MONOTONIC, and the sandbox has no time namespace, so the stamps are on the
benchmark's clock: it splits the grader's time into start-up, grade() and exit.
"""
import random
import time

from karotte.environment import Environment, Grade

# When the grader's interpreter got to this module: after its start-up, the runtime's
# imports and load() finding the class.
IMPORTED_NS = time.perf_counter_ns()


class AnswerFile(Environment):
    """Write a + b to answer.txt; one task file, one hidden file, one deliverable."""

    deliverables = ("answer.txt",)

    @staticmethod
    def numbers(seed):
        rng = random.Random(f"answer-file:{seed}")
        return rng.randint(1000, 9999), rng.randint(1000, 9999)

    def prompt(self, seed):
        return ("The file /workspace/numbers.txt holds two integers. Write their sum as a "
                "decimal integer to /workspace/answer.txt.")

    def workspace_files(self, seed):
        a, b = self.numbers(seed)
        return {"numbers.txt": f"{a} {b}\n"}

    def hidden_files(self, seed):
        return {"expected.txt": str(sum(self.numbers(seed)))}

    def grade(self, ctx):
        started = time.perf_counter_ns()
        expected = (ctx.hidden / "expected.txt").read_text().strip()
        answer = ctx.read_deliverable("answer.txt", limit=64)
        reward = 1.0 if answer is not None and answer.strip() == expected.encode() else 0.0
        return Grade(reward, {"imported_ns": IMPORTED_NS, "grade_start_ns": started,
                              "grade_end_ns": time.perf_counter_ns()})

    def reference_solution(self, seed):
        return ["read a b < numbers.txt; echo $((a + b)) > answer.txt"]
