"""Speedup: make a slow, correct program fast; the reward is the measured speedup.

/workspace/baseline.py counts the inversions of a sequence in quadratic time; the agent
writes /workspace/solution.py with the same contract, faster. Every input is drawn on
its own, and none is given to solution.py twice. The grader:

1. runs solution.py once on each of the check inputs (hidden files of the seed), each
   run in a fresh sandbox nested under the grader's, and checks each output against the
   expected count computed when the hidden files were made (none of them is ever in the
   workspace): one wrong output or failed run scores 0. This pass only fails a wrong
   solution early, before the timing; every timed run is checked again;
2. draws the timed inputs anew, from the grading sandbox's own randomness, and counts
   their inversions itself; then times solution.py against the pristine baseline from
   its own hidden files (the agent's /workspace/baseline.py is never run: editing it
   changes nothing) with ctx.compare_speed: fresh sandboxes, interleaved, each program
   once on each input, timed by the host; every timed run, of both programs, must
   succeed with the expected output. So a solution that is right when checked and wrong
   when timed scores 0, and one that answers an input it saw before, from what an
   earlier run left in host-shared state (the page cache), has none to look up: not in
   this grading, and not in an earlier episode of the same seed (LINK-CACHE-01);
3. scores the ratio of the median times, 0 below MIN_SPEEDUP (a copy of the baseline, or
   a solution that just runs it, is not a speedup), capped at MAX_SPEEDUP.
"""
from __future__ import annotations

import json
import math
import os
import random

from karotte.environment import Environment, File, Grade
from karotte.spec import MiB, SandboxSpec

PYTHON = "/usr/bin/python3"
SIZES = (6000, 7000)  # n of the hidden inputs: the baseline takes about 0.4-0.6 s on one CPU
MIN_SPEEDUP = 1.5
MAX_SPEEDUP = 100.0
KINDS = ("random values", "many repeated values", "nearly descending")
TIMED_PER_KIND = 3  # timed inputs of each kind; the check pass has one of each of its own
RUN_TIMEOUT = 10.0
RUN_MEMORY = 256 * MiB

BASELINE = '''\
"""Count the inversions of a sequence: the pairs i < j with a[i] > a[j].

Input on stdin: n on the first line, then n integers separated by whitespace.
Output on stdout: the number of inversions, as a decimal integer and a newline.
"""
import sys


def count_inversions(a):
    count = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            if a[i] > a[j]:
                count += 1
    return count


def main():
    data = sys.stdin.read().split()
    n = int(data[0])
    a = [int(x) for x in data[1:1 + n]]
    print(count_inversions(a))


main()
'''

REFERENCE = '''\
import sys


def sort_count(a):
    """a sorted, and the number of inversions of a (merge sort)."""
    if len(a) <= 1:
        return a, 0
    mid = len(a) // 2
    left, x = sort_count(a[:mid])
    right, y = sort_count(a[mid:])
    merged, count, i, j = [], x + y, 0, 0
    while i < len(left) and j < len(right):
        if right[j] < left[i]:
            merged.append(right[j])
            count += len(left) - i
            j += 1
        else:
            merged.append(left[i])
            i += 1
    merged += left[i:]
    merged += right[j:]
    return merged, count


data = sys.stdin.buffer.read().split()
n = int(data[0])
print(sort_count([int(x) for x in data[1:1 + n]])[1])
'''


def count_inversions(a: list[int]) -> int:
    """The expected answer, in O(n log n): a Fenwick tree over the ranks of the values."""
    ranks = {v: r for r, v in enumerate(sorted(set(a)), 1)}
    tree = [0] * (len(ranks) + 1)
    inversions = 0
    for seen, v in enumerate(a):
        r = ranks[v]
        not_greater, k = 0, r
        while k:
            not_greater += tree[k]
            k -= k & -k
        inversions += seen - not_greater
        while r < len(tree):
            tree[r] += 1
            r += r & -r
    return inversions


def render(a: list[int]) -> str:
    return f"{len(a)}\n{' '.join(map(str, a))}\n"


