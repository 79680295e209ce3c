"""The battery of `karotte check` and `karotte redteam`, judged on small environments:
what an attack acts on, and what makes a verdict."""
from __future__ import annotations

from envs.authoring import CrashesOnNothing, ReferenceInSubdir

from karotte.battery import pick_attacks, redteam


def verdicts(env, names):
    report = redteam(env, attacks=pick_attacks(env, 1, names))
    return {r.name: r for r in report.results}


def test_attacks_on_the_reference_start_in_the_workspace_whatever_directory_it_left(no_leaks):
    # The reference ends in /workspace/work: an attack that ran there would change
    # nothing of answer.txt, and the untouched right answer would be a false FAIL.
    results = verdicts(ReferenceInSubdir(), ["hardlink:answer.txt", "setuid:answer.txt",
                                             "rewrite-after-finish"])
    assert all(r.passed for r in results.values()), {n: r.why for n, r in results.items()}
    assert "answer.txt: hardlink" in results["hardlink:answer.txt"].violations
    assert "answer.txt: setuid" in results["setuid:answer.txt"].violations
    assert (results["rewrite-after-finish"].reward, results["rewrite-after-finish"].reason) == (
        0.0, "graded")


def test_a_null_agent_whose_grader_crashed_fails_the_environment(no_leaks):
    # Every attack would crash the same grader and "pass" at the bottom reward.
    [null, _] = redteam(CrashesOnNothing(), attacks=[]).results
    assert (null.name, null.reason, null.passed) == ("null-agent", "grader_crashed", False)
    assert "did not grade an empty workspace (grader_crashed)" in null.why
