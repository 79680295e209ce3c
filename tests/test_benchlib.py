"""scripts/benchlib.py's PhaseTimer: a phase whose name is gone, or that no call reached,
stops the benchmark with the phase's name, so that a name Karotte moves cannot leave a
phase timing nothing."""
from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))

import benchlib  # noqa: E402


@pytest.fixture
def timed_module(monkeypatch):
    mod = types.ModuleType("benchlib_target")

    def step():
        return "stepped"

    class Worker:
        def work(self):
            return mod.step()

    mod.step, mod.Worker = step, Worker
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_phases_that_ran_are_timed_and_the_originals_restored(timed_module):
    original, original_work = timed_module.step, vars(timed_module.Worker)["work"]
    table = {"step": ("benchlib_target", "step"), "work": ("benchlib_target", "Worker.work")}
    with benchlib.PhaseTimer(table) as timer:
        assert timed_module.Worker().work() == "stepped"
        events = timer.take()
    assert [label for label, _, _ in events] == ["step", "work"]
    assert all(t0 <= t1 for _, t0, t1 in events)
    assert timed_module.step is original and vars(timed_module.Worker)["work"] is original_work
    assert timer.calls == {"step": 1, "work": 1}


def test_a_name_that_is_gone_raises_with_the_phase_name(timed_module):
    table = {"step": ("benchlib_target", "step"),
             "create: moved away": ("benchlib_target", "Worker.gone")}
    original = timed_module.step
    with pytest.raises(LookupError, match="'create: moved away'.*benchlib_target.Worker.gone"):
        with benchlib.PhaseTimer(table):
            pass
    assert timed_module.step is original  # what was wrapped before the failure is undone


def test_a_phase_that_no_call_reached_raises_with_the_phase_name(timed_module):
    # The caller looks the name up elsewhere (a moved function): the wrapper sees nothing.
    table = {"work": ("benchlib_target", "Worker.work"),
             "destroy: never called": ("benchlib_target", "step")}
    timed_module.Worker.work = lambda self: "done without step"
    with pytest.raises(RuntimeError, match="'destroy: never called'"):
        with benchlib.PhaseTimer(table):
            timed_module.Worker().work()


@pytest.mark.parametrize("table", [benchlib.SANDBOX_PHASES, benchlib.EPISODE_PHASES,
                                   benchlib.IMAGE_SANDBOX_PHASES,
                                   *benchlib.SANDBOX_CGROUP_PHASES.values()])
def test_every_name_in_the_tables_exists_in_karotte(table):
    # Every name resolves (no LookupError); with no call made, the exit says so.
    with pytest.raises(RuntimeError, match="no call reached"):
        with benchlib.PhaseTimer(table):
            pass
