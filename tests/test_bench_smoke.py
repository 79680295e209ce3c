"""scripts/bench_sandbox.py --quick: every case reports numbers, and a peer that is not
on the machine is reported as skipped with a reason, never with a number.

A smoke run, not a measurement: nothing here asserts how fast anything is.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import assert_measured, needs_sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_sandbox.py")
CASES = ("lifecycle", "exec", "big_parent", "density", "phases")
PEERS = {"bwrap": "bwrap", "unshare": "unshare (floor)", "runc": "runc"}


pytestmark = needs_sandbox()


def _bench(out_dir, *args: str, env: dict | None = None) -> tuple[dict, str]:
    out = out_dir / "bench.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--quiet", "--json", str(out),
                           *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str]:
    return _bench(tmp_path_factory.mktemp("bench"))


def _series(result: dict) -> list[dict]:
    found = []
    for name in ("lifecycle", "exec", "big_parent", "density"):
        found += result["cases"][name]["series"]
    return found


def _assert_skipped_with_reason(series: dict) -> None:
    assert series["status"] == "skipped"
    assert isinstance(series["reason"], str) and series["reason"].strip()
    assert "stats" not in series and "samples_ns" not in series


def test_every_case_is_in_the_json(quick):
    result, _ = quick
    assert set(result["cases"]) == set(CASES)
    for fact in ("date", "kernel", "cpu_model", "cores", "mem_total_bytes"):
        assert result["machine"][fact], fact


def test_every_series_has_positive_numbers_or_says_why_it_has_none(quick):
    result, _ = quick
    for series in _series(result):
        if series["status"] == "skipped":
            _assert_skipped_with_reason(series)
        else:
            assert_measured(series)


def test_karotte_is_measured_in_every_case(quick):
    result, _ = quick
    names = [s["name"] for s in _series(result) if s["status"] == "ok"]
    assert "karotte" in names
    assert any(n.startswith("karotte exec") for n in names)
    assert any(n.startswith("create+destroy") for n in names)
    assert any(n.startswith("create+first exec") for n in names)


def test_a_peer_on_the_machine_is_measured_or_skipped_with_the_reason_it_failed(quick):
    result, _ = quick
    by_name = {s["name"]: s for s in result["cases"]["lifecycle"]["series"]}
    for tool, name in PEERS.items():
        series = by_name[name]
        if shutil.which(tool) is None or series["status"] == "skipped":
            _assert_skipped_with_reason(series)
        else:
            assert_measured(series)


def test_big_parent_reports_how_much_the_parent_held(quick):
    result, _ = quick
    case = result["cases"]["big_parent"]
    assert case["facts"]["rss_growth_bytes"] >= 0.95 * case["facts"]["resident_block_bytes"]
    assert all(r is not None and r > 0 for r in case["big_over_small"].values())


def test_density_holds_every_sandbox_asked_for_and_leaves_nothing(quick):
    result, _ = quick
    case = result["cases"]["density"]
    assert case["held"] == case["target"] and case["stopped_by"] is None
    assert case["live_check_exec_ok"] is True
    assert case["clean"], case["after_close"]
    assert case["per_sandbox_bytes"]["driver_fds"] > 0
    assert case["per_sandbox_bytes"]["cgroup_memory_usage_mean"] > 0


def test_phases_time_the_steps_of_create_exec_and_destroy(quick):
    result, _ = quick
    case = result["cases"]["phases"]
    assert "skipped" not in case, case.get("skipped")
    for phase in ("create: total", "first exec: total", "destroy: total"):
        assert case["phases"][phase]["median_ms"] > 0


def test_summary_table_has_the_machine_and_the_goals(quick):
    result, stdout = quick
    assert result["summary_text"] == stdout
    assert result["machine"]["kernel"] in stdout
    assert "## Goals" in stdout
    assert len(result["goals"]) >= 6
    for goal in result["goals"]:
        assert goal["met"] in (True, False, None)


def test_a_peer_missing_from_the_machine_is_skipped_with_a_reason_not_a_number(tmp_path):
    # A PATH that offers every peer but bwrap: to the benchmark, bwrap is not installed.
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("unshare", "runc"):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), tools / tool)
    env = dict(os.environ, PATH=str(tools))
    result, stdout = _bench(tmp_path, "--cases", "lifecycle", env=env)

    series = {s["name"]: s for s in result["cases"]["lifecycle"]["series"]}
    _assert_skipped_with_reason(series["bwrap"])
    assert "bwrap" in series["bwrap"]["reason"]
    assert result["cases"]["lifecycle"]["karotte_over"]["bwrap"] is None
    goal = next(g for g in result["goals"] if "bwrap" in g["name"])
    assert goal["met"] is None
    assert "skipped" in stdout
    assert_measured(series["karotte"])
