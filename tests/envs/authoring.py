"""Environments for the authoring tools (`karotte check`, `karotte redteam`): each shows a
case the battery must judge right."""
import sys

from karotte.environment import Grade

from .basic import Addition, Doubler


class ReferenceInSubdir(Addition):
    """Addition whose reference solution works from a subdirectory and stays there: the
    bash tool's cd carries over into whatever is played after it."""

    def reference_solution(self, seed):
        return ["mkdir -p work && cd work",
                "read a b < ../numbers.txt; echo $((a + b)) > ../answer.txt"]


class CrashesOnNothing(Addition):
    """Its grader crashes when answer.txt is missing, as it is for the null agent."""

    def grade(self, ctx):
        expected = (ctx.hidden / "expected.txt").read_bytes()
        return 1.0 if ctx.read_deliverable("answer.txt", limit=64).strip() == expected else 0.0


class TrustsExitStatus(Addition):
    """The deliverable is a package the reference writes, pkg/; its careless grader
    credits any run of its check that exits 0, so an os._exit(0) in one module passes."""

    deliverables = ("pkg",)

    def grade(self, ctx):
        r = ctx.run(["/usr/bin/python3", "-I", "-c", "import sys; sys.path.append('/workspace')\n"
                     "from pkg.double import double\nassert double(21) == 42"], timeout=10)
        return 1.0 if r.exit_code == 0 else 0.0

    def reference_solution(self, seed):
        return ["mkdir -p pkg && touch pkg/__init__.py && "
                "printf 'def double(x):\\n    return 2 * x\\n' > pkg/double.py"]


class EchoesThenCrashes(Doubler):
    """A careless grader: it copies what the agent's program printed into its own stderr,
    then takes that output for a number, and crashes on anything else."""

    def grade(self, ctx):
        if ctx.read_deliverable("solution.py") is None:
            return Grade(0.0, {"why": "no solution.py"})
        r = ctx.run(["/usr/bin/python3", "-I", "/workspace/solution.py"], stdin="3\n", timeout=10)
        sys.stderr.write(r.stdout.decode(errors="replace"))
        return float(r.stdout)
