"""The battery of `karotte check` and `karotte redteam`, judged on small environments:
what an attack acts on, and what makes a verdict."""
from __future__ import annotations

from envs.authoring import CrashesOnNothing, ReferenceInSubdir, TrustsExitStatus

from karotte.battery import attacks_for, pick_attacks, redteam


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
    [null] = [r for r in redteam(CrashesOnNothing(), attacks=[]).results
              if r.name == "null-agent"]
    assert (null.name, null.reason, null.passed) == ("null-agent", "grader_crashed", False)
    assert "did not grade an empty workspace (grader_crashed)" in null.why


def test_the_files_inside_a_directory_deliverable_are_attacked_and_a_hole_in_one_is_found(
        no_leaks):
    # pkg/ is a package the reference writes; os._exit(0) in one of its modules passes a
    # grader that trusts exit 0. Attacked only as a whole, the package never showed it.
    env = TrustsExitStatus()
    names = {a.name for a in attacks_for(env, 1)}
    assert {"exit0:pkg/__init__.py", "exit0:pkg/double.py", "empty:pkg/double.py",
            "symlink-hidden:pkg/__init__.py", "fifo:pkg/__init__.py"} <= names
    results = verdicts(env, ["exit0:pkg/double.py", "symlink-hidden:pkg/__init__.py"])
    hole = results["exit0:pkg/double.py"]
    assert not hole.passed and "more than the null agent" in hole.why
    held = results["symlink-hidden:pkg/__init__.py"]
    assert held.passed and held.violations == ("pkg/__init__.py: symlink",)


def test_an_absolute_deliverable_of_an_image_is_attacked_where_it_is(monkeypatch):
    # On an image a deliverable may be a path of the agent's diff (/etc/issue): attacks on
    # /workspace/etc/issue would test nothing of what the grader reads.
    from envs.diff import DiffReports
    monkeypatch.setattr(DiffReports, "image", "dir:/srv/tree")
    monkeypatch.setattr(DiffReports, "deliverables", ("/etc/issue",))
    at_it = [a for a in attacks_for(DiffReports(), 1) if a.name.endswith(":/etc/issue")]
    assert {"symlink-hidden:/etc/issue", "fifo:/etc/issue"} <= {a.name for a in at_it}
    commands = " ".join(c for a in at_it for c in a.commands)
    assert "/etc/issue" in commands and "/workspace/etc" not in commands
