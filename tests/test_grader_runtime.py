"""ctx.compare_speed's verdict on every run it times, with the runs scripted (no sandbox):
each test gives the outputs the two programs print, run by run, and checks what counts."""
from __future__ import annotations

import pytest

from karotte.grader_runtime import GradeContext, GraderError
from karotte.results import ExecResult

CANDIDATE, BASELINE = ["candidate"], ["baseline"]


class Scripted(GradeContext):
    """A GradeContext whose run() answers from `outputs`: program -> a function of (input,
    n) to stdout, n counting that program's runs from 0. `changes` maps (program, input)
    to ExecResult fields that differ from a clean exit; `seconds` maps program to a
    function of (input, seen), seen telling whether that program ran that input before."""

    def __init__(self, outputs, changes=None, seconds=None):
        super().__init__(0, channel=None)
        self.outputs, self.changes = outputs, changes or {}
        self.seconds = seconds or {"candidate": lambda stdin, seen: 0.01,
                                   "baseline": lambda stdin, seen: 0.5}
        self.count, self.seen, self.limits = {}, [], []

    def run(self, argv, *, stdin=b"", timeout=10.0, memory=0, pids=64, cpus=1.0,
            output_limit=0, private_userland=False):
        program = argv[0]
        n = self.count.get(program, 0)
        self.count[program] = n + 1
        seen = (program, stdin) in self.seen
        self.seen.append((program, stdin))
        self.limits.append(output_limit)
        fields = dict(exit_code=0, signal=None, stdout=self.outputs[program](stdin, n),
                      stderr=b"", stdout_truncated=False, stderr_truncated=False,
                      timed_out=False, oom_killed=False,
                      wall_seconds=self.seconds[program](stdin, seen), cpu_seconds=0.0,
                      peak_memory=None)
        fields.update(self.changes.get((program, stdin), {}))
        return ExecResult(**fields)


def double(stdin: bytes, n: int) -> bytes:
    return b"%d\n" % (2 * int(stdin))


INPUTS = [b"1", b"2", b"3"]
EXPECTED = ["2", b" 4 ", "6\n"]


def test_an_honest_pair_has_no_failures_and_every_run_is_reported():
    ctx = Scripted({"candidate": double, "baseline": double})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=EXPECTED)
    assert cmp.ok and cmp.failures == () and cmp.speedup == pytest.approx(50)
    assert [(r.program, r.input) for r in cmp.runs] == [
        ("candidate", 0), ("baseline", 0), ("baseline", 1), ("candidate", 1),
        ("candidate", 2), ("baseline", 2)]
    assert all(r.failure is None for r in cmp.runs)


def test_LINK_CACHE_01_each_program_runs_each_input_once_so_no_run_answers_from_a_cache():
    # A candidate that answers at once whatever it saw before, and slowly what it sees
    # for the first time (a cache in state the host shares between sandboxes): each of
    # its timed runs is a first sight, so it is exactly as fast as without the cache.
    cached = {"candidate": lambda stdin, seen: 0.01 if seen else 0.5,
              "baseline": lambda stdin, seen: 0.5}
    ctx = Scripted({"candidate": double, "baseline": double}, seconds=cached)
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=EXPECTED)
    assert sorted(ctx.seen) == sorted({(p, i) for p in ("candidate", "baseline") for i in INPUTS})
    assert cmp.ok and cmp.speedup == pytest.approx(1.0)


@pytest.mark.parametrize("inputs, why", [
    ([b"1", b"2", b"1"], "input 2 the same as input 0"),
    ([b"5\n", b"7", b" 5"], "input 2 the same apart from whitespace as input 0"),
])
def test_LINK_CACHE_01_an_input_given_twice_is_refused_before_anything_runs(inputs, why):
    ctx = Scripted({"candidate": double, "baseline": double})
    with pytest.raises(GraderError, match=why + ".*page cache.*draw every input on its own"):
        ctx.compare_speed(CANDIDATE, BASELINE, inputs)
    assert ctx.seen == []


