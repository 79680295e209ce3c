"""Environments whose hidden data an agent can predict from what it sees and their public
source (PRED-SEED-01). Each makes a mistake that the keyed seed cannot undo: it throws
the seed's entropy away, its hidden data depend on no seed, or its hidden stream goes on
from the stream the agent sees. `karotte check`'s predict-hidden must fail the first
three; the fourth is what only review finds (docs/examples.md)."""
import json
import random

from karotte.environment import Environment, Grade
from karotte.spec import MiB, SandboxSpec

from .basic import Addition

PYTHON = "/usr/bin/python3"


class ReducesItsSeed(Addition):
    """Addition whose numbers come from seed % 1000: numbers.txt tells which of 1000
    seeds it is, and with it the expected sum."""

    @staticmethod
    def numbers(seed):
        rng = random.Random(f"reduces:{seed % 1000}")
        return rng.randint(1000, 9999), rng.randint(1000, 9999)


def render(numbers):
    return " ".join(map(str, numbers)) + "\n"


class SumsHiddenInputs(Environment):
    """solution.py prints the sum of the integers on stdin; the grader runs it on hidden
    inputs. Here those come from seed % 1000, like the visible example."""

    deliverables = ("solution.py",)
    limits = SandboxSpec(memory=256 * MiB, timeout=30)

    def streams(self, seed):
        return (random.Random(f"sums:example:{seed % 1000}"),
                random.Random(f"sums:hidden:{seed % 1000}"))

    def inputs(self, seed):
        rng = self.streams(seed)[1]
        return [[rng.randint(-10**6, 10**6) for _ in range(20)] for _ in range(4)]

    def prompt(self, seed):
        return ("Write /workspace/solution.py: it reads integers separated by whitespace on "
                "stdin and prints their sum. /workspace/example.in is an example input. The "
                f"grader runs `{PYTHON} -I /workspace/solution.py` on 4 hidden inputs; the "
                "reward is the fraction it gets right.")

    def workspace_files(self, seed):
        rng = self.streams(seed)[0]
        return {"example.in": render(rng.randint(-10**6, 10**6) for _ in range(20))}

    def hidden_files(self, seed):
        inputs = self.inputs(seed)
        files = {f"inputs/{i}.in": render(a) for i, a in enumerate(inputs)}
        files["expected.json"] = json.dumps([sum(a) for a in inputs])
        return files

    def grade(self, ctx):
        if ctx.read_deliverable("solution.py") is None:
            return Grade(0.0, {"why": "no solution.py"})
        expected = json.loads((ctx.hidden / "expected.json").read_text())
        right = 0
        for i, total in enumerate(expected):
            r = ctx.run([PYTHON, "-I", "/workspace/solution.py"],
                        stdin=(ctx.hidden / "inputs" / f"{i}.in").read_bytes(), timeout=10)
            right += r.exit_code == 0 and r.stdout.strip() == str(total).encode()
        return Grade(right / len(expected), {"right": right})

    def reference_solution(self, seed):
        return ["printf 'import sys\\nprint(sum(map(int, sys.stdin.read().split())))\\n' "
                "> solution.py"]


class ConstantHiddenInputs(SumsHiddenInputs):
    """The visible example comes from the whole seed, but the hidden inputs are the same
    in every episode: the source tells them."""

    def streams(self, seed):
        return random.Random(f"constant:example:{seed}"), random.Random("constant:hidden")


class ContinuesTheVisibleStream(SumsHiddenInputs):
    """A large example of 700 32-bit draws, and the hidden inputs drawn from the rest of
    the same Mersenne Twister stream: 624 outputs give its whole state, so the example
    tells the hidden inputs, whatever the seed. No small seed finds this."""

    EXAMPLE = 700

    def stream(self, seed):
        return random.Random(f"continues:{seed}")

    def example(self, rng):
        return [rng.getrandbits(32) for _ in range(self.EXAMPLE)]

    def inputs(self, seed):
        rng = self.stream(seed)
        self.example(rng)
        return hidden_inputs_after(rng)

    def workspace_files(self, seed):
        return {"example.in": render(self.example(self.stream(seed)))}


class DrawsHiddenFromItsOwnStream(ContinuesTheVisibleStream):
    """The same, with the hidden inputs drawn from a stream of their own."""

    def inputs(self, seed):
        return hidden_inputs_after(random.Random(f"continues:hidden:{seed}"))


def hidden_inputs_after(rng):
    """ContinuesTheVisibleStream's hidden inputs, drawn from rng as it stands."""
    return [[rng.getrandbits(32) for _ in range(20)] for _ in range(4)]


class ReducesItsSeedPastTheSmallSeeds(SumsHiddenInputs):
    """SumsHiddenInputs from seed % 100000: no small seed shows the episode's example
    (almost never), but an agent walks 100,000 seeds in a second."""

    def streams(self, seed):
        return (random.Random(f"sums:example:{seed % 100000}"),
                random.Random(f"sums:hidden:{seed % 100000}"))
