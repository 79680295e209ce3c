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


def under_pty(*args: str) -> tuple[int, str, str]:
    """karotte image ARGS with stderr on a real pseudo-terminal (stdout a pipe): the exit
    status, stdout, and what the terminal showed."""
    master, slave = os.openpty()
    child = subprocess.Popen([sys.executable, "-m", "karotte.cli.main", "image", *args],
                             cwd=TESTS, stdout=subprocess.PIPE, stderr=slave, text=True,
                             env=os.environ.copy())
    os.close(slave)
    shown = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal's last fd
            break
        if not data:
            break
        shown += data
    os.close(master)
    out = child.stdout.read()
    child.stdout.close()
    return child.wait(timeout=120), out, shown.decode(errors="replace")


def test_import_on_a_terminal_draws_a_progress_bar_and_leaves_json_alone(images, store):
    status, out, shown = under_pty("import", f"oci:{images['layout']}:t", "--json")
    assert status == 0, shown
    assert json.loads(out)["chain_id"].startswith("sha256:")  # stdout is the record only
    assert "layer 1/2 [" in shown and "layer 2/2 [" in shown and " MiB" in shown, shown
    assert "manifest" in shown and "\r" in shown
    assert shown.endswith("\r\x1b[K"), shown  # the bar's line is cleared at the end


def test_no_progress_bar_on_a_pipe_unless_asked(images, store):
    r = karotte_image("import", f"oci:{images['layout']}:t")
    assert r.returncode == 0 and "layer 1/2" not in r.stderr and "importing" in r.stderr
    assert karotte_image("gc").returncode == 0  # the unnamed import goes: the next is fresh
    r = karotte_image("import", f"docker-archive:{images['x']}", "--progress", "--json")
    assert r.returncode == 0 and "layer 1/2 [" in r.stderr, r.stderr
    json.loads(r.stdout)
    assert karotte_image("gc").returncode == 0
    status, _, shown = under_pty("import", f"oci:{images['zstd']}:t", "--no-progress")
    assert status == 0 and "layer 1/2" not in shown and "importing" in shown


def test_run_and_check_say_when_an_image_is_imported_the_first_time(images, store):
    from io import StringIO

    from karotte.cli.image import announce_first_imports
    from karotte.images import Store

    class Env:
        image = f"oci:{images['layout']}:t"
        grader_image = None

    said = StringIO()
    announce_first_imports(Env(), "check", said)
    assert said.getvalue().startswith(f"karotte check: importing {Env.image} into the image "
                                      "store for the first time"), said.getvalue()
    Store(str(store)).import_image(Env.image)
    said = StringIO()
    announce_first_imports(Env(), "run", said)
    Env.image = "host"
    announce_first_imports(Env(), "run", said)
    assert said.getvalue() == ""  # imported already, or no image to import