def test_a_wrong_answer_in_a_later_run_is_a_failure():
    # PERF-HOLLOW-01: right in its first run, 0 once it guesses that only speed counts.
    ctx = Scripted({"candidate": lambda stdin, n: double(stdin, n) if n == 0 else b"0\n",
                    "baseline": double})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=EXPECTED)
    assert not cmp.ok
    assert cmp.failures == ("candidate on input 1: wrong output",
                            "candidate on input 2: wrong output")


def test_without_expected_the_baseline_is_the_oracle_for_the_candidate():
    ctx = Scripted({"candidate": lambda stdin, n: b"0\n" if stdin == b"3" else double(stdin, n),
                    "baseline": double})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS)
    assert cmp.failures == ("candidate on input 2: wrong output",)


def test_with_expected_a_baseline_that_goes_wrong_is_caught_too():
    ctx = Scripted({"candidate": double,
                    "baseline": lambda stdin, n: b"9\n" if stdin == b"1" else double(stdin, n)})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=EXPECTED)
    assert cmp.failures == ("baseline on input 0: wrong output",)


def test_a_check_function_judges_every_run():
    seen = []

    def close(i, stdout):
        seen.append(i)
        return abs(float(stdout) - 2 * int(INPUTS[i])) < 0.01

    ctx = Scripted({"candidate": lambda stdin, n: b"%.3f" % (2 * int(stdin) + 0.001 * n),
                    "baseline": double})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, check=close)
    assert cmp.ok and sorted(seen) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("change, failure", [
    ({"exit_code": 1}, "exit 1"),
    ({"exit_code": None, "signal": 9}, "killed by signal 9"),
    ({"timed_out": True, "exit_code": None, "signal": 9}, "timed out"),
    ({"oom_killed": True}, "out of memory"),
    ({"stdout_truncated": True}, "output over the limit"),
])
def test_a_run_that_does_not_end_cleanly_fails_whatever_it_printed(change, failure):
    ctx = Scripted({"candidate": double, "baseline": double}, {("candidate", b"2"): change})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=EXPECTED, output_limit=4096)
    assert cmp.failures == (f"candidate on input 1: {failure}",)
    assert set(ctx.limits) == {4096}


def test_arguments_that_would_leave_runs_unchecked_or_misjudged_are_refused():
    ctx = Scripted({"candidate": double, "baseline": double})
    with pytest.raises(GraderError, match="expected or check, not both"):
        ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=EXPECTED,
                          check=lambda i, out: True)
    with pytest.raises(GraderError, match="1 expected outputs for 3 inputs"):
        ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=["2"])
    with pytest.raises(GraderError, match="at least one input"):
        ctx.compare_speed(CANDIDATE, BASELINE, [], expected=[])
    assert ctx.seen == []  # nothing ran


def test_the_grader_library_holds_bytecode_of_the_graders_own_interpreter():
    """The grader runs with -B from a read-only copy: without bytecode made beforehand it
    compiles every module in every grading (scripts/bench_episode.py: 5 to 9 ms of each)."""
    import glob
    import os
    import subprocess

    from karotte.grading import PYTHON, grader_library

    lib = grader_library("karotte")
    magic = subprocess.run([PYTHON, "-I", "-c", "import importlib.util, sys; "
                            "sys.stdout.buffer.write(importlib.util.MAGIC_NUMBER)"],
                           capture_output=True, check=True).stdout
    sources = glob.glob(f"{lib}/**/*.py", recursive=True)
    assert sources
    for source in sources:
        folder, name = os.path.split(source)
        compiled = glob.glob(f"{folder}/__pycache__/{name[:-3]}.*.pyc")
        assert len(compiled) == 1, source
        with open(compiled[0], "rb") as f:
            assert f.read(4) == magic, compiled[0]
