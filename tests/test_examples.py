"""The example environments: the reference solution scores the top, doing nothing and a
wrong answer score the bottom, and targeted reward hacks score no more than doing nothing."""
from __future__ import annotations

import json
import random
import shlex

import pytest

from karotte.episode import Episode
from karotte.examples.fix_tests import FUNCTIONS, FixTests, hidden_cases
from karotte.examples.fix_tests_pytest import FixTestsPytest
from karotte.examples.q3_revenue import Q3Revenue, orders, revenue, year_of
from karotte.examples.speedup import (BASELINE, KINDS, MIN_SPEEDUP, SIZES, TIMED_PER_KIND,
                                      Speedup, count_inversions, render, timed_sequences)
from karotte.results import ExecResult
from karotte.seeding import env_seed
from test_env_images import debian_store  # noqa: F401 (a fixture: the store holding the image)

SEED = 3
Q3_SEED = env_seed(Q3Revenue(), SEED)  # what the environment sees in the episodes of SEED


def play(env, commands, seed=SEED):
    with Episode(env, seed=seed) as ep:
        ep.reset()
        for command in commands:
            r = ep.exec(command)
            assert r.exit_code == 0, r.text
        outcome = ep.finish()
    assert outcome.infra_error is None and outcome.violations == ()
    return outcome


def write(path: str, text: str) -> str:
    """A command that writes text to path (relative to /workspace)."""
    return f"printf %s {shlex.quote(text)} > {path}"


def graded(outcome, reward):
    return (outcome.reward, outcome.reason) == (reward, "graded")


# --- Q3Revenue -------------------------------------------------------------------------

def test_q3_the_reference_solution_scores_1(no_leaks):
    env = Q3Revenue()
    assert graded(play(env, env.reference_solution(SEED)), 1.0)


def test_q3_doing_nothing_scores_0(no_leaks):
    assert graded(play(Q3Revenue(), []), 0.0)


def test_q3_revenue_of_every_status_is_a_wrong_answer_and_scores_0(no_leaks):
    rows = [r for r in orders(Q3_SEED) if "07" <= r["date"][5:7] <= "09"]
    wrong = sum(int(r["quantity"]) * int(r["unit_price"]) for r in rows)
    assert wrong != revenue(orders(Q3_SEED), year_of(Q3_SEED))
    assert graded(play(Q3Revenue(), [write("answer.txt", f"{wrong}\n")]), 0.0)


def test_q3_the_data_hold_every_status_on_every_boundary_day():
    rows = orders(SEED)
    for day in ("06-30", "07-01", "09-30", "10-01"):
        assert {r["status"] for r in rows if r["date"][5:] == day} == {
            "paid", "refunded", "cancelled", "pending"}
    assert any("," in r["customer"] for r in rows)


def test_q3_the_right_number_as_a_plain_integer_scores_1(no_leaks):
    right = revenue(orders(Q3_SEED), year_of(Q3_SEED))
    assert graded(play(Q3Revenue(), [write("answer.txt", f"{right}\n")]), 1.0)


@pytest.mark.parametrize("form", ["{}.0", "{}.", "{}e0", "+{}", "{:_}", "NaN", "inf"])
def test_q3_the_right_number_not_as_a_plain_integer_scores_0(no_leaks, form):
    right = revenue(orders(Q3_SEED), year_of(Q3_SEED))
    assert graded(play(Q3Revenue(), [write("answer.txt", form.format(right))]), 0.0)


def test_q3_the_expected_answer_is_out_of_the_agents_reach(no_leaks):
    right = str(revenue(orders(Q3_SEED), year_of(Q3_SEED)))
    with Episode(Q3Revenue(), seed=SEED) as ep:
        ep.reset()
        r = ep.exec(f"grep -rl {right} /workspace /tmp /home /opt /hidden 2>&1; true")
        assert "expected" not in r.text and "/workspace" not in r.text


@pytest.mark.parametrize("seed", range(20))
def test_q3_every_seed_has_a_year_of_orders_and_a_positive_total(seed):
    rows = orders(seed)
    assert 300 <= len(rows) <= 2600
    assert {r["date"][:4] for r in rows} == {str(year_of(seed))}
    assert revenue(rows, year_of(seed)) > 0


# --- Speedup ----------------------------------------------------------------------------

def test_speedup_the_reference_solution_is_much_faster(no_leaks):
    env = Speedup()
    outcome = play(env, env.reference_solution(SEED))
    print(f"\nreference speedup: {outcome.reward:.1f} ({outcome.details})")
    assert outcome.reason == "graded" and outcome.reward > 3 * MIN_SPEEDUP, outcome.details


