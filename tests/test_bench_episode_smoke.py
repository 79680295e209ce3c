"""scripts/bench_episode.py --quick: every case reports positive numbers, and the summary
names the machine, the command and the goals.

A smoke run, not a measurement: nothing here asserts how fast anything is.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import assert_measured, needs_sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_episode.py")
CASES = ("latency", "breakdown", "throughput", "scan")


pytestmark = needs_sandbox()


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "episode.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--quiet", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout


def _all_series(result: dict) -> list[dict]:
    cases = result["cases"]
    found = list(cases["latency"]["series"]) + list(cases["breakdown"]["commands"])
    for level in cases["throughput"]["levels"]:
        found += level["series"]
    return found + list(cases["scan"]["series"])


def test_every_case_is_in_the_json_with_the_machine(quick):
    result, _ = quick
    assert set(result["cases"]) == set(CASES)
    for fact in ("date", "kernel", "cpu_model", "cores", "mem_total_bytes"):
        assert result["machine"][fact], fact


def test_every_series_of_every_case_has_positive_numbers(quick):
    result, _ = quick
    series = _all_series(result)
    assert len(series) >= 20
    for s in series:
        assert_measured(s)


def test_latency_times_every_phase_of_both_variants(quick):
    result, _ = quick
    case = result["cases"]["latency"]
    names = {s["name"] for s in case["series"]}
    for variant in case["variants"]:
        for phase in ("reset", "exec", "kill", "scan + copy", "grade", "end to end"):
            assert f"{variant}: {phase}" in names


def test_breakdown_splits_the_grade_phase_with_positive_numbers(quick):
    result, _ = quick
    case = result["cases"]["breakdown"]
    assert case["grader_stamps"] == "ok"
    for phases in (case["phases"], case["phases_think"]):
        for label in ("grade: whole (run_grader)", "grade: grading sandbox create",
                      "grade: grade() itself", "end to end"):
            assert label in phases, label
        for label, stats in phases.items():
            assert stats["median_ms"] > 0, label


def test_throughput_reports_episodes_per_second_at_each_concurrency(quick):
    result, _ = quick
    levels = {lv["name"]: lv for lv in result["cases"]["throughput"]["levels"]}
    assert {"sync loop", "async, concurrency 1", "async, concurrency 8",
            "async, concurrency 32"} <= set(levels)
    for lv in levels.values():
        assert lv["episodes_per_second_median"] > 0
        assert lv["host_cpu_ms_per_episode"] > 0
        assert lv["gradings_at_once_peak"] >= 1


def test_scan_accepts_every_file_the_agent_made(quick):
    result, _ = quick
    case = result["cases"]["scan"]
    for layout, facts in case["facts"].items():
        assert facts["files"] > case["files"], layout  # its files and the task's
        assert facts["complete"] and facts["violations"] == [], layout
    assert case["facts"]["nested"]["dirs"] > 1000


def test_summary_has_the_machine_the_command_and_the_goals(quick):
    result, stdout = quick
    assert result["summary_text"] == stdout
    assert result["machine"]["kernel"] in stdout
    assert "bench_episode.py --quick" in stdout
    assert "## Goals" in stdout
    assert len(result["goals"]) >= 3
    for goal in result["goals"]:
        assert goal["met"] in (True, False, None)
