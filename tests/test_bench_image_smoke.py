"""scripts/bench_image_sandbox.py --quick: every series of every case measured on a Debian
image made through the public API (debian:bookworm+python3, built by mmdebstrap into a
store kept for the day), the image-only phases timed, the name the run gave the image
removed afterwards; and without an image, its series skipped with the reason.

A smoke run, not a measurement: nothing here asserts how fast anything is.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import assert_measured, needs_sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_image_sandbox.py")
CASES = ("lifecycle", "phases", "episode")
IMAGE = "debian:bookworm+python3"
NAME = "karotte-bench/image-sandbox"
VARIANTS = ("host userland", "image by reference", "image by name", "image tree as dir:")
# Kept from one run to the next, as tests/test_env_images.py keeps its store: the first
# run of a day builds the image (mmdebstrap, a minute), later ones find it.
CACHE, PREFIX = "/tmp/karotte-test-images", "store-bench-image-"
STORE = os.path.join(CACHE, f"{PREFIX}{datetime.date.today():%Y%m%d}")

pytestmark = needs_sandbox()


def _bench(out_dir, store: str, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = out_dir / "bench.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--quiet", "--json", str(out),
                           *args], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, KAROTTE_IMAGE_DIR=store))
    return proc, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def store() -> str:
    """The store holding IMAGE; skips, naming why, where it cannot be built."""
    if os.geteuid() != 0:
        pytest.skip("the image's tree is root's (mmdebstrap as root): run as root")
    from karotte import images
    from karotte.errors import KarotteError
    try:
        images.Store(STORE).import_image(IMAGE)
    except KarotteError as exc:
        pytest.skip(f"{IMAGE} cannot be built here: {exc}")
    # Stores of days before yesterday's (a run that started yesterday may still use its).
    yesterday = f"{PREFIX}{datetime.date.today() - datetime.timedelta(days=1):%Y%m%d}"
    for old in glob.glob(os.path.join(CACHE, PREFIX + "*")):
        if os.path.basename(old) < yesterday:
            shutil.rmtree(old, ignore_errors=True)
    return STORE


@pytest.fixture(scope="module")
def quick(store, tmp_path_factory) -> tuple[dict, str]:
    proc, result = _bench(tmp_path_factory.mktemp("bench"), store)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return result, proc.stdout


def test_every_case_is_in_the_json_with_the_machine_and_the_image(quick):
    result, _ = quick
    assert set(result["cases"]) == set(CASES)
    for fact in ("date", "kernel", "cpu_model", "cores", "mem_total_bytes"):
        assert result["machine"][fact], fact
    image = result["image"]
    assert image["ref"] == IMAGE and image["name"] == NAME
    assert image["tree"].startswith(STORE + "/trees/") and image["size"] > 50 << 20
    assert image["get_seconds"] > 0


def test_every_lifecycle_series_is_measured_with_its_ratio_to_the_host(quick):
    result, _ = quick
    case = result["cases"]["lifecycle"]
    assert [s["name"] for s in case["series"]] == list(VARIANTS)
    for series in case["series"]:
        assert_measured(series)
    assert set(case["over_host"]) == set(VARIANTS[1:])
    assert all(r > 0 for r in case["over_host"].values())


def test_phases_time_the_steps_only_an_image_takes(quick):
    result, _ = quick
    phases = result["cases"]["phases"]["phases"]
    resolve = phases["create: image: resolve_root (the tree, its config and the lease)"]
    idmap = phases["create: image: idmapped tree (open_tree + mount_setattr, idmapped_tree)"]
    lease = phases["create: image: the tree's shared lock, the lease (Store._hold)"]
    for per in (resolve, idmap, lease):
        assert per["image by reference"]["median_ms"] > 0
        assert per["image by name"]["median_ms"] > 0
    assert "host userland" not in idmap and "host userland" not in lease
    # A built debian: source reads its record as a name does: neither imports again.
    assert not any("Store.import_image" in label for label in phases)
    opened = phases["create: image: the store's record of it (Store.open_image)"]
    assert set(opened) == {"image by reference", "image by name"}
    for total in ("create: total", "first exec: total", "destroy: total",
                  "create: wait for READY (init exec + mount tree)"):
        assert all(phases[total][v]["median_ms"] > 0 for v in VARIANTS[:3]), total


def test_the_episode_runs_on_the_host_and_on_the_image_by_phase(quick):
    result, _ = quick
    case = result["cases"]["episode"]
    assert case["variants"] == list(VARIANTS[:3])
    for series in case["series"]:
        assert_measured(series)
    assert all(r > 0 for r in case["end_to_end_over_host"].values())
    phases = case["breakdown"]["phases"]
    for label in ("reset: agent sandbox create", "grade: grading sandbox create",
                  "grade: grader exec, whole", "end to end"):
        assert set(phases[label]) == set(VARIANTS[:3]), label
        assert all(st["median_ms"] > 0 for st in phases[label].values()), label


def test_summary_has_the_machine_the_image_and_the_goals(quick):
    result, stdout = quick
    assert result["summary_text"] == stdout
    assert result["machine"]["kernel"] in stdout
    assert "bench_image_sandbox.py --quick" in stdout
    assert f"- image: {IMAGE} (named {NAME}" in stdout
    for name in VARIANTS:
        assert f"| {name} |" in stdout, name
    assert [g["name"] for g in result["goals"]] == [
        "create + exec /bin/true + destroy, image by reference, within 1.2x of the host",
        "create + exec /bin/true + destroy, image by name, within 1.2x of the host",
        "minimal episode end to end, image by reference",
        "minimal episode end to end, image by name"]
    for goal in result["goals"]:
        assert goal["met"] in (True, False)


def test_the_name_the_run_gave_the_image_is_removed_and_the_tree_kept(quick):
    from karotte import images
    result, _ = quick
    store = images.Store(STORE)
    with pytest.raises(images.ImageNotFound):
        store.inspect(NAME)
    assert store.inspect(IMAGE).tree == result["image"]["tree"]


def test_without_an_image_its_series_are_skipped_with_the_reason_not_a_number(tmp_path):
    missing = tmp_path / "no-layout"
    proc, result = _bench(tmp_path, str(tmp_path / "store"), "--image", f"oci:{missing}:v1")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert result["image"]["why"] and str(missing) in result["image"]["why"]
    lifecycle = {s["name"]: s for s in result["cases"]["lifecycle"]["series"]}
    assert_measured(lifecycle["host userland"])
    for name in VARIANTS[1:]:
        assert lifecycle[name]["status"] == "skipped", name
        assert str(missing) in lifecycle[name]["reason"]
        assert "stats" not in lifecycle[name] and "samples_ns" not in lifecycle[name]
    assert str(missing) in result["cases"]["phases"]["skipped"]
    episode = {s["name"]: s for s in result["cases"]["episode"]["series"]}
    assert_measured(episode["host userland: end to end"])
    assert episode["image by reference: end to end"]["status"] == "skipped"
    assert [g["met"] for g in result["goals"]] == [None] * 4
    assert "skipped" in proc.stdout


@pytest.mark.parametrize("image", ["host", "dir:/srv/tree", "some/name", "bogus:x"])
def test_an_image_that_is_not_a_source_is_a_usage_error(image, tmp_path):
    proc, result = _bench(tmp_path, str(tmp_path / "store"), "--image", image,
                          "--cases", "lifecycle")
    assert proc.returncode == 2 and result is None
    assert "--image" in proc.stderr or "expected" in proc.stderr, proc.stderr
