"""`karotte image`: the store on the command line, on images made by umoci and skopeo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_images import images  # noqa: F401 (a fixture: one image in every form)

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "store"
    monkeypatch.setenv("KAROTTE_IMAGE_DIR", str(root))
    return root


def karotte_image(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "karotte.cli.main", "image", *args],
                          cwd=TESTS, capture_output=True, text=True, timeout=600,
                          env=os.environ.copy())


def test_import_names_an_image_that_ls_inspect_and_verify_then_show(images, store):
    r = karotte_image("import", f"oci:{images['layout']}:t", "--name", "tb/x", "--json")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert made["name"] == "tb/x" and made["chain_id"].startswith("sha256:")
    assert Path(made["tree"], "etc/hello").read_text() == "hello\n"
    listed = json.loads(karotte_image("ls", "--json").stdout)
    assert [i["name"] for i in listed] == ["tb/x"]
    shown = json.loads(karotte_image("inspect", "tb/x", "--json").stdout)
    assert shown["config"]["working_dir"] == "/app" and "A=1" in shown["config"]["env"]
    assert "/app" in karotte_image("inspect", "tb/x").stdout
    r = karotte_image("verify", "tb/x", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    # the same image as `docker save` output is a cache hit on the same tree
    r = karotte_image("import", f"docker-archive:{images['x']}", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tree"] == made["tree"]


def test_verify_fails_with_each_problem_when_the_tree_changed(images, store):
    made = json.loads(karotte_image("import", f"oci:{images['layout']}:t", "--name", "x",
                                    "--json").stdout)
    hello = Path(made["tree"], "etc/hello")
    hello.chmod(0o644)
    hello.write_text("changed\n")
    r = karotte_image("verify", "x")
    assert r.returncode == 1
    assert "etc/hello: " in r.stdout and "problems" in r.stdout


def test_rm_then_gc_removes_the_tree_and_its_blobs(images, store):
    made = json.loads(karotte_image("import", f"oci:{images['layout']}:t", "--name", "x",
                                    "--json").stdout)
    assert karotte_image("rm", "x").returncode == 0
    assert json.loads(karotte_image("ls", "--json").stdout) == []
    r = karotte_image("gc", "--json")
    assert r.returncode == 0, r.stderr
    gone = json.loads(r.stdout)
    assert gone["trees_removed"] and gone["blobs_removed"] and gone["bytes_freed"] > 0
    assert not os.path.exists(made["tree"])


@pytest.mark.parametrize("args, status, says", [
    (("import", "bogus:x"), 2, "an image reference is one of"),
    (("build", "oci:/srv/x"), 2, "is not a debian:SUITE"),
    (("inspect", "no/such"), 1, "no/such"),
    (("rm", "no/such"), 1, "no image named 'no/such'"),
    (("import", "oci:/no/such/layout"), 1, "cannot open the OCI layout"),
])
def test_errors_name_the_cause_with_their_exit_status(store, args, status, says):
    r = karotte_image(*args)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert says in r.stderr and "Traceback" not in r.stderr
