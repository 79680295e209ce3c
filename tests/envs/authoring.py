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