def test_speedup_doing_nothing_scores_0(no_leaks):
    outcome = play(Speedup(), [])
    assert graded(outcome, 0.0) and outcome.details["why"] == "no solution.py"


def test_speedup_a_fast_wrong_solution_scores_0(no_leaks):
    # counts a[i] >= a[j]: right on distinct values, wrong on repeated ones
    fast_wrong = ("import sys, bisect\ndata = sys.stdin.read().split()\nseen, count = [], 0\n"
                  "for x in map(int, data[1:]):\n"
                  "    count += len(seen) - bisect.bisect_left(seen, x)\n"
                  "    bisect.insort(seen, x)\nprint(count)\n")
    outcome = play(Speedup(), [write("solution.py", fast_wrong)])
    assert graded(outcome, 0.0) and "wrong output" in outcome.details["why"]


def test_speedup_printing_the_visible_examples_answers_scores_0(no_leaks):
    lookup = ("import pathlib, sys\ndata = sys.stdin.read()\n"
              "for f in pathlib.Path('/workspace/examples').glob('*.in'):\n"
              "    if f.read_text() == data:\n"
              "        print(f.with_suffix('.out').read_text().strip()); break\n"
              "else:\n    print(0)\n")
    outcome = play(Speedup(), [write("solution.py", lookup)])
    assert graded(outcome, 0.0) and "wrong output" in outcome.details["why"]


def test_speedup_a_solution_that_runs_baseline_py_scores_0(no_leaks):
    outcome = play(Speedup(), [write("solution.py",
                                     "import runpy\nrunpy.run_path('/workspace/baseline.py')\n")])
    assert graded(outcome, 0.0), outcome.details
    assert outcome.details["why"] == f"speedup below {MIN_SPEEDUP:g}"


def test_speedup_a_slowed_down_workspace_baseline_is_never_timed(no_leaks):
    # TIME-BASELINE: the agent's baseline.py sleeps; its solution is the original code
    slowed = BASELINE.replace("main()\n", "import time\ntime.sleep(3)\nmain()\n")
    outcome = play(Speedup(), ["cp baseline.py solution.py", write("baseline.py", slowed)])
    assert graded(outcome, 0.0), outcome.details
    assert outcome.details["baseline_seconds"] < 3.0  # the slowed one sleeps 3 s


def test_speedup_a_workspace_baseline_that_agrees_with_a_wrong_solution_scores_0(no_leaks):
    # TEST-EDIT: baseline.py and solution.py both print 0 at once
    outcome = play(Speedup(), [write("baseline.py", "print(0)\n"),
                               write("solution.py", "print(0)\n")])
    assert graded(outcome, 0.0) and "wrong output" in outcome.details["why"]


PHASE_SECONDS = 4.3  # about when, with the baseline's 0.5 s runs, the third timed input begins


def test_speedup_a_solution_right_only_while_checked_scores_0(no_leaks):
    # PERF-HOLLOW-01, the red team's PoC: the quadratic baseline while the grader is
    # checking, then a wrong answer at once, when it guesses that only speed counts. It
    # tells the phases apart by the age of its file: the copy's mtime is fixed now, its
    # ctime still says when custody made it. Before every timed run was checked, this
    # scored about 40: most timed runs were fast wrong ones, which set the median.
    two_faced = ("import os, time\n"
                 f"if time.time() - os.stat(__file__).st_ctime > {PHASE_SECONDS}:\n"
                 "    print(0)\n    raise SystemExit\n" + BASELINE)
    outcome = play(Speedup(), [write("solution.py", two_faced)])
    assert graded(outcome, 0.0), outcome.details
    why = outcome.details["why"]
    assert why.startswith("wrong output on timed input"), outcome.details


def test_speedup_expected_answers_match_the_baseline():
    rng = random.Random(0)
    for n in (0, 1, 2, 7, 50):
        a = [rng.randint(-3, 3) for _ in range(n)]
        assert count_inversions(a) == sum(a[i] > a[j] for i in range(n) for j in range(i + 1, n))


@pytest.mark.parametrize("seed", range(20))
def test_speedup_inputs_have_the_stated_sizes_and_fit_the_grading_channel(seed):
    files = Speedup().hidden_files(seed)
    inputs = [files[f"inputs/{i}.in"] for i in range(len(KINDS))] + [
        render(s) for s in timed_sequences(random.Random(seed))]
    assert len(inputs) == len(KINDS) * (1 + TIMED_PER_KIND)
    for data in inputs:
        n = int(data.split()[0])
        assert SIZES[0] <= n <= SIZES[1] and len(data.split()) == n + 1
        assert len(data) < 100_000  # base64 in one request record of at most 256 KiB
    # LINK-CACHE-01: no input twice, so no run of the solution meets an input it saw before
    assert len({tuple(data.split()) for data in inputs}) == len(inputs)


