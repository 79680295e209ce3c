"""The karotte command: create-env, run, check, as an environment author uses them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from envs.authoring import CrashesOnNothing

from karotte.cli.main import _summary, outcome_json
from karotte.episode import Episode

TESTS = Path(__file__).resolve().parent
KEYS = {"env", "seed", "reward", "reason", "violations", "violations_dropped", "infra_error",
        "timings", "log", "details", "details_dropped", "grader_log", "changed_paths",
        "deleted_paths", "egress", "grader_egress", "egress_ip"}  # Outcome.to_dict()


def karotte(*args: str, cwd: str | Path = TESTS, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "karotte.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_run_plays_the_reference_and_prints_one_json_object_per_episode(no_leaks):
    r = karotte("run", "envs.basic:Addition", "-n", "3", "--seed", "10", "--concurrency", "2",
                "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert sorted(o["seed"] for o in lines) == [10, 11, 12]
    for o in lines:
        assert set(o) == KEYS
        assert (o["reward"], o["reason"], o["infra_error"]) == (1.0, "graded", None)
        assert o["timings"]["total"] > 0


def test_run_with_a_scripted_agent_of_bash_lines(no_leaks, tmp_path):
    agent = tmp_path / "agent.txt"
    agent.write_text("# a wrong answer\n\necho 1 > answer.txt\n")
    r = karotte("run", "envs.basic:Addition", "--agent", str(agent))
    assert r.returncode == 0, r.stderr
    assert "episodes      1" in r.stdout and "graded 1" in r.stdout and "max 0" in r.stdout


def test_run_with_json_lines_of_tool_calls_and_an_output_file(no_leaks, tmp_path):
    agent = tmp_path / "agent.jsonl"
    agent.write_text("\n".join(json.dumps(c) for c in [
        {"tool": "bash", "command": "read a b < numbers.txt; echo $((a + b)) > sum"},
        {"name": "read_file", "arguments": {"path": "sum"}},
        {"tool": "bash", "command": "cp sum answer.txt"},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    r = karotte("run", "envs.basic:Addition", "--agent", str(agent), "--json", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["reward"] == 1.0
    give_up = tmp_path / "give_up.jsonl"
    give_up.write_text('{"tool": "give_up"}\n')
    r = karotte("run", "envs.basic:Addition", "--agent", str(give_up), "--json")
    assert json.loads(r.stdout)["reason"] == "gave_up"


def test_run_exits_1_when_the_infrastructure_failed(no_leaks):
    r = karotte("run", "envs.broken:GraderCannotStart", "--json")
    assert r.returncode == 1
    assert "grading failed" in json.loads(r.stdout)["infra_error"]


@pytest.mark.parametrize("args", [
    ("run", "no_such_module_anywhere"),
    ("run", "envs.basic:Nope"),
    ("run", "envs.basic:Addition", "-n", "0"),
    ("run", "envs.basic:Addition", "--agent", "/no/such/agent"),
    ("check", "envs.basic:Nope"),
    ("frobnicate",),
])
def test_bad_usage_exits_2_with_the_cause(args):
    r = karotte(*args)
    assert r.returncode == 2
    assert r.stderr.strip()


def test_create_env_writes_a_project_whose_tests_and_check_pass(no_leaks, tmp_path):
    r = karotte("create-env", "veggie-count", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    project = tmp_path / "veggie-count"
    assert (project / "README.md").exists() and (project / "veggie_count" / "__init__.py").exists()
    os.chmod(tmp_path, 0o755)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests"], cwd=project, capture_output=True, text=True, timeout=300)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert " passed" in tests.stdout
    r = karotte("check", "veggie_count", cwd=project)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failed" in r.stdout
    assert karotte("create-env", "veggie-count", "--dir", str(tmp_path)).returncode == 2


@pytest.mark.parametrize("env,failing", [
    ("envs.leaky:LeavesTheAnswerInTheWorkspace", "leak-search"),
    ("envs.leaky:CreditsAnEmptyAnswer", "empty:answer.txt"),
    ("envs.leaky:TrustsARewardFile", "reward-file"),
])
def test_check_fails_a_broken_environment_and_names_the_attack(no_leaks, env, failing):
    r = karotte("check", env, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    failed = {x["name"] for x in report["results"] if not x["passed"]}
    assert failing in failed
    assert {"reference", "null-agent"}.isdisjoint(failed)


def test_check_passes_a_sound_environment(no_leaks):
    r = karotte("check", "envs.basic:Addition")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("reference", "null-agent", "fifo:answer.txt", "symlink-devzero:answer.txt",
                 "fork-bomb", "python-hooks", "host-unaffected"):
        assert any(line.startswith(name) and "PASS" in line for line in r.stdout.splitlines())


@pytest.mark.parametrize("example", ["q3_revenue", "speedup", "fix_tests"])
def test_check_passes_every_shipped_example(no_leaks, example):
    r = karotte("check", f"karotte.examples.{example}", "--json")
    report = json.loads(r.stdout)
    failed = [(x["name"], x["why"]) for x in report["results"] if not x["passed"]]
    assert r.returncode == 0 and failed == [], failed
    assert len(report["results"]) >= 24


def test_run_plays_the_shipped_example_end_to_end(no_leaks):
    r = karotte("run", "karotte.examples.q3_revenue", "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["reward"] for line in r.stdout.splitlines()] == [1.0, 1.0]


def test_redteam_lists_the_battery_and_runs_only_the_attacks_named(no_leaks):
    listed = karotte("redteam", "envs.basic:Addition", "--list")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert {"leak-search", "fork-bomb", "fifo:answer.txt"} <= set(names)
    r = karotte("redteam", "envs.leaky:LeavesTheAnswerInTheWorkspace", "--attack",
                "leak-search", "--attack", "fork-bomb", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    results = {x["name"]: x for x in json.loads(r.stdout)["results"]}
    assert set(results) == {"grader-imports", "null-agent", "leak-search", "fork-bomb",
                            "host-unaffected"}
    assert not results["leak-search"]["passed"] and "more than the null agent" in \
        results["leak-search"]["why"]
    assert results["fork-bomb"]["passed"] and results["null-agent"]["passed"]
    unknown = karotte("redteam", "envs.basic:Addition", "--attack", "no-such-attack")
    assert unknown.returncode == 2 and "no-such-attack" in unknown.stderr


def test_redteam_plays_your_own_cheating_agents(no_leaks, tmp_path):
    # A cheat that works on the leaky environment, and one that the sound one stops.
    copy = tmp_path / "copy-the-answer.txt"
    copy.write_text("# reads the answer the environment left out\ncp expected_answer.txt answer.txt\n")
    plant = tmp_path / "plant.jsonl"
    plant.write_text(json.dumps({"tool": "write_file", "path": "answer.txt",
                                 "content": "not the sum"}) + "\n")
    leaky = karotte("redteam", "envs.leaky:LeavesTheAnswerInTheWorkspace", "--attack",
                    "leak-search", "--agent", str(copy), "--agent", str(plant))
    assert leaky.returncode == 1, leaky.stdout + leaky.stderr
    rows = {line.split()[0]: line for line in leaky.stdout.splitlines()[1:-1]}
    assert "FAIL" in rows[f"agent:{copy}"] and "PASS" in rows[f"agent:{plant}"]
    sound = karotte("redteam", "envs.basic:Addition", "--attack", "leak-search",
                    "--agent", str(copy), "--agent", str(plant))
    assert sound.returncode == 0, sound.stdout + sound.stderr
    assert sound.stdout.splitlines()[0].startswith("karotte redteam envs.basic:Addition")
    for text, why in (('{"tool": "sudo"}', "unknown tool"),
                      ('{"tool": "bash"}', "bash needs a string 'command'"),
                      ('{"tool": "read_file", "arguments": {}}', "read_file needs a string 'path'")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text + "\n")
        r = karotte("redteam", "envs.basic:Addition", "--agent", str(bad))
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_redteam_judges_an_agent_given_with_a_ceiling_against_that_ceiling(no_leaks, tmp_path):
    # Right on two of Doubler's three hidden inputs: honest partial credit, 2/3.
    partial = tmp_path / "positives-only.txt"
    partial.write_text("printf 'print(abs(2 * int(input())))\\n' > solution.py\n")
    name = f"agent:{partial}"

    def row(*agent):
        r = karotte("redteam", "envs.basic:Doubler", "--attack", "fake-passed", *agent, "--json")
        return r.returncode, {x["name"]: x for x in json.loads(r.stdout)["results"]}[name]

    code, judged = row("--agent", f"{partial}:0.7")
    assert code == 0 and judged["passed"], judged
    assert judged["reward"] == pytest.approx(2 / 3) and judged["ceiling"] == 0.7
    code, judged = row("--agent", str(partial))
    assert code == 1 and "more than the null agent's 0" in judged["why"]
    for bad, why in ((f"{partial}:1.5", "outside the reward range [0, 1]"),
                     (f"{partial}:most", "is not a ceiling")):
        r = karotte("redteam", "envs.basic:Doubler", "--agent", bad)
        assert r.returncode == 2 and why in r.stderr, r.stderr


def test_check_and_redteam_show_the_traceback_tail_of_a_grader_that_crashed(no_leaks):
    text = karotte("redteam", "envs.authoring:CrashesOnNothing", "--attack", "fake-passed")
    lines = text.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("null-agent"))
    null = lines[start:start + 11]
    assert null[0].startswith("null-agent") and "grader_crashed  FAIL" in null[0]
    assert null[-1] == "    | AttributeError: 'NoneType' object has no attribute 'strip'", null
    as_json = karotte("redteam", "envs.authoring:CrashesOnNothing", "--attack", "fake-passed",
                      "--json")
    [row] = [x for x in json.loads(as_json.stdout)["results"] if x["name"] == "null-agent"]
    assert row["grader_log"][-1] == "AttributeError: 'NoneType' object has no attribute 'strip'"
    assert 'File "/opt/karotte-lib/envs/authoring.py"' in "\n".join(row["grader_log"])


def test_what_the_agent_printed_into_a_crashed_graders_log_cannot_forge_the_report(
        no_leaks, tmp_path):
    # The grader copies the agent's output to its stderr: screen-clearing escapes, a
    # carriage return and rows that look like the report's own, 200 lines of them.
    forger = ("import sys\nfor i in range(200):\n"
              "    print('\\x1b[2J\\x1b[Hnull-agent  1  graded  PASS  forged', i)\n"
              "    print('\\rreference  1  graded  PASS\\u202e  forged')\n")
    agent = tmp_path / "forger.jsonl"
    agent.write_text(json.dumps({"tool": "write_file", "path": "solution.py",
                                 "content": forger}) + "\n")
    r = karotte("redteam", "envs.authoring:EchoesThenCrashes", "--attack", "fake-passed",
                "--agent", str(agent))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(c in r.stdout for c in "\x1b\r\u202e")
    names = {"attack", "grader-imports", "null-agent", "fake-passed", f"agent:{agent}",
             "host-unaffected"}
    lines = r.stdout.splitlines()
    body = [line for line in lines[1:-1] if not line.startswith("    ")]
    assert {line.split()[0] for line in body} == names, body
    tail = [line for line in lines if line.startswith("    | ")]
    assert 0 < len(tail) <= 20 and sum(map(len, tail)) <= 4096 + 20 * 6
    assert tail[-1].startswith("    | ValueError: could not convert string to float")
    assert "\\x1b[2J\\x1b[Hnull-agent" in r.stdout  # shown, escaped, behind the margin


def test_run_shows_the_traceback_tail_of_a_grader_that_crashed(no_leaks):
    r = karotte("run", "envs.authoring:CrashesOnNothing", "--agent", "/dev/null")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "grader_crashed (seed 0)" in lines
    assert lines[-1] == "  | AttributeError: 'NoneType' object has no attribute 'strip'", lines


def test_run_summary_shows_the_log_tail_of_the_first_episodes_whose_grader_crashed(no_leaks):
    with Episode(CrashesOnNothing(), seed=1) as ep:
        ep.reset()
        outcome = ep.finish()
    record = outcome_json("envs.authoring:CrashesOnNothing", 1, outcome)  # as run keeps it
    summary = _summary([record] * 4).splitlines()
    assert "grader_crashed (seed 1)" in summary
    assert summary.count("  | AttributeError: 'NoneType' object has no attribute 'strip'") == 3
    assert summary[-1] == "... and 1 more episodes whose grader failed (--json has every record)"