def sequence(kind: str, rng: random.Random) -> list[int]:
    """One input of the size the prompt states: random values, many duplicates, or a
    nearly descending run (most pairs are inversions)."""
    n = rng.randint(*SIZES)
    if kind == "random values":
        return [rng.randint(-10**9, 10**9) for _ in range(n)]
    if kind == "many repeated values":
        return [rng.randint(0, 50) for _ in range(n)]
    desc = sorted((rng.randint(-10**6, 10**6) for _ in range(n)), reverse=True)
    for _ in range(n // 20):
        i, j = rng.randrange(n), rng.randrange(n)
        desc[i], desc[j] = desc[j], desc[i]
    return desc


def hidden_sequences(seed: int) -> list[list[int]]:
    """The check pass's inputs, one of each kind. Their stream is not the visible
    examples' (another string seeds it): the examples tell nothing of it."""
    rng = random.Random(f"speedup:hidden:{seed}")
    return [sequence(kind, rng) for kind in KINDS]


def timed_sequences(rng: random.Random) -> list[list[int]]:
    """The timed inputs: TIMED_PER_KIND of each kind, the kinds in turn."""
    return [sequence(kind, rng) for _ in range(TIMED_PER_KIND) for kind in KINDS]


def visible_sequences(seed: int) -> dict[str, list[int]]:
    rng = random.Random(f"speedup:visible:{seed}")
    return {"small": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
            "large": [rng.randint(-10**9, 10**9) for _ in range(SIZES[0])]}


class Speedup(Environment):
    """Count inversions faster than a quadratic baseline; reward = measured speedup."""

    deliverables = ("solution.py",)
    limits = SandboxSpec(memory=1024 * MiB, timeout=120)
    reward_range = (0.0, MAX_SPEEDUP)
    deep = True  # the measured speedup does not saturate at the top

    def prompt(self, seed: int) -> str:
        return (
            "/workspace/baseline.py reads a sequence of integers on stdin and prints its "
            "number of inversions (pairs of positions i < j with a[i] > a[j]). It is correct "
            "but slow: it compares every pair. Input: n on the first line, then n integers "
            "separated by whitespace. Output: the count as a decimal integer and a newline. "
            "/workspace/examples/ holds two inputs (*.in) with their outputs (*.out).\n\n"
            "Write /workspace/solution.py with the same contract that runs faster.\n\n"
            "How you are graded: after you finish, the grader runs your program as "
            f"`{PYTHON} -I /workspace/solution.py`, with the input on stdin, on "
            f"{len(KINDS) * (1 + TIMED_PER_KIND)} hidden inputs with {SIZES[0]} <= n <= "
            f"{SIZES[1]} and |a[i]| <= 10^9, each drawn at random on its own: "
            f"{1 + TIMED_PER_KIND} with random values, {1 + TIMED_PER_KIND} with many "
            f"repeated values, {1 + TIMED_PER_KIND} nearly in descending order. It runs your "
            "program once on each input, never twice on one, and draws the inputs it times "
            "anew in every grading. Each run is in a fresh sandbox "
            f"with no network, one CPU, {RUN_MEMORY // MiB} MiB of memory and a "
            f"{RUN_TIMEOUT:g} s time limit, with /workspace read-only as its working "
            "directory; only the standard library is available. First your program runs on "
            f"{len(KINDS)} of the inputs (one of each kind) and every output must be the right "
            "count (whitespace around it is ignored): one wrong output, error exit or timeout "
            "gives reward 0. Then your program and the original baseline (the grader's own "
            "copy; editing /workspace/baseline.py changes nothing) each run once on each of "
            f"the other {len(KINDS) * TIMED_PER_KIND} inputs, interleaved, timed by wall clock "
            "from outside (interpreter start-up included), and the output of every one of "
            "these runs is checked too: one wrong output or failed run gives reward 0. The "
            "reward is the baseline's median time divided by your program's median time, "
            "the speedup; "
            f"a speedup below {MIN_SPEEDUP:g} gives 0, and the reward is capped at "
            f"{MAX_SPEEDUP:g}.\n\n"
            "If you find that you cannot do the task, you may give up with the give_up tool; "
            "that ends the episode with reward 0.")

    def workspace_files(self, seed: int):
        files: dict[str, str | File] = {"baseline.py": File(BASELINE, 0o755)}
        for name, seq in visible_sequences(seed).items():
            files[f"examples/{name}.in"] = render(seq)
            files[f"examples/{name}.out"] = f"{count_inversions(seq)}\n"
        return files

    def hidden_files(self, seed: int):
        checked = hidden_sequences(seed)
        files = {"baseline.py": BASELINE,
                 "expected.json": json.dumps([count_inversions(s) for s in checked])}
        for i, seq in enumerate(checked):
            files[f"inputs/{i}.in"] = render(seq)
        return files

    def grade(self, ctx) -> Grade:
        if not (ctx.submission / "solution.py").is_file():
            return Grade(0.0, {"why": "no solution.py"})
        answers = json.loads((ctx.hidden / "expected.json").read_text())
        expected = [str(e).encode() for e in answers]
        checked = [(ctx.hidden / "inputs" / f"{i}.in").read_bytes() for i in range(len(answers))]
        candidate = [PYTHON, "-I", "/workspace/solution.py"]
        # The pristine baseline from /hidden, as source on the command line: the nested
        # sandbox sees only the submission, and the agent's baseline.py is never run.
        baseline = [PYTHON, "-I", "-c", (ctx.hidden / "baseline.py").read_text()]
        # Fail a wrong solution early, before the timing, on inputs that are not timed.
        for i, data in enumerate(checked):
            r = ctx.run(candidate, stdin=data, timeout=RUN_TIMEOUT, memory=RUN_MEMORY,
                        output_limit=64 * 1024)
            if r.exit_code != 0 or r.timed_out or r.oom_killed:
                return Grade(0.0, {"why": f"solution failed on check input {i}: exit "
                                          f"{r.exit_code}, signal {r.signal}, timed out "
                                          f"{r.timed_out}, oom {r.oom_killed}"})
            if r.stdout.strip() != expected[i]:
                return Grade(0.0, {"why": f"wrong output on check input {i}"})
        # The timed inputs are new in every grading: a seed comes again (the next epoch)
        # with the same hidden files, and a solution that marked its answers to those in
        # the page cache in an earlier episode would find them there (LINK-CACHE-01).
        # The reward is a measurement: nothing reproducible is lost.
        timed = timed_sequences(random.Random(os.urandom(32)))
        # expected=: every timed run of both programs is checked, not only a first round;
        # a solution that answers right while checked and wrong once only its speed
        # counts (it can tell by the clock) scores 0.
        speed = ctx.compare_speed(candidate, baseline, [render(s).encode() for s in timed],
                                  expected=[str(count_inversions(s)) for s in timed],
                                  timeout=RUN_TIMEOUT, memory=RUN_MEMORY,
                                  output_limit=64 * 1024)
        details = {"solution_seconds": speed.candidate_seconds,
                   "baseline_seconds": speed.baseline_seconds,
                   "speedup": speed.speedup if math.isfinite(speed.speedup) else "inf"}
        failed = next((run for run in speed.runs if run.failure), None)
        if failed is not None:
            if failed.program == "baseline":
                why = f"the baseline failed on timed input {failed.input}: {failed.failure}"
            else:
                why = f"{failed.failure} on timed input {failed.input}"
            return Grade(0.0, dict(details, why=why, failures=list(speed.failures[:5])))
        if speed.speedup < MIN_SPEEDUP:
            return Grade(0.0, dict(details, why=f"speedup below {MIN_SPEEDUP:g}"))
        return Grade(min(speed.speedup, MAX_SPEEDUP), dict(details, why="correct and faster"))

    def reference_solution(self, seed: int):
        return [f"cat > solution.py <<'EOF'\n{REFERENCE}EOF"]
