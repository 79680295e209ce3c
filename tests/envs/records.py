"""Environments whose graders hand back what an Outcome must keep bounded or convert."""
from fractions import Fraction

from karotte.environment import Grade
from karotte.spec import MiB, SandboxSpec

from .basic import Addition


class FractionReward(Addition):
    """Its grader scores with a Fraction: a real number that is not a float."""

    def grade(self, ctx):
        return Grade(Fraction(1, 2), {"why": "half marks, as a Fraction"})


class NanDetails(Addition):
    """Its grader's details hold a NaN and an infinity, which strict JSON cannot."""

    def grade(self, ctx):
        return Grade(0.0, {"ratio": float("nan"), "speedup": float("inf"), "runs": 3})


class NoisyGrader(Addition):
    """Its grader writes 1 MB of bytes that are not UTF-8 to stderr, then scores 0."""

    def grade(self, ctx):
        import sys
        sys.stderr.buffer.write(b"\xff" * 1_000_000)
        sys.stderr.flush()
        return 0.0


class OneSecondCommands(Addition):
    """Its author gives each command one second."""

    limits = SandboxSpec(memory=256 * MiB, timeout=1.0)