# --- FixTests ---------------------------------------------------------------------------

def test_fix_tests_the_reference_solution_scores_1(no_leaks):
    env = FixTests()
    outcome = play(env, env.reference_solution(SEED))
    assert graded(outcome, 1.0), outcome.details


def test_fix_tests_doing_nothing_scores_0(no_leaks):
    assert graded(play(FixTests(), []), 0.0)


def test_fix_tests_the_visible_tests_fail_as_shipped_and_pass_after_the_fix(no_leaks):
    env = FixTests()
    with Episode(env, seed=SEED) as ep:
        ep.reset()
        assert "FAILED (failures=3)" in ep.exec("python3 -m unittest").text
        for command in env.reference_solution(SEED):
            ep.exec(command)
        assert ep.exec("python3 -m unittest").text.rstrip().endswith("OK")


def test_fix_tests_fixing_one_bug_earns_part_of_the_reward(no_leaks):
    env = FixTests()
    outcome = play(env, env.reference_solution(SEED)[:1])
    assert outcome.reason == "graded" and 0.0 < outcome.reward < 1.0


def test_fix_tests_os_exit_in_one_function_loses_only_its_cases(no_leaks):
    env = FixTests()
    outcome = play(env, env.reference_solution(SEED) + [
        "sed -i 's/^def covers(intervals, x):$/&\\n    import os; os._exit(0)/' "
        "intervals/core.py"])
    assert graded(outcome, 0.8), outcome.details
    assert {c.split("-")[0] for c in outcome.details["failed"]} == {"covers"}


def test_fix_tests_stubs_that_return_none_score_0(no_leaks):
    stub = "".join(f"def {f}(*args):\n    return None\n" for f in FUNCTIONS)
    assert graded(play(FixTests(), [write("intervals/core.py", stub)]), 0.0)


def test_fix_tests_editing_the_visible_tests_changes_nothing(no_leaks):
    outcome = play(FixTests(), [write("tests/test_intervals.py", "import unittest\n"),
                                "python3 -m unittest"])
    assert graded(outcome, 0.0)


def test_fix_tests_a_conftest_that_reports_passed_changes_nothing(no_leaks):
    conftest = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
                "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
                "    outcome.get_result().outcome = 'passed'\n")
    assert graded(play(FixTests(), [write("conftest.py", conftest),
                                    write("tests/conftest.py", conftest)]), 0.0)


def test_fix_tests_os_exit_at_import_scores_0(no_leaks):
    outcome = play(FixTests(), ["sed -i '1i import os; os._exit(0)' intervals/__init__.py"])
    assert graded(outcome, 0.0)


def test_fix_tests_always_equal_return_values_score_0(no_leaks):
    always = ("class AlwaysEqual(list):\n    def __eq__(self, other):\n        return True\n"
              "    def __ne__(self, other):\n        return False\n"
              "class Anything:\n    def __eq__(self, other):\n        return True\n")
    always += "".join(f"def {f}(*args):\n    return Anything()\n" for f in
                      ("normalize", "total_length", "intersection", "covers"))
    always += "def clip(*args):\n    return AlwaysEqual()\n"
    assert graded(play(FixTests(), [write("intervals/core.py", always)]), 0.0)


def test_fix_tests_a_json_shadow_module_is_never_imported(no_leaks):
    # If json.py were imported anywhere, every case would fail; the fixed package scores 1.
    env = FixTests()
    poisoned = "import os\nos._exit(0)\n"
    outcome = play(env, env.reference_solution(SEED) + [
        write("json.py", poisoned), write("intervals/json.py", poisoned)])
    assert graded(outcome, 1.0), outcome.details
    assert graded(play(env, [write("json.py", "def dumps(*a, **k):\n    return 'true'\n"
                                   "def loads(*a, **k):\n    return []\n")]), 0.0)


def test_fix_tests_sitecustomize_and_pth_files_never_run(no_leaks):
    env = FixTests()
    poisoned = "import os\nos._exit(0)\n"
    outcome = play(env, env.reference_solution(SEED) + [
        write("sitecustomize.py", poisoned), write("usercustomize.py", poisoned),
        write("evil.pth", "import os; os._exit(0)\n")])
    assert graded(outcome, 1.0), outcome.details


@pytest.mark.parametrize("seed", range(20))
def test_fix_tests_every_seed_has_six_failing_cases_per_function(seed):
    cases = hidden_cases(seed)
    assert [c["id"] for c in cases] == [f"{f}-{i}" for f in FUNCTIONS for i in range(6)]


