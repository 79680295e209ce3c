"""Episodes as a trainer uses them: reset -> tools -> finish -> Outcome, sync and async."""
from __future__ import annotations

import asyncio
import json
import numbers
import threading
import time

import psutil
import pytest

from conftest import child_inits, karotte_cgroups
from envs.basic import Addition, Doubler
from envs.broken import (CrashingGrader, GraderCannotStart, LargeMessages, SlowGrader,
                         TightScanLimits, TinyOutput)
from envs.records import FractionReward, NanDetails, OneSecondCommands
from karotte import episode, grading, sandbox
from karotte.environment import File
from karotte.episode import AsyncEpisode, Episode, set_concurrency
from karotte.errors import SandboxClosed
from karotte.limiter import Limiter


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


def sandboxes() -> int:
    """Sandboxes this process holds (the agent's, a grader's): its karotte-init children.
    Not their children, which bear init's name from fork to exec."""
    held = 0
    for child in psutil.Process().children():
        try:
            held += child.name() == "karotte-init"
        except psutil.NoSuchProcess:
            pass
    return held


async def most_sandboxes_at_once(*episodes: AsyncEpisode) -> int:
    """Plays each episode (reset, a 0.4 s command, finish) together, and returns the most
    sandboxes this process held at once, sampled every 5 ms meanwhile."""
    async def play_one(ep: AsyncEpisode) -> None:
        async with ep:
            await ep.reset()
            await ep.exec("sleep 0.4")
            await ep.finish()

    seen = 0
    games = asyncio.gather(*(play_one(ep) for ep in episodes))
    while not games.done():
        seen = max(seen, sandboxes())
        await asyncio.sleep(0.005)
    await games
    return seen


def test_async_episodes_sharing_a_limiter_of_one_never_hold_sandboxes_at_once(no_leaks):
    one = Limiter(1)
    episodes = [AsyncEpisode(Addition(), seed=seed, limiter=one) for seed in range(3)]
    assert asyncio.run(most_sandboxes_at_once(*episodes)) == 1


def test_a_limiter_given_to_some_episodes_leaves_the_default_to_the_others(no_leaks):
    one = Limiter(1)
    limited = [AsyncEpisode(Addition(), seed=seed, limiter=one) for seed in range(2)]
    free = [AsyncEpisode(Addition(), seed=seed) for seed in range(2, 4)]
    assert asyncio.run(most_sandboxes_at_once(*limited, *free)) == 3


def test_a_limiter_that_is_not_a_limiter_is_refused():
    with pytest.raises(TypeError, match="limiter must be a karotte.limiter.Limiter"):
        AsyncEpisode(Addition(), limiter=asyncio.Semaphore(1))
    with pytest.raises(ValueError, match="at least 1"):
        Limiter(0)


def test_large_grader_messages_both_ways_arrive_whole(no_leaks, monkeypatch):
    reports = []

    def recorded(*args):
        reports.append(grading.run_grader(*args))
        return reports[-1]

    monkeypatch.setattr(episode, "run_grader", recorded)
    env = LargeMessages()
    outcome = play(env, 2, env.reference_solution(2))
    assert (outcome.reward, outcome.reason) == (1.0, "graded")
    (report,) = reports
    assert report.details["counted"] == "1000000" and len(report.details["blob"]) == 500_000


def test_REC_BOUND_01_the_outcome_keeps_the_graders_details_up_to_64_KiB_of_json(no_leaks):
    env = LargeMessages()
    outcome = play(env, 2, env.reference_solution(2))
    assert outcome.details == {"counted": "1000000"}  # the 500 KB "blob" does not fit
    assert outcome.details_dropped == 1


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


# --------------------------------------------------------------------------- one episode


