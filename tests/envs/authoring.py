"""Environments for the authoring tools (`karotte check`, `karotte redteam`): each shows a
case the battery must judge right."""
from karotte.environment import Grade

from .basic import Addition


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
