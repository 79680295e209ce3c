"""FixTests: fix the bugs of a small package; the reward is the fraction of hidden cases passed.

/workspace holds `intervals`, five functions over closed integer intervals with three
bugs, and visible unittest tests. The hidden cases are drawn from the seed among the
inputs on which the package as shipped is wrong, so doing nothing scores 0 and every
case a fix gets right counts.

Where the verdict comes from (D7, D10):

- The agent's code runs only in a sandbox nested under the grader's (ctx.run), with the
  submission read-only at /workspace. There RUNNER, the grader's own code passed as
  `python3 -I -c`, starts one fresh `python3 -I -S` per case, so os._exit, sys.exit,
  atexit or a crash in the agent's code loses that case only.
- Each case process imports json before /workspace is on sys.path, and appends
  /workspace after the standard library: a json.py (or any stdlib name) there shadows
  nothing (ENV-SHADOW-01). -I ignores PYTHON* variables, the user site and the working
  directory, -S every site directory, so sitecustomize.py, usercustomize.py and .pth
  files in /workspace never run; nothing reads conftest.py or the agent's tests
  (TEST-EDIT-01, TEST-CONFTEST-01).
- A case sends back only the JSON text of its return values. The trusted grader parses it
  into plain data and compares it with the expected values, types included: an
  AlwaysEqual object cannot be serialised, and monkeypatching dies with the process
  (TEST-EQ-01, TEST-PATCH-01). The expected values never enter the nested sandbox
  (LEAK-STACK-01), so even a fully subverted case process can only guess.
- A missing, malformed or oversized result, an error exit or a timeout fails the case.
"""
from __future__ import annotations

import json
import random
import types

from karotte.environment import Environment, Grade
from karotte.spec import MiB, SandboxSpec

PYTHON = "/usr/bin/python3"
CASES_PER_FUNCTION = 6
CASE_TIMEOUT = 5.0
RESULT_LIMIT = 4096  # bytes of JSON per case; the right answers are far shorter
FUNCTIONS = ("normalize", "total_length", "intersection", "covers", "clip")

PACKAGE_INIT = '''\
"""Closed integer intervals: an interval is a pair [start, end] of ints with start <= end,
given as a 2-item list or tuple, and it holds every number x with start <= x <= end."""
from .core import clip, covers, intersection, normalize, total_length

__all__ = ["clip", "covers", "intersection", "normalize", "total_length"]
'''

PACKAGE_CORE = '''\
import bisect


def normalize(intervals):
    """The union of `intervals` as a list of disjoint [start, end] lists sorted by start.
    Intervals that overlap or touch (one starts where another ends) are merged into one.
    The input may be in any order; it is not modified. normalize([]) == []."""
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_length(intervals):
    """The length of the union of `intervals`: the sum of end - start over
    normalize(intervals). Overlapping parts count once."""
    return sum(end - start for start, end in intervals)


def intersection(a, b):
    """The intersection of intervals a and b as a list [start, end], or None if they have
    no point in common. Intervals that touch meet in one point:
    intersection([1, 3], [3, 5]) == [3, 3]."""
    start, end = max(a[0], b[0]), min(a[1], b[1])
    if start < end:
        return [start, end]
    return None


def covers(intervals, x):
    """True if some interval of `intervals` holds x (ends included), else False."""
    merged = normalize(intervals)
    i = bisect.bisect_right([start for start, _ in merged], x) - 1
    return i >= 0 and x <= merged[i][1]


def clip(intervals, lo, hi):
    """normalize(intervals) cut to the window [lo, hi]: every piece intersected with
    [lo, hi], pieces that miss the window left out, in order."""
    out = []
    for piece in normalize(intervals):
        part = intersection(piece, [lo, hi])
        if part is not None:
            out.append(part)
    return out
'''

