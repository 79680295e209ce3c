"""ctx.run's files, env and cwd, in real nested sandboxes: what the agent's program sees,
and what the host refuses whatever a grader sends."""
from __future__ import annotations

import os
import re

import pytest
from envs.grader_api import RAW, FractionReward, RawRunRequests, RunWithFiles

from karotte.episode import Episode
from karotte.grader_runtime import RUN_FILES_BYTES, GradeContext, GraderError, check_run

SOLUTION = "def double(x):\n    return 2 * x\n"


def graded_details(env, solution=SOLUTION):
    with Episode(env, seed=1) as ep:
        ep.reset()
        ep.write_file("solution.py", solution)
        outcome = ep.finish()
    assert (outcome.reason, outcome.infra_error) == ("graded", None), outcome.grader_log[-3000:]
    return outcome.details


def test_files_are_placed_read_only_at_tests_for_that_run_alone_with_its_env_and_cwd(no_leaks):
    details = graded_details(RunWithFiles())
    seen = details["seen"]
    assert seen["tests"] == ["data", "probe.py"] and seen["cases"] == "21", seen
    assert (seen["cwd"], seen["mode"], seen["double"]) == ("/tests", "hidden-suite", 42)
    assert seen["mount"] == ["ro"], seen  # and not the agent's: no write gets through
    assert {seen["/tests/probe.py"], seen["/tests/new.txt"]} <= {"Read-only file system",
                                                                 "Permission denied"}
    assert seen["/workspace/solution.py"] in ("Read-only file system", "Permission denied")
    assert details["tests_in_a_later_run"] == "False"


def test_the_host_refuses_run_requests_that_would_write_outside_or_hold_too_much(no_leaks):
    answers = graded_details(RawRunRequests())["answers"]
    assert set(answers) == set(RAW)
    assert all(answer.startswith("run failed: ") for answer in answers.values()), answers
    assert "no '..'" in answers["parent"] and "relative path" in answers["absolute"]
    assert "is a file and a directory" in answers["file-and-directory"]
    assert "LD_PRELOAD makes programs load code" in answers["loader"]
    assert "must be objects" in answers["not-a-mapping"]
    assert "cwd must be an absolute path" in answers["relative-cwd"]
    assert "5000 files for one run" in answers["too-many"]
    assert f"output_limit {1 << 40} is not within" in answers["huge-output"]
    assert not os.path.exists("/tmp/karotte-escaped")


@pytest.mark.parametrize("request_, why", [
    ({"files": {"../x": "1"}}, "no '..'"),
    ({"files": {"a/./b": "1"}}, "canonical form"),
    ({"files": {"/etc/x": "1"}}, "must be a relative path"),
    ({"files": {"a": "1", "a/b": "2"}}, "'a' is a file and a directory of 'a/b'"),
    ({"files": {"big": b"x" * (RUN_FILES_BYTES + 1)}}, f"at most {RUN_FILES_BYTES}"),
    ({"env": {"PYTHONPATH": "/workspace"}}, "PYTHONPATH makes programs load code"),
    ({"env": {"LD_PRELOAD": "/workspace/evil.so"}}, "LD_PRELOAD makes programs load code"),
    ({"env": {"PATH": "/workspace/bin:/usr/bin"}}, "PATH makes programs load code"),
    ({"env": {"JAVA_TOOL_OPTIONS": "-javaagent:/workspace/a.jar"}},
     "JAVA_TOOL_OPTIONS makes programs load code"),
    ({"env": {"GIT_EXEC_PATH": "/workspace"}}, "GIT_EXEC_PATH makes programs load code"),
    ({"env": {"HOME": "/workspace"}}, "HOME makes programs load code"),
    ({"env": {"A=B": "x"}}, "not an environment variable name"),
    ({"cwd": "tests"}, "cwd must be an absolute path"),
    ({"cwd": "/workspace/../hidden"}, "no '..'"),
], ids=["parent", "dot", "absolute", "file-and-directory", "oversized", "pythonpath",
        "ld-preload", "path", "java", "git", "home", "bad-name", "relative-cwd", "cwd-parent"])
def test_run_refuses_what_a_run_must_not_get_before_anything_is_sent(request_, why):
    ctx = GradeContext(0, channel=None)  # a request that got through would fail to send
    with pytest.raises(GraderError, match=re.escape(why)):
        ctx.run(["true"], **request_)


def test_a_code_loading_variable_passes_when_the_grader_names_it_and_harmless_ones_always():
    check_run({}, {"PYTHONPATH": "/workspace"}, "/workspace", ["PYTHONPATH"])
    check_run({}, {"PYTHONHASHSEED": "0", "KAROTTE_MODE": "x"}, "/", [])
    with pytest.raises(GraderError, match="LD_PRELOAD"):
        check_run({}, {"PYTHONPATH": "/w", "LD_PRELOAD": "/w/x.so"}, "/", ["PYTHONPATH"])


def test_a_bare_real_number_from_grade_is_the_reward(no_leaks):
    with Episode(FractionReward(), seed=1) as ep:
        ep.reset()
        outcome = ep.finish()
    assert (outcome.reward, outcome.reason) == (0.5, "graded")
