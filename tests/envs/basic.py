"""Minimal environments: a file answer, and a program the grader runs."""
import random

from karotte.environment import Environment, File, Grade
from karotte.spec import MiB, SandboxSpec


class Addition(Environment):
    """Write a + b to answer.txt; a and b come from the seed, the sum is hidden."""

    deliverables = ("answer.txt",)
    limits = SandboxSpec(memory=256 * MiB, timeout=20)

    @staticmethod
    def numbers(seed):
        rng = random.Random(f"addition:{seed}")
        return rng.randint(1000, 9999), rng.randint(1000, 9999)

    def prompt(self, seed):
        return ("The file /workspace/numbers.txt holds two integers. Write their sum as a "
                "decimal integer to /workspace/answer.txt.")

    def workspace_files(self, seed):
        a, b = self.numbers(seed)
        return {"numbers.txt": f"{a} {b}\n", "tools/hint.sh": File("echo add them\n", 0o755)}

    def hidden_files(self, seed):
        return {"expected.txt": str(sum(self.numbers(seed)))}

    def grade(self, ctx):
        expected = (ctx.hidden / "expected.txt").read_text().strip()
        answer = ctx.read_deliverable("answer.txt", limit=64)
        if answer is None:
            return Grade(0.0, {"why": "no answer.txt"})
        return 1.0 if answer.strip() == expected.encode() else 0.0

    def reference_solution(self, seed):
        return ["read a b < numbers.txt; echo $((a + b)) > answer.txt"]


class Doubler(Environment):
    """Write solution.py that reads an integer on stdin and prints its double; the grader
    runs it on hidden inputs in a nested sandbox."""

    deliverables = ("solution.py",)

    def prompt(self, seed):
        return "Write /workspace/solution.py: read an integer on stdin, print twice it."

    def hidden_files(self, seed):
        return {"inputs.txt": "3\n-5\n1000000\n"}

    def grade(self, ctx):
        cases = (ctx.hidden / "inputs.txt").read_text().split()
        passed = 0
        for case in cases:
            r = ctx.run(["python3", "-I", "/workspace/solution.py"], stdin=case + "\n", timeout=10)
            if r.exit_code == 0 and r.stdout.strip() == str(2 * int(case)).encode():
                passed += 1
        return Grade(passed / len(cases), {"passed": passed, "cases": len(cases)})

    def reference_solution(self, seed):
        return ["printf 'print(2 * int(input()))\\n' > solution.py"]