VISIBLE_TESTS = '''\
import unittest

from intervals import clip, covers, intersection, normalize, total_length


class NormalizeTest(unittest.TestCase):
    def test_sorted_overlapping(self):
        self.assertEqual(normalize([[1, 3], [2, 6], [8, 10]]), [[1, 6], [8, 10]])

    def test_touching_intervals_merge(self):
        self.assertEqual(normalize([[1, 2], [2, 4]]), [[1, 4]])

    def test_unsorted_input(self):
        self.assertEqual(normalize([[8, 10], [1, 3], [2, 6]]), [[1, 6], [8, 10]])

    def test_empty(self):
        self.assertEqual(normalize([]), [])


class TotalLengthTest(unittest.TestCase):
    def test_disjoint(self):
        self.assertEqual(total_length([[0, 2], [5, 6]]), 3)

    def test_overlap_counts_once(self):
        self.assertEqual(total_length([[0, 4], [2, 6]]), 6)


class IntersectionTest(unittest.TestCase):
    def test_overlap(self):
        self.assertEqual(intersection([1, 5], [3, 8]), [3, 5])

    def test_disjoint(self):
        self.assertIsNone(intersection([1, 2], [4, 5]))

    def test_touching(self):
        self.assertEqual(intersection([1, 3], [3, 5]), [3, 3])


class CoversTest(unittest.TestCase):
    def test_inside_and_outside(self):
        self.assertTrue(covers([[1, 3], [6, 9]], 7))
        self.assertFalse(covers([[1, 3], [6, 9]], 4))


class ClipTest(unittest.TestCase):
    def test_window(self):
        self.assertEqual(clip([[0, 4], [6, 10]], 2, 8), [[2, 4], [6, 8]])


if __name__ == "__main__":
    unittest.main()
'''

# Runs in the nested sandbox, from argv (never from /workspace). stdin: a JSON list of
# {"id", "calls": [{"func", "args"}, ...]}. stdout: one JSON line per case,
# {"id", "exit", "out"}, where "out" is what the case process wrote as its result.
# It never imports the agent's code.
RUNNER = '''\
import json, os, signal, subprocess, sys
CASE, TIMEOUT, LIMIT = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
for case in json.loads(sys.stdin.read()):
    request = json.dumps(case["calls"]).encode()
    p = subprocess.Popen([sys.executable, "-I", "-S", "-c", CASE], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        out, _ = p.communicate(request, timeout=TIMEOUT)
        code = p.returncode
    except subprocess.TimeoutExpired:
        out, code = b"", "timeout"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.kill()
        p.wait()
    text = out[:LIMIT + 1].decode("utf-8", "replace")
    print(json.dumps({"id": case["id"], "exit": code, "out": text}), flush=True)
'''

# One case, in its own `python3 -I -S`: the standard library it needs is imported before
# /workspace goes on sys.path, and /workspace goes after the standard library. -S leaves
# the host's site-packages off the path: a package installed there under the name
# `intervals` cannot stand in for the agent's.
CASE = '''\
import json, os, sys
request = json.loads(sys.stdin.read())
result = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # the agent's prints go to stderr, which nobody reads
sys.path.append("/workspace")
import intervals
values = [getattr(intervals, call["func"])(*call["args"]) for call in request]
result.write(json.dumps(values, allow_nan=False))
result.close()
'''


