"""Episodes as a trainer uses them: reset -> tools -> finish -> Outcome, sync and async."""
from __future__ import annotations

import asyncio
import time

import pytest

from envs.basic import Addition, Doubler
from envs.broken import (CrashingGrader, GraderCannotStart, LargeMessages, SlowGrader,
                         TightScanLimits, TinyOutput)
from karotte.episode import AsyncEpisode, Episode, set_concurrency
from karotte.errors import SandboxClosed


def play(env, seed, commands):
    with Episode(env, seed=seed) as ep:
        ep.reset()
        for command in commands:
            ep.exec(command)
        return ep.finish()


@pytest.mark.parametrize("env", [Addition(), Doubler()], ids=["Addition", "Doubler"])
def test_the_reference_solution_scores_full_marks(no_leaks, env):
    outcome = play(env, 5, env.reference_solution(5))
    assert (outcome.reward, outcome.reason, outcome.infra_error) == (1.0, "graded", None)
    assert outcome.violations == ()
    t = outcome.timings
    assert t.reset > 0 and t.grade > 0 and t.total >= t.reset + t.grade


@pytest.mark.parametrize("env", [Addition(), Doubler()], ids=["Addition", "Doubler"])
def test_doing_nothing_scores_the_bottom(no_leaks, env):
    outcome = play(env, 5, [])
    assert (outcome.reward, outcome.reason, outcome.infra_error) == (0.0, "graded", None)


def test_the_prompt_and_the_files_depend_on_the_seed(no_leaks):
    env = Addition()
    with Episode(env, seed=1) as a, Episode(env, seed=2) as b:
        a.reset(), b.reset()
        assert a.read_file("numbers.txt").text != b.read_file("numbers.txt").text