def test_reset_twice_is_refused_and_leaves_nothing_behind(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        inits, cgroups = child_inits(), karotte_cgroups()
        with pytest.raises(RuntimeError, match="reset\\(\\) was already called.*new Episode"):
            ep.reset()
        assert (child_inits(), karotte_cgroups()) == (inits, cgroups)  # no second sandbox
        assert ep.exec("echo still here").text == "still here\n"


@pytest.mark.parametrize("end", ["finish", "give_up"])
def test_reset_after_the_end_says_the_episode_is_over(no_leaks, end):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        getattr(ep, end)()
        with pytest.raises(SandboxClosed, match="the episode is over.*make a new Episode"):
            ep.reset()


def test_async_reset_twice_or_after_the_end_is_refused(no_leaks):
    async def main():
        async with AsyncEpisode(Addition(), seed=0) as ep:
            await ep.reset()
            with pytest.raises(RuntimeError, match="already called"):
                await ep.reset()
            await ep.give_up()
            with pytest.raises(SandboxClosed, match="the episode is over"):
                await ep.reset()

    asyncio.run(main())


def test_give_up_twice_returns_the_same_outcome(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        first = ep.give_up()
        assert ep.give_up() is first and ep.finish() is first
        assert [r.tool for r in first.log] == ["give_up"]


def test_tools_before_reset_say_to_call_reset(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        with pytest.raises(SandboxClosed, match="call reset\\(\\) first"):
            ep.exec("true")
        with pytest.raises(SandboxClosed, match="call reset\\(\\) first"):
            ep.finish()


def test_tools_after_close_say_the_sandbox_was_closed(no_leaks):
    ep = Episode(Addition(), seed=0)
    ep.reset()
    ep.close()
    with pytest.raises(SandboxClosed, match="closed before it finished"):
        ep.exec("true")


# --------------------------------------------------------------------------- the outcome


def test_the_outcome_names_the_environment_and_the_trainers_seed(no_leaks):
    with Episode(Addition(), seed=12) as ep:
        ep.reset()
        outcome = ep.finish()
    assert (outcome.env, outcome.seed) == ("envs.basic:Addition", 12)
    assert ep._flow.env_seed != 12  # what the environment saw is not what the record keeps


def test_to_dict_is_strict_json_of_every_field(no_leaks):
    outcome = play(Addition(), 3, ["ln -s numbers.txt link; echo 1 > answer.txt"])
    record = json.loads(json.dumps(outcome.to_dict(), allow_nan=False))
    assert set(record) == {"env", "seed", "reward", "reason", "violations", "violations_dropped",
                           "infra_error", "timings", "log", "details", "details_dropped",
                           "grader_log", "changed_paths", "deleted_paths", "egress",
                           "grader_egress", "egress_ip"}
    assert (record["changed_paths"], record["deleted_paths"]) == (0, 0)  # no image, no diff
    assert record["violations"] == [{"path": "link", "kind": "symlink", "rule": (
        "D3 file types: only regular files and directories"), "detail": "symlink not allowed"}]
    assert record["log"][0]["tool"] == "bash" and record["log"][0]["exit_code"] == 0
    assert record["timings"]["total"] == outcome.timings.total


def test_a_nan_in_the_graders_details_is_text_in_the_outcome(no_leaks):
    outcome = play(NanDetails(), 3, [])
    assert outcome.details == {"ratio": "NaN", "speedup": "Infinity", "runs": 3}
    json.dumps(outcome.to_dict(), allow_nan=False)


def test_a_reward_of_any_real_number_type_is_graded_as_a_float(no_leaks):
    outcome = play(FractionReward(), 3, [])
    assert (outcome.reward, outcome.reason) == (0.5, "graded")
    assert type(outcome.reward) is float


# --------------------------------------------------------------------------- budgets


def test_the_call_past_max_turns_is_not_run_and_ends_the_episode(no_leaks):
    with Episode(Addition(), seed=0, max_turns=2) as ep:
        ep.reset()
        ep.exec("read a b < numbers.txt; echo $((a + b)) > answer.txt")
        ep.read_file("answer.txt")
        r = ep.exec("touch ran")
        assert (r.exit_code, ep.done) == (None, True)
        assert "budget of 2 tool calls is used up; bash was not run" in r.text
        outcome = ep.finish()
    assert (outcome.reward, outcome.reason) == (0.0, "budget_exhausted")
    assert [(e.tool, e.exit_code) for e in outcome.log] == [
        ("bash", 0), ("read_file", 0), ("bash", None)]


def test_an_agent_that_stops_within_max_turns_is_graded(no_leaks):
    with Episode(Addition(), seed=0, max_turns=1) as ep:
        ep.reset()
        ep.exec("read a b < numbers.txt; echo $((a + b)) > answer.txt")
        outcome = ep.finish()
    assert (outcome.reward, outcome.reason) == (1.0, "graded")


def test_a_command_running_past_max_seconds_is_cut_at_the_budget_and_ends_the_episode(no_leaks):
    with Episode(Addition(), seed=0, max_seconds=1.0) as ep:
        ep.reset()
        t = time.monotonic()
        r = ep.exec("sleep 10")
        assert time.monotonic() - t < 5
        assert r.timed_out and "budget of 1 s is used up; the episode is over" in r.text
        assert ep.done and ep.finish().reason == "budget_exhausted"


def test_finish_after_max_seconds_is_budget_exhausted(no_leaks):
    with Episode(Addition(), seed=0, max_seconds=0.2) as ep:
        ep.reset()
        ep.exec("read a b < numbers.txt; echo $((a + b)) > answer.txt")
        time.sleep(0.3)  # the model thinks too long
        outcome = ep.finish()
    assert (outcome.reward, outcome.reason) == (0.0, "budget_exhausted")


def test_async_episodes_keep_the_budget_too(no_leaks):
    async def main():
        async with AsyncEpisode(Addition(), seed=0, max_turns=1) as ep:
            await ep.reset()
            await ep.exec("true")
            r = await ep.exec("true")
            return r, await ep.finish()

    r, outcome = asyncio.run(main())
    assert "budget of 1 tool calls is used up" in r.text
    assert outcome.reason == "budget_exhausted"


@pytest.mark.parametrize("budget", [{"max_turns": 0}, {"max_turns": 2.5}, {"max_turns": True},
                                    {"max_seconds": 0}, {"max_seconds": float("inf")},
                                    {"max_seconds": float("nan")}])
def test_a_budget_that_is_not_positive_is_refused(budget):
    with pytest.raises(ValueError, match="must be a positive"):
        Episode(Addition(), seed=0, **budget)


# --------------------------------------------------------------------------- author mistakes


def test_an_environment_class_instead_of_an_instance_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="the class Addition, not an instance.*Addition\\(\\)"):
        Episode(Addition, 1)


def test_no_environment_is_refused_when_the_episode_is_made():
    with pytest.raises(TypeError, match="needs an Environment instance.*got NoneType"):
        Episode(None)


def test_an_environment_name_that_does_not_load_is_refused_when_the_episode_is_made():
    with pytest.raises(ValueError, match="cannot load the environment 'envs.basic:Nope'"):
        Episode("envs.basic:Nope")
    with pytest.raises(ValueError, match="cannot load the environment 'no_such_module_x'"):
        Episode("no_such_module_x")


def test_a_seed_of_any_integer_type_is_taken_as_an_int():
    class Int64:  # numpy.int64 is an Integral that is not an int
        def __init__(self, value):
            self.value = value

        def __int__(self):
            return self.value

    numbers.Integral.register(Int64)
    ep = Episode(Addition(), seed=Int64(7))
    assert ep.seed == 7 and type(ep.seed) is int


@pytest.mark.parametrize("deliverables", [("/workspace/answer.txt",), ("../answer.txt",),
                                          ("out/",), ("a/./b",), ("",), "answer.txt",
                                          ("a\\b",), ("x" * 256,)])
def test_a_deliverable_that_is_not_a_plain_relative_path_is_refused_when_the_episode_is_made(
        deliverables):
    class Bad(Addition):
        pass

    Bad.deliverables = deliverables
    with pytest.raises((ValueError, TypeError), match="deliverables"):
        Episode(Bad(), seed=0)


@pytest.mark.parametrize("path", ["/etc/evil", "../evil", "emptydir/", "a//b", "./a"])
def test_a_workspace_file_path_outside_or_unclear_is_refused_at_reset(no_leaks, path):
    class Bad(Addition):
        def workspace_files(self, seed):
            return {path: "x"}

    with Episode(Bad(), seed=0) as ep:
        with pytest.raises(ValueError, match="a key of workspace_files"):
            ep.reset()
        assert child_inits() == []  # refused before any sandbox was made


def test_a_workspace_file_of_the_wrong_type_is_refused_at_reset(no_leaks):
    class Bad(Addition):
        def workspace_files(self, seed):
            return {"n.txt": 42}

    with Episode(Bad(), seed=0) as ep, pytest.raises(TypeError, match="bytes, str or File"):
        ep.reset()


def test_a_file_in_hidden_files_is_refused_at_reset(no_leaks):
    class Bad(Addition):
        def hidden_files(self, seed):
            return {"expected.txt": File("42")}

    with Episode(Bad(), seed=0) as ep, pytest.raises(
            TypeError, match="must be bytes or str, got File; File .* is for workspace_files"):
        ep.reset()


def test_a_file_mode_with_special_bits_is_refused():
    with pytest.raises(ValueError, match="0o777"):
        File("#!/bin/sh\n", 0o4755)


def test_exec_of_a_list_names_the_str_the_bash_tool_wants(no_leaks):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        with pytest.raises(TypeError, match="takes the command as one str, e.g. ep.exec\\('ls -l'\\)"):
            ep.exec(["ls"])


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_timeout_that_is_not_positive_finite_seconds_is_refused(no_leaks, timeout):
    with Episode(Addition(), seed=0) as ep:
        ep.reset()
        with pytest.raises(ValueError, match="positive finite seconds.*limit of 20 s"):
            ep.exec("true", timeout=timeout)
        assert ep.exec("echo ok", timeout=20).text == "ok\n"


def test_a_timeout_over_the_environments_limit_is_cut_to_it(no_leaks):
    # 1e9 s overflowed poll() once the command had started; the author's limit is the most
    # a trainer gets.
    with Episode(OneSecondCommands(), seed=0) as ep:
        ep.reset()
        t = time.monotonic()
        r = ep.exec("sleep 30", timeout=1e9)
        assert time.monotonic() - t < 10
        assert r.timed_out and "timed out after 1 s" in r.text


# --------------------------------------------------------------------------- the event loop


def test_async_blocking_work_runs_off_the_event_loop_thread(no_leaks, monkeypatch):
    # The environment's methods, the spawn, the cgroup's counters and the teardown block;
    # on the loop's thread, 100 episodes stalled it by up to a second
    # (scripts/bench_loop_stall.py).
    threads: dict[str, set[str]] = {}

    def note(what):
        threads.setdefault(what, set()).add(threading.current_thread().name)

    class Spy(Addition):
        def prompt(self, seed):
            note("prompt")
            return super().prompt(seed)

        def workspace_files(self, seed):
            note("workspace_files")
            return super().workspace_files(seed)

        def hidden_files(self, seed):
            note("hidden_files")
            return super().hidden_files(seed)

    for name in ("start", "begin_exec", "end_exec", "destroy"):
        def spy(*args, _real=getattr(sandbox._Core, name), _name=name, **kwargs):
            note(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(sandbox._Core, name, spy)

    async def main():
        async with AsyncEpisode(Spy(), seed=0) as ep:
            await ep.reset()
            await ep.exec("true")
            await ep.give_up()
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert set(threads) == {"prompt", "workspace_files", "hidden_files", "start",
                            "begin_exec", "end_exec", "destroy"}
    assert all(loop_thread not in names for names in threads.values()), threads


def test_an_async_reset_cancelled_at_any_moment_leaves_nothing_behind(no_leaks):
    async def main():
        for delay in (0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05):
            ep = AsyncEpisode(Addition(), seed=0)
            task = asyncio.ensure_future(ep.reset())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            await ep.close()

    asyncio.run(main())  # its end waits for the worker threads, and what they undo