def reference(func: str, args: list):
    """The documented behaviour (trainer side only: it computes the expected values)."""
    def normalize(intervals):
        merged: list[list[int]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    def intersection(a, b):
        start, end = max(a[0], b[0]), min(a[1], b[1])
        return [start, end] if start <= end else None

    if func == "normalize":
        return normalize(*args)
    if func == "total_length":
        return sum(end - start for start, end in normalize(*args))
    if func == "intersection":
        return intersection(*args)
    if func == "covers":
        intervals, x = args
        return any(start <= x <= end for start, end in intervals)
    if func == "clip":
        intervals, lo, hi = args
        parts = (intersection(piece, [lo, hi]) for piece in normalize(intervals))
        return [p for p in parts if p is not None]
    raise ValueError(func)


def shipped():
    """The package as the agent gets it, to find the inputs it is wrong on."""
    module = types.ModuleType("intervals_as_shipped")
    exec(compile(PACKAGE_CORE, "intervals/core.py", "exec"), module.__dict__)
    return module


def plain(value):
    """value as the grader sees it: through JSON."""
    return json.loads(json.dumps(value))


def random_calls(func: str, rng: random.Random) -> list[list]:
    """The argument lists of one case: a few calls of func, like the asserts of one test.
    A case of intersection asks about a disjoint pair (None) first, then a touching and an
    overlapping pair in either order: a case that ended on answers of None would pass an
    agent that knows the answer to its first pair and answers None to the rest, as a
    table of the cases of 64 guessed seeds sometimes does (PRED-SEED-01). A
    case of covers asks about points inside and outside: no constant answer passes one."""
    def interval():
        start = rng.randint(-30, 30)
        return [start, start + rng.choice((0, 1, 2, 3, 5, 8, 13))]

    def several():
        out = [interval() for _ in range(rng.randint(2, 7))]
        if rng.random() < 0.5:  # two that touch
            a = rng.choice(out)
            out.append([a[1], a[1] + rng.randint(0, 6)])
        rng.shuffle(out)
        return out

    if func in ("normalize", "total_length"):
        return [[several()] for _ in range(3)]
    if func == "intersection":
        a = interval()
        touching = rng.choice(([a[1], a[1] + rng.randint(0, 5)], [a[0] - rng.randint(0, 5), a[0]]))
        disjoint = [a[1] + 1 + rng.randint(0, 5), a[1] + 7 + rng.randint(0, 5)]
        start = rng.randint(a[0] - 8, a[1])
        overlapping = [start, rng.randint(max(start, a[0]), a[1] + 8)]
        # the None first: a case never ends on an answer that a default of None gives
        calls = [rng.sample([a, touching], 2), rng.sample([a, overlapping], 2)]
        rng.shuffle(calls)
        return [rng.sample([a, disjoint], 2), *calls]
    if func == "covers":
        intervals = several()
        points = [p for start, end in intervals for p in (start - 1, start, end, end + 1)]
        inside = [p for p in points if any(s <= p <= e for s, e in intervals)]
        outside = [p for p in points if p not in inside] or [max(points) + 1]
        chosen = [rng.choice(inside), rng.choice(outside), rng.choice(points), rng.choice(points)]
        rng.shuffle(chosen)
        return [[intervals, x] for x in chosen]
    calls = []
    for _ in range(3):
        lo = rng.randint(-30, 30)
        calls.append([several(), lo, lo + rng.randint(0, 30)])
    return calls


def same(a, b) -> bool:
    """Equal as plain JSON data, types included (True is not 1, 1.0 is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def hidden_cases(seed: int) -> list[dict]:
    """CASES_PER_FUNCTION cases per function, each failing on the package as shipped. The
    workspace is the same for every seed, so it tells nothing of the seed; the cases come
    from the seed's stream alone."""
    rng = random.Random(f"fix_tests:{seed}")
    package = shipped()
    cases = []
    for func in FUNCTIONS:
        found = 0
        for _ in range(10000):
            calls = random_calls(func, rng)
            expected = [plain(reference(func, plain(args))) for args in calls]
            try:
                if same(plain([getattr(package, func)(*plain(args)) for args in calls]),
                        expected):
                    continue
            except Exception:  # the shipped code failing is being wrong too
                pass
            cases.append({"id": f"{func}-{found}", "calls": [{"func": func, "args": args}
                                                             for args in calls],
                          "expected": expected})
            found += 1
            if found == CASES_PER_FUNCTION:
                break
        else:
            raise RuntimeError(f"no inputs found on which the shipped {func} is wrong")
    return cases


def _reject_constant(name: str):
    raise ValueError(f"{name} is not plain JSON")


def parse_results(stdout: bytes) -> dict[str, object]:
    """The cases' results by id, from the runner's lines; the first line per id counts.
    A case whose line is missing or malformed is absent."""
    found: dict[str, object] = {}
    for line in stdout.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
            case_id, out = record["id"], record["out"]
            if record["exit"] != 0 or not isinstance(case_id, str) or not isinstance(out, str) \
                    or len(out) > RESULT_LIMIT or case_id in found:
                continue
            found[case_id] = json.loads(out, parse_constant=_reject_constant)
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
    return found


class FixTests(Environment):
    """Fix three bugs in `intervals`; reward = fraction of hidden cases passed."""

    deliverables = ("intervals",)
    limits = SandboxSpec(memory=512 * MiB, timeout=60)
    reward_range = (0.0, 1.0)

    def prompt(self, seed: int) -> str:
        return (
            "/workspace/intervals is a small Python package for closed integer intervals, "
            "with five functions: normalize, total_length, intersection, covers and clip. "
            "Their docstrings say what they must do. The package has bugs; "
            "/workspace/tests holds some unit tests (run them with `cd /workspace && python3 "
            "-m unittest`). Fix the package so that every function does what its docstring "
            "says.\n\n"
            "How you are graded: after you finish, the grader runs "
            f"{len(FUNCTIONS) * CASES_PER_FUNCTION} hidden test cases, {CASES_PER_FUNCTION} "
            "per function. A case calls one function of your /workspace/intervals a few times "
            "and passes if every call returns the documented value, compared exactly, types "
            "included (ints, bools, None, and lists for intervals; a tuple counts as a list). "
            "Every case fails on the package as shipped. Each case runs in a fresh "
            f"`{PYTHON} -I -S` process that imports intervals from /workspace (standard "
            "library only, no network, /workspace read-only) with a "
            f"{CASE_TIMEOUT:g} s time limit; a "
            "crash, an exit, a timeout or a value that is not plain data fails that case. "
            "The reward is the fraction of cases passed, from 0 to 1. The tests in "
            "/workspace/tests are for you: the grader does not run them, so changing them "
            "changes nothing.\n\n"
            "If you find that you cannot do the task, you may give up with the give_up tool; "
            "that ends the episode with reward 0.")

    def workspace_files(self, seed: int):
        return {"intervals/__init__.py": PACKAGE_INIT, "intervals/core.py": PACKAGE_CORE,
                "tests/__init__.py": "", "tests/test_intervals.py": VISIBLE_TESTS}

    def hidden_files(self, seed: int):
        return {"cases.json": json.dumps(hidden_cases(seed))}

    def grade(self, ctx) -> Grade:
        cases = json.loads((ctx.hidden / "cases.json").read_text())
        # Only what a case needs crosses into the nested sandbox: never "expected".
        requests = [{"id": c["id"], "calls": c["calls"]} for c in cases]
        r = self.run_cases(ctx, requests)
        results = parse_results(r.stdout)
        failed = [c["id"] for c in cases
                  if c["id"] not in results or not same(results[c["id"]], c["expected"])]
        passed = len(cases) - len(failed)
        return Grade(passed / len(cases), {"passed": passed, "cases": len(cases),
                                           "failed": failed, f"{self.runner}_exit": r.exit_code,
                                           f"{self.runner}_timed_out": r.timed_out})

    runner = "runner"  # names the run's fields in the grade's details

    def run_cases(self, ctx, requests: list[dict]):
        """Run every case in one nested run, each in a fresh interpreter; the results
        (what the calls returned) on stdout, as parse_results reads them."""
        return ctx.run([PYTHON, "-I", "-c", RUNNER, CASE, str(CASE_TIMEOUT), str(RESULT_LIMIT)],
                       stdin=json.dumps(requests),
                       timeout=len(requests) * (CASE_TIMEOUT + 1) + 10, memory=512 * MiB,
                       output_limit=len(requests) * (RESULT_LIMIT + 256))

    def reference_solution(self, seed: int):
        return [
            "sed -i 's/    for start, end in intervals:/    for start, end in sorted(intervals):/' "
            "intervals/core.py",
            "sed -i 's/    return sum(end - start for start, end in intervals)/"
            "    return sum(end - start for start, end in normalize(intervals))/' "
            "intervals/core.py",
            "sed -i 's/    if start < end:/    if start <= end:/' intervals/core.py",
            "python3 -m unittest 2>&1 | tail -n 1",
        ]