def test_cd_and_export_carry_over_between_commands(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        ep.exec("mkdir -p deep/er && cd deep/er && export GREETING='hello there'")
        r = ep.exec('pwd; echo "$GREETING"')
        assert r.text == "/workspace/deep/er\nhello there\n"
        r = ep.exec("cd /tmp; exit 3")
        assert r.exit_code == 3
        assert ep.exec("pwd").text == "/tmp\n"


def test_every_command_has_a_timeout_and_the_episode_goes_on(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        t = time.monotonic()
        r = ep.exec("sleep 30", timeout=0.5)
        assert r.timed_out and "timed out" in r.text and time.monotonic() - t < 5
        assert ep.exec("echo still here").text == "still here\n"


def test_output_is_truncated_with_a_clear_marker(no_leaks):
    with Episode(TinyOutput(), seed=0) as ep:
        ep.reset()
        r = ep.exec("head -c 100000 /dev/zero | tr '\\0' x")
        assert r.truncated
        assert r.text.startswith("x" * 1000)
        assert "[karotte: output truncated, only the first 4096 bytes of stdout are shown]" in r.text


def test_file_tools_act_with_the_agents_rights_and_nothing_more(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        assert ep.write_file("notes/a.txt", "x").exit_code != 0  # no such directory
        assert ep.write_file("a.txt", "written").exit_code == 0
        assert ep.read_file("a.txt").text == "written"
        assert ep.read_file("/workspace/a.txt").text == "written"
        assert ep.write_file("/etc/passwd", "root::0:0::/:/bin/sh").exit_code != 0
        assert ep.write_file("/usr/bin/python3", "#!/bin/sh").exit_code != 0
        r = ep.read_file("/root/secret")
        assert r.exit_code != 0 and "Permission denied" in r.text
        assert [e.tool for e in ep._flow.log][-2:] == ["write_file", "read_file"]


def test_give_up_ends_the_episode_with_the_bottom_reward(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        ep.exec("echo 1 > answer.txt")
        outcome = ep.give_up()
        assert (outcome.reward, outcome.reason, outcome.infra_error) == (0.0, "gave_up", None)
        with pytest.raises(SandboxClosed):
            ep.exec("true")


def test_tools_after_finish_raise_and_finish_is_idempotent(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        first = ep.finish()
        assert ep.finish() is first
        with pytest.raises(SandboxClosed):
            ep.exec("true")


def test_a_violation_at_a_deliverable_scores_the_bottom_with_the_reason(no_leaks):
    outcome = play(Addition(), 0, ["ln -s numbers.txt answer.txt"])
    assert (outcome.reward, outcome.reason) == (0.0, "scanner_rejected_required_output")
    assert [(v.path, v.kind) for v in outcome.violations] == [("answer.txt", "symlink")]


def test_other_offending_entries_are_left_out_and_listed(no_leaks):
    outcome = play(Addition(), 0, ["read a b < numbers.txt; echo $((a + b)) > answer.txt",
                                   "mkfifo pipe; ln -s /etc/passwd link"])
    assert (outcome.reward, outcome.reason) == (1.0, "graded")
    assert sorted((v.path, v.kind) for v in outcome.violations) == [
        ("link", "symlink"), ("pipe", "fifo")]


def test_a_grader_crash_on_the_submission_is_reward_zero_not_an_infra_error(no_leaks):
    outcome = play(CrashingGrader(), 0, ["echo hello > answer.txt"])
    assert (outcome.reward, outcome.reason, outcome.infra_error) == (0.0, "grader_crashed", None)
    assert "ZeroDivisionError" in outcome.grader_log


def test_a_failure_of_the_infrastructure_is_an_infra_error_to_mask(no_leaks):
    outcome = play(GraderCannotStart(), 0, ["echo 3 > answer.txt"])
    assert outcome.infra_error and "grading failed" in outcome.infra_error
    assert outcome.reason == "infra_error"


def test_async_episodes_share_one_event_loop_under_a_concurrency_limit(no_leaks):
    env = Addition()

    async def one(seed: int) -> float:
        async with AsyncEpisode(env, seed=seed) as ep:
            await ep.reset()
            await ep.exec("sleep 0.3")
            for command in env.reference_solution(seed):
                await ep.exec(command)
            return (await ep.finish()).reward

    async def main():
        set_concurrency(4)
        try:
            t = time.monotonic()
            rewards = await asyncio.gather(*(one(seed) for seed in range(12)))
            return rewards, time.monotonic() - t
        finally:
            set_concurrency(64)

    rewards, elapsed = asyncio.run(main())
    assert rewards == [1.0] * 12
    assert elapsed >= 3 * 0.3, "more than 4 episodes held a sandbox at once"


def test_large_grader_messages_both_ways_arrive_whole(no_leaks):
    env = LargeMessages()
    outcome = play(env, 2, env.reference_solution(2))
    assert (outcome.reward, outcome.reason) == (1.0, "graded")
    assert outcome.details["counted"] == "1000000" and len(outcome.details["blob"]) == 500_000


def test_an_author_can_tighten_the_scan_limits(no_leaks):
    outcome = play(TightScanLimits(), 0, ["head -c 100 /dev/zero | tr '\\0' 1 > answer.txt"])
    assert (outcome.reward, outcome.reason) == (0.0, "scanner_rejected_required_output")
    assert [(v.path, v.kind) for v in outcome.violations] == [("answer.txt", "file-too-large")]
    env = TightScanLimits()
    assert play(env, 0, env.reference_solution(0)).reward == 1.0


def test_async_finishes_grade_as_many_at_once_as_the_concurrency_allows(no_leaks):
    # asyncio's default executor has min(32, cpus + 4) threads; grading must not be
    # capped by it when the trainer allows more episodes at once.
    env = SlowGrader()
    n = 12  # twice the default executor's 6 threads on a 2-core machine

    async def one(seed: int) -> tuple[float, float]:
        async with AsyncEpisode(env, seed=seed) as ep:
            await ep.reset()
            for command in env.reference_solution(seed):
                await ep.exec(command)
            outcome = await ep.finish()
            return outcome.reward, outcome.details["started"]

    async def main():
        set_concurrency(n)
        try:
            return await asyncio.gather(*(one(seed) for seed in range(n)))
        finally:
            set_concurrency(64)

    rewards, starts = zip(*asyncio.run(main()))
    assert rewards == (1.0,) * n
    # Every grader started before the first one finished: all n ran at once. (Capped at
    # 6, the seventh would start only when the first was done, env.seconds later.)
    spread = max(starts) - min(starts)
    assert spread < env.seconds, f"the {n} graders did not all overlap: starts spread {spread:.1f} s"