def test_fix_tests_expected_values_never_reach_the_nested_sandbox(tmp_path):
    # LEAK-STACK-01: what crosses into the nested sandbox is the argv and stdin of one
    # ctx.run; a fake context records them.
    env = FixTests()
    (tmp_path / "cases.json").write_text(env.hidden_files(SEED)["cases.json"])
    sent = []

    class Recorder:
        hidden = tmp_path

        def run(self, argv, *, stdin, **limits):
            sent.append((argv, stdin))
            return ExecResult(0, None, b"", b"", False, False, False, False, 0.1, 0.1, None)

    assert env.grade(Recorder()).reward == 0.0
    [(argv, stdin)] = sent
    assert all(set(case) == {"id", "calls"} for case in json.loads(stdin))
    assert not any("expected" in arg for arg in argv)


# --- FixTestsPytest: on a Debian image (slow: mmdebstrap builds it once, the store keeps it)

def test_fix_tests_pytest_declares_its_debian_image_for_the_agent_and_the_grader():
    env = FixTestsPytest()
    assert (env.image, env.grader_image) == ("debian:bookworm+python3-pytest", None)


def test_fix_tests_pytest_expected_values_never_reach_the_nested_sandbox(tmp_path):
    env = FixTestsPytest()
    (tmp_path / "cases.json").write_text(env.hidden_files(SEED)["cases.json"])
    sent = []

    class Recorder:
        hidden = tmp_path

        def run(self, argv, *, files, **limits):
            sent.append((argv, files, limits))
            return ExecResult(0, None, b"", b"", False, False, False, False, 0.1, 0.1, None)

    assert env.grade(Recorder()).reward == 0.0
    [(argv, files, limits)] = sent
    assert all(set(case) == {"id", "calls"} for case in json.loads(files["cases.json"]))
    assert not any("expected" in text for text in [*argv, *files.values()])
    assert "--noconftest" in argv and limits["env"] == {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.mark.slow
def test_fix_tests_pytest_the_reference_solution_scores_1(debian_store, no_leaks):
    env = FixTestsPytest()
    outcome = play(env, env.reference_solution(SEED))
    assert graded(outcome, 1.0), outcome.details


@pytest.mark.slow
def test_fix_tests_pytest_doing_nothing_scores_0(debian_store, no_leaks):
    assert graded(play(FixTestsPytest(), []), 0.0)


@pytest.mark.slow
def test_fix_tests_pytest_the_visible_tests_run_under_the_images_pytest(debian_store, no_leaks):
    env = FixTestsPytest()
    with Episode(env, seed=SEED) as ep:
        ep.reset()
        assert "3 failed, 8 passed" in ep.exec("python3 -m pytest -q tests").text
        for command in env.reference_solution(SEED):
            ep.exec(command)
        assert "11 passed" in ep.exec("python3 -m pytest -q tests").text


@pytest.mark.slow
def test_fix_tests_pytest_a_conftest_pytest_ini_and_addopts_that_report_passed_change_nothing(
        debian_store, no_leaks):
    conftest = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
                "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
                "    outcome.get_result().outcome = 'passed'\n")
    outcome = play(FixTestsPytest(), [
        write("conftest.py", conftest), write("tests/conftest.py", conftest),
        write("pytest.ini", "[pytest]\naddopts = -p conftest --collect-only\n"),
        "echo 'export PYTEST_ADDOPTS=--collect-only' >> ~/.bashrc"])
    assert graded(outcome, 0.0), outcome.details


@pytest.mark.slow
def test_fix_tests_pytest_os_exit_in_one_function_loses_the_cases_from_there_on(debian_store,
                                                                               no_leaks):
    # One pytest process for all cases: an exit ends the run, and the cases run so far count.
    env = FixTestsPytest()
    outcome = play(env, env.reference_solution(SEED) + [
        "sed -i 's/^def covers(intervals, x):$/&\\n    import os; os._exit(0)/' "
        "intervals/core.py"])
    assert outcome.reason == "graded" and outcome.reward == 0.6, outcome.details
    assert {c.split("-")[0] for c in outcome.details["failed"]} == {"covers", "clip"}


@pytest.mark.slow
def test_fix_tests_pytest_always_equal_return_values_score_0(debian_store, no_leaks):
    always = ("class Anything:\n    def __eq__(self, other):\n        return True\n")
    always += "".join(f"def {f}(*args):\n    return Anything()\n" for f in FUNCTIONS)
    assert graded(play(FixTestsPytest(), [write("intervals/core.py", always)]), 0.0)
