"""Deliberately broken environments that `karotte check` must fail."""
from karotte.environment import Grade

from .basic import Addition


class LeavesTheAnswerInTheWorkspace(Addition):
    """Puts the expected sum where the agent can read it."""

    def workspace_files(self, seed):
        files = dict(super().workspace_files(seed))
        files["expected_answer.txt"] = str(sum(self.numbers(seed)))
        return files


class CreditsAnEmptyAnswer(Addition):
    """Its grader treats an empty answer.txt as right (a broken validator, OUT-DEGENERATE-01)."""

    def grade(self, ctx):
        answer = ctx.read_deliverable("answer.txt", limit=64)
        if answer is None:
            return Grade(0.0)
        expected = (ctx.hidden / "expected.txt").read_text().strip()
        return 1.0 if answer.strip() in (b"", expected.encode()) else 0.0


class TrustsARewardFile(Addition):
    """Its grader believes a reward file found in the submission (OUT-REWARDFILE-01)."""

    def grade(self, ctx):
        planted = ctx.read_deliverable("reward.txt", limit=64)
        if planted is not None:
            return float(planted.strip() or 0)
        return super().grade(ctx)
