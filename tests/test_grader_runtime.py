"""ctx.compare_speed's verdict on every run it times, with the runs scripted (no sandbox):
each test gives the outputs the two programs print, run by run, and checks what counts."""
from __future__ import annotations

import pytest

from karotte.grader_runtime import GradeContext, GraderError
from karotte.results import ExecResult

CANDIDATE, BASELINE = ["candidate"], ["baseline"]


class Scripted(GradeContext):
    """A GradeContext whose run() answers from `outputs`: program -> a function of (input,
    n) to stdout, n counting that program's runs on that input from 0. `changes` maps
    (program, input, n) to ExecResult fields that differ from a clean exit."""

    def __init__(self, outputs, changes=None):
        super().__init__(0, channel=None)
        self.outputs, self.changes, self.count = outputs, changes or {}, {}
        self.limits = []

    def run(self, argv, *, stdin=b"", timeout=10.0, memory=0, pids=64, cpus=1.0,
            output_limit=0):
        program = argv[0]
        n = self.count.get((program, stdin), 0)
        self.count[program, stdin] = n + 1
        self.limits.append(output_limit)
        fields = dict(exit_code=0, signal=None, stdout=self.outputs[program](stdin, n),
                      stderr=b"", stdout_truncated=False, stderr_truncated=False,
                      timed_out=False, oom_killed=False,
                      wall_seconds=0.01 if program == "candidate" else 0.5, cpu_seconds=0.0,
                      peak_memory=None)
        fields.update(self.changes.get((program, stdin, n), {}))
        return ExecResult(**fields)


def double(stdin: bytes, n: int) -> bytes:
    return b"%d\n" % (2 * int(stdin))


INPUTS = [b"1", b"2"]


def test_an_honest_pair_has_no_failures_and_every_run_is_reported():
    ctx = Scripted({"candidate": double, "baseline": double})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=["2", b" 4 "])
    assert cmp.ok and cmp.failures == () and cmp.speedup == pytest.approx(50)
    assert [(r.program, r.input, r.repeat) for r in cmp.runs[:4]] == [
        ("candidate", 0, 0), ("baseline", 0, 0), ("baseline", 1, 0), ("candidate", 1, 0)]
    assert len(cmp.runs) == 2 * 2 * 3 and all(r.failure is None for r in cmp.runs)


def test_a_wrong_answer_in_a_later_repeat_is_a_failure():
    # PERF-HOLLOW-01: right in the first repeat, 0 once only its speed is measured.
    ctx = Scripted({"candidate": lambda stdin, n: double(stdin, n) if n == 0 else b"0\n",
                    "baseline": double})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=["2", "4"])
    assert not cmp.ok
    assert cmp.failures == tuple(f"candidate on input {i}, repeat {rep}: wrong output"
                                 for rep in (1, 2) for i in (0, 1))
    assert [r.failure for r in cmp.runs if r.repeat == 0] == [None] * 4


def test_without_expected_the_baseline_is_the_oracle_for_both_programs():
    ctx = Scripted({"candidate": lambda stdin, n: b"0\n" if (stdin, n) == (b"2", 2) else
                    double(stdin, n),
                    "baseline": lambda stdin, n: b"9\n" if (stdin, n) == (b"1", 1) else
                    double(stdin, n)})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS)
    assert cmp.failures == ("baseline on input 0, repeat 1: wrong output",
                            "candidate on input 1, repeat 2: wrong output")


def test_a_check_function_judges_every_run():
    seen = []

    def close(i, stdout):
        seen.append(i)
        return abs(float(stdout) - 2 * int(INPUTS[i])) < 0.01

    ctx = Scripted({"candidate": lambda stdin, n: b"%.3f" % (2 * int(stdin) + 0.001 * n),
                    "baseline": double})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, check=close)
    assert cmp.ok and sorted(seen) == [0] * 6 + [1] * 6


@pytest.mark.parametrize("change, failure", [
    ({"exit_code": 1}, "exit 1"),
    ({"exit_code": None, "signal": 9}, "killed by signal 9"),
    ({"timed_out": True, "exit_code": None, "signal": 9}, "timed out"),
    ({"oom_killed": True}, "out of memory"),
    ({"stdout_truncated": True}, "output over the limit"),
])
def test_a_run_that_does_not_end_cleanly_fails_whatever_it_printed(change, failure):
    ctx = Scripted({"candidate": double, "baseline": double}, {("candidate", b"2", 1): change})
    cmp = ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=["2", "4"], output_limit=4096)
    assert cmp.failures == (f"candidate on input 1, repeat 1: {failure}",)
    assert set(ctx.limits) == {4096}


def test_arguments_that_would_leave_runs_unchecked_or_misjudged_are_refused():
    ctx = Scripted({"candidate": double, "baseline": double})
    with pytest.raises(GraderError, match="expected or check, not both"):
        ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=["2", "4"],
                          check=lambda i, out: True)
    with pytest.raises(GraderError, match="1 expected outputs for 2 inputs"):
        ctx.compare_speed(CANDIDATE, BASELINE, INPUTS, expected=["2"])
    with pytest.raises(GraderError, match="at least one input"):
        ctx.compare_speed(CANDIDATE, BASELINE, [], expected=[])
    assert ctx.count == {}  # nothing ran
