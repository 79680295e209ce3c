"""scripts/bench_images.py --quick: a 30 MiB image made by umoci and skopeo, every series
of every case with positive numbers, the summary with the machine, the image and the
goals, and nothing left on tmpfs afterwards, also when the benchmark is killed.

A smoke run, not a measurement: nothing here asserts how fast anything is.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_measured

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_images.py")
CASES = ("import", "phases", "profile")
TMPFS = "/dev/shm"
PREFIX = "karotte-bench-images-"
SERIES = ("karotte import, docker-archive", "tar -x of the same layers (floor)",
          "karotte repeat import (cache hit)", "karotte import, OCI layout (gzip layers)",
          "gzip -dc | tar -x of the gzip layers (floor)")

pytestmark = [
    pytest.mark.skipif(not os.path.isdir(TMPFS), reason=f"needs {TMPFS} (a tmpfs)"),
    *(pytest.mark.skipif(shutil.which(tool) is None,
                         reason=f"needs {tool} (scripts/setup installs it)")
      for tool in ("umoci", "skopeo", "tar", "gzip")),
]


def _left(pid: int) -> list[str]:
    return glob.glob(os.path.join(TMPFS, f"{PREFIX}{pid}-*"))


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str, int]:
    out = tmp_path_factory.mktemp("bench") / "images.json"
    proc = subprocess.Popen([sys.executable, SCRIPT, "--quick", "--quiet", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    return json.loads(out.read_text()), stdout, proc.pid


def test_every_case_is_in_the_json_with_the_machine(quick):
    result, _, _ = quick
    assert set(result["cases"]) == set(CASES)
    for fact in ("date", "kernel", "cpu_model", "cores", "mem_total_bytes"):
        assert result["machine"][fact], fact


def test_the_image_is_real_files_in_three_layers_of_a_docker_archive(quick):
    result, _, _ = quick
    image = result["image"]
    assert image["fs_type"] == "tmpfs"
    assert image["tree_files"] > 1000 and image["tree_symlinks"] > 0
    assert image["tree_bytes"] > 20 << 20
    layers = image["layers"]
    assert len(layers) == 3
    assert all(layer["files"] > 0 and layer["tar_bytes"] > 0 and layer["gzip_bytes"] > 0
               for layer in layers)
    assert layers[1]["large"] > 0  # some files of 1 MiB or more
    assert layers[2]["rewritten"] > 0 and layers[2]["deleted"] > 0  # whiteouts
    assert all(layer["compression"] in ("tar", "gzip", "zstd") for layer in layers)


def test_every_series_of_the_import_case_has_positive_numbers(quick):
    result, _, _ = quick
    case = result["cases"]["import"]
    assert [s["name"] for s in case["series"]] == list(SERIES)
    for series in case["series"]:
        assert_measured(series)
    assert case["karotte_over_tar"] > 0 and case["karotte_gzip_over_gzip_tar"] > 0


def test_phases_time_every_step_of_an_import(quick):
    result, _, _ = quick
    phases = result["cases"]["phases"]["phases"]
    assert len(phases) >= 10
    for label, stats in phases.items():
        assert stats["median_ms"] > 0, label
    assert phases["tree: each layer: extract (apply_layer)"]["median_ms"] <= \
        phases["import: whole (Store.import_image)"]["median_ms"]


def test_the_profile_names_where_the_time_goes(quick):
    result, _, _ = quick
    case = result["cases"]["profile"]
    assert len(case["top"]) >= 10
    assert all(t["own_seconds"] > 0 and t["calls"] > 0 for t in case["top"])
    shares = sum(g["share"] for g in case["groups"])
    assert 0.99 < shares < 1.01
    assert any(t["function"].startswith(("<method 'update' of '_hashlib",  # or it runs in C:
                                         "<built-in method karotte._native.karotte_extract_run"))
               for t in case["top"])


def test_summary_has_the_machine_the_rows_and_the_goals(quick):
    result, stdout, _ = quick
    assert result["summary_text"] == stdout
    assert result["machine"]["kernel"] in stdout
    assert "bench_images.py --quick" in stdout
    for name in SERIES:
        assert f"| {name} |" in stdout, name
    assert "## Goals" in stdout
    assert [g["name"] for g in result["goals"]] == [
        "import of the docker-archive within 1.5x of tar -x of its layers",
        "repeat import (cache hit)"]
    for goal in result["goals"]:
        assert goal["met"] in (True, False)
        assert ("NOT MET" if not goal["met"] else "| met |") in stdout


def test_nothing_is_left_on_tmpfs_after_the_run(quick):
    _, _, pid = quick
    assert _left(pid) == []


def test_a_benchmark_killed_with_sigterm_removes_what_it_made():
    proc = subprocess.Popen([sys.executable, SCRIPT, "--quick", "--quiet", "--cases",
                             "import"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(os.path.join(_left(proc.pid)[0], "L", "index.json")
                            if _left(proc.pid) else "") and proc.poll() is None:
            assert time.monotonic() < deadline, "the benchmark made no image in 60 s"
            time.sleep(0.05)
        time.sleep(1)  # well into the set-up: a layout, a bundle, umoci at work
        assert _left(proc.pid), "the benchmark ended before it was killed"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()
    assert _left(proc.pid) == []
