"""Environments whose grader misbehaves, or whose limits make a behaviour visible."""
from dataclasses import replace

from karotte.environment import Environment, Grade
from karotte.spec import Bind, SandboxSpec, ScanLimits

from .basic import Addition


class CrashingGrader(Addition):
    """Its grader divides by the length of a line the agent may leave empty."""

    def grade(self, ctx):
        answer = ctx.read_deliverable("answer.txt") or b""
        return Grade(1 / (len(answer.splitlines()) - 1))


class GraderCannotStart(Addition):
    """Its grading sandbox asks for a bind source that does not exist on the host."""

    grader_limits = replace(Environment.grader_limits,
                            binds=(Bind("/nonexistent/karotte-grader-data", "/data"),))


class TinyOutput(Addition):
    """Keeps only 4 KiB of each stream of a command."""

    limits = SandboxSpec(output_limit=4096)


class LargeMessages(Addition):
    """Its grader sends 1 MB to the agent's program and reports 0.5 MB of details."""

    def grade(self, ctx):
        r = ctx.run(["wc", "-c"], stdin=b"x" * 1_000_000, timeout=20)
        score = super().grade(ctx)
        reward = score.reward if isinstance(score, Grade) else score
        return Grade(reward, {"counted": r.stdout.decode().strip(), "blob": "y" * 500_000})


class TightScanLimits(Addition):
    """An author who knows answer.txt is a short number caps files at 32 bytes."""

    scan_limits = ScanLimits(max_file_size=32)


class SlowGrader(Addition):
    """Its grader takes three seconds, whatever the answer, and says when it started
    (CLOCK_MONOTONIC: the sandbox has no time namespace, so the trainer's clock)."""

    seconds = 3.0

    def grade(self, ctx):
        import time
        started = time.monotonic()
        time.sleep(self.seconds)
        reward = super().grade(ctx)
        return Grade(reward, {"started": started}) if isinstance(reward, float) else reward
