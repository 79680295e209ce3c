"""Environments declare images: Environment.image runs the agent's sandbox and the programs
of ctx.run on an image, Environment.grader_image the grading sandbox, whose python3 (3.9
or newer) runs grade().

Real images, made here: `dir:` trees holding a real CPython build of pyenv's (3.6 to 3.13)
as /usr/bin/python3 with the host's C library, bash and tar, and busybox for the rest; a
busybox tree without python3 or bash; and, in the slow tests, a Debian bookworm with
python3-pytest built by mmdebstrap through the image store (once, cached under /tmp).
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
import uuid

import pytest

from conftest import needs_sandbox
from envs.images import HOST_ONLY, AgentWrites, GraderReports, RunReports
from karotte.environment import agent_spec, grader_spec
from karotte.episode import Episode
from karotte.errors import KarotteError
from karotte.grading import HOST_FLAGS, GraderPreflightError, grader_flags, preflight

PYENV = os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")), "versions")
BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "cat", "ls", "echo", "mkdir", "rm", "test", "[", "id", "env", "head", "tail",
           "grep", "sed")
DEBIAN = "debian:bookworm+python3-pytest"
CACHE = "/tmp/karotte-test-images"

pytestmark = [needs_sandbox(),
              pytest.mark.skipif(os.geteuid() != 0, reason="the trees are made as root (a "
                                 "root-owned tree, as images are; an unprivileged caller "
                                 "runs only on a tree of its own)")]


# -- the trees ------------------------------------------------------------------------------

def _libraries(program: str) -> list[str]:
    """The shared libraries program loads, and its loader, as ldd names them."""
    out = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
    return re.findall(r"(/\S+) \(0x", out)


def _install(tree: str, program: str, at: str | None = None) -> None:
    """program (its content, links resolved) at `at` in tree, with its libraries at the
    paths the loader looks for them."""
    for path in [program, *_libraries(program)]:
        dest = tree + (at if path == program and at else path)
        if not os.path.exists(dest):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(os.path.realpath(path), dest)


def _busybox(tree: str) -> None:
    if not os.path.exists(BUSYBOX):
        pytest.skip(f"{BUSYBOX} is missing (apt-get install busybox-static)")
    os.makedirs(os.path.join(tree, "bin"), exist_ok=True)
    shutil.copy(BUSYBOX, os.path.join(tree, "bin/busybox"))
    for applet in APPLETS:
        os.symlink("busybox", os.path.join(tree, "bin", applet))


def _new_tree(name: str) -> str:
    tree = tempfile.mkdtemp(prefix=f"karotte-test-{name}-")
    os.chmod(tree, 0o755)
    os.makedirs(os.path.join(tree, "etc"))
    with open(os.path.join(tree, "etc/os-release"), "w") as f:
        f.write(f"ID=karotte-test-{name}\n")
    return tree


def _pyenv(minor: str) -> str:
    found = sorted(glob.glob(os.path.join(PYENV, f"{minor}.*[0-9]")),
                   key=lambda p: tuple(map(int, os.path.basename(p).split("."))))
    if not found or not os.path.exists(os.path.join(found[-1], "bin", f"python{minor}")):
        pytest.skip(f"no CPython {minor} in {PYENV} (pyenv install {minor})")
    return found[-1]


def _python_tree(minor: str) -> str:
    """A tree whose /usr/bin/python3 is pyenv's CPython `minor`, hard links of its files
    at the path its RUNPATH names (its site-packages left empty), with the host's
    libraries that it and its extension modules load, bash and tar: enough for an agent's
    episode and a grader."""
    version = _pyenv(minor)
    tree = _new_tree(f"python{minor}")
    os.makedirs(os.path.dirname(tree + version))
    subprocess.run(["cp", "-al", version, tree + version], check=True)
    site = glob.glob(f"{tree}{version}/lib/python{minor}/site-packages")
    for path in site:  # pip, setuptools and the host's .pth files are no part of the image
        shutil.rmtree(path)
        os.mkdir(path)
    python = f"{version}/bin/python{minor}"
    _install(tree, python)
    for module in glob.glob(f"{version}/lib/python{minor}/lib-dynload/*.so"):
        _install(tree, module)  # binascii needs libz, _ctypes libffi...
    os.makedirs(os.path.join(tree, "usr/bin"))
    os.symlink(python, os.path.join(tree, "usr/bin/python3"))
    _busybox(tree)
    _install(tree, "/bin/bash", "/bin/bash")
    _install(tree, "/usr/bin/tar", "/bin/tar")
    return tree


_trees: dict[str, str] = {}


@pytest.fixture(scope="session")
def python_tree():
    """python_tree(minor) -> a dir: image of that CPython, made once per session."""
    def get(minor: str) -> str:
        if minor not in _trees:
            _trees[minor] = _python_tree(minor)
        return _trees[minor]

    yield get
    for tree in _trees.values():
        shutil.rmtree(tree, ignore_errors=True)


@pytest.fixture
def busybox_tree():
    """busybox's sh, cat and the rest, and nothing else: no python3, no bash."""
    tree = _new_tree("busybox")
    _busybox(tree)
    yield tree
    shutil.rmtree(tree)


@pytest.fixture
def on_images(monkeypatch):
    """on_images(cls, image, grader_image): cls declaring those images for the test."""
    def declare(cls, image: str = "host", grader_image: str | None = None):
        monkeypatch.setattr(cls, "image", image)
        monkeypatch.setattr(cls, "grader_image", grader_image)
        return cls()

    return declare


def play(env, *commands: str):
    with Episode(env, seed=1) as ep:
        ep.reset()
        texts = [ep.exec(c).text for c in commands]
        return ep.finish(), texts


def release(tree: str) -> str:
    with open(os.path.join(tree, "etc/os-release")) as f:
        return f.read()


# -- the declaration ------------------------------------------------------------------------

def test_on_the_host_both_sandboxes_are_the_limits_themselves():
    env = AgentWrites()
    assert (env.image, env.grader_image) == ("host", None)
    assert agent_spec(env) is env.limits and grader_spec(env) is env.grader_limits
    assert grader_flags("host") == HOST_FLAGS == ("-I", "-S", "-B")


@pytest.mark.parametrize("attr", ["image", "grader_image"])
@pytest.mark.parametrize("bad", ["dir:relative/tree", "bogus:x", "", 7])
def test_an_image_outside_the_grammar_is_refused_when_the_episode_is_made(attr, bad,
                                                                         monkeypatch):
    monkeypatch.setattr(AgentWrites, attr, bad)
    with pytest.raises(ValueError, match=rf"AgentWrites\.{attr} must be "):
        Episode(AgentWrites())


@pytest.mark.parametrize("attr, declared", [("limits", "image"), ("grader_limits", "grader_image")])
def test_an_image_set_in_the_limits_is_refused_naming_where_it_is_declared(attr, declared,
                                                                            monkeypatch):
    from karotte.spec import SandboxSpec
    monkeypatch.setattr(AgentWrites, attr, SandboxSpec(image="dir:/srv/tree"))
    with pytest.raises(ValueError, match=rf"declare it as AgentWrites\.{declared} = "
                                         r"'dir:/srv/tree'"):
        Episode(AgentWrites())


def test_an_image_is_the_agents_and_its_graders_unless_the_grader_names_its_own(on_images):
    env = on_images(AgentWrites, "dir:/srv/a")
    assert agent_spec(env).image == grader_spec(env).image == "dir:/srv/a"
    env = on_images(AgentWrites, "dir:/srv/a", "host")
    assert (agent_spec(env).image, grader_spec(env).image) == ("dir:/srv/a", "host")
    assert agent_spec(env).memory == env.limits.memory  # the limits stay the author's


# -- the grader's python3 -------------------------------------------------------------------

@pytest.mark.parametrize("minor", ["3.9", "3.10", "3.11", "3.12", "3.13"])
def test_the_grader_runs_under_the_grader_images_python3(minor, python_tree, on_images,
                                                         no_leaks):
    tree = python_tree(minor)
    env = on_images(GraderReports, "host", f"dir:{tree}")
    outcome, _ = play(env)
    assert (outcome.reason, outcome.reward) == ("graded", 1.0), outcome.grader_log
    grader = outcome.details["grader"]
    assert grader["version"].startswith(minor + "."), grader
    assert grader["os_release"] == release(tree) and not grader["host_only"], grader
    assert grader["no_site"] == 0  # on an image its site-packages are the image's own
    assert preflight(env).version == grader["version"]


def test_on_the_host_the_grader_is_the_system_python_without_site(on_images, no_leaks):
    outcome, _ = play(on_images(GraderReports))
    grader = outcome.details["grader"]
    assert grader["executable"] == "/usr/bin/python3" and grader["no_site"] == 1, grader
    assert grader["host_only"] is os.path.exists(HOST_ONLY)


def test_a_grader_image_without_python3_fails_preflight_naming_the_image_and_the_fix(
        busybox_tree, on_images, no_leaks):
    env = on_images(GraderReports, "host", f"dir:{busybox_tree}")
    with pytest.raises(GraderPreflightError) as info:
        preflight(env)
    why = str(info.value)
    assert f"the grader's image dir:{busybox_tree} has none" in why, why
    assert "install python3 (3.9 or newer)" in why and "GraderReports.grader_image" in why
    outcome, _ = play(env)  # an episode on it: the author's error, not a score
    assert outcome.reason == "infra_error" and "has none" in outcome.infra_error


@pytest.mark.parametrize("minor", ["3.8", "3.6"])
def test_a_grader_image_with_a_python_older_than_3_9_fails_preflight_naming_its_version(
        minor, python_tree, on_images, no_leaks):
    tree = python_tree(minor)
    env = on_images(GraderReports, "host", f"dir:{tree}")
    with pytest.raises(GraderPreflightError) as info:
        preflight(env)
    why = str(info.value)
    version = os.path.basename(_pyenv(minor))
    assert f"/usr/bin/python3 {version} of the image dir:{tree}" in why, why
    assert "needs Python 3.9 or newer" in why and "GraderReports.grader_image" in why


def test_a_module_only_the_grader_image_lacks_is_named_with_the_image(python_tree, tmp_path,
                                                                      no_leaks):
    tree = python_tree("3.11")
    name = _author(tmp_path, TASK, f"""
        import pytest  # the trainer has it; this image does not


        class OnImage(Task):
            grader_image = "dir:{tree}"
    """)
    try:
        outcome, _ = play(f"{name}:OnImage")
    finally:
        sys.path.remove(str(tmp_path))
    assert outcome.reason == "infra_error"
    assert "No module named 'pytest'" in outcome.infra_error, outcome.infra_error
    assert f"of the image dir:{tree} -I" in outcome.infra_error
    assert "install the module in the grader's image" in outcome.infra_error


# -- the agent's image ----------------------------------------------------------------------

def test_the_agent_sees_its_image_and_not_the_host(python_tree, on_images, no_leaks):
    assert os.path.exists(HOST_ONLY) and glob.glob("/usr/lib/python3*")  # the host has them
    tree = python_tree("3.9")
    env = on_images(AgentWrites, f"dir:{tree}")
    outcome, (seen,) = play(env, "cat /etc/os-release; python3 -c 'import sys; "
                                 "print(sys.version.split()[0])'; ls -d /usr/lib/python3* "
                                 f"2>&1; test -e {HOST_ONLY} && echo HOST-ONLY; pwd; "
                                 "cat notes.txt; echo 42 > answer.txt")
    assert seen.startswith(release(tree)), seen
    assert f"\n{os.path.basename(_pyenv('3.9'))}\n" in seen
    assert "No such file or directory" in seen and "HOST-ONLY" not in seen
    assert "/workspace\nthe answer is 42\n" in seen  # the tools start in /workspace
    # the grader runs on the agent's image: its 3.9 graded the answer
    assert (outcome.reason, outcome.reward) == ("graded", 1.0), outcome.grader_log
    assert outcome.details["python"].startswith("3.9.")


def test_an_agent_image_without_bash_fails_at_reset_naming_what_is_missing(
        busybox_tree, on_images, no_leaks):
    env = on_images(AgentWrites, f"dir:{busybox_tree}", "host")
    with Episode(env) as ep:
        with pytest.raises(KarotteError) as info:
            ep.reset()
    why = str(info.value)
    assert f"the agent's image dir:{busybox_tree} has no /bin/bash, tar:" in why, why
    assert "install bash" in why and "AgentWrites.image" in why


def test_ctx_run_runs_the_agents_program_on_the_agents_image(python_tree, on_images,
                                                            no_leaks):
    agent, grader = python_tree("3.10"), python_tree("3.13")
    env = on_images(RunReports, f"dir:{agent}", f"dir:{grader}")
    outcome, _ = play(env)
    assert outcome.reason == "graded", outcome.grader_log
    seen = outcome.details
    assert seen["grader"]["version"].startswith("3.13.") and \
        seen["grader"]["os_release"] == release(grader), seen
    assert seen["run"]["version"].startswith("3.10.") and \
        seen["run"]["os_release"] == release(agent), seen
    assert not seen["run"]["host_only"]


def test_ctx_run_on_the_host_image_runs_on_the_hosts_userland(python_tree, on_images,
                                                              no_leaks):
    env = on_images(RunReports, "host", f"dir:{python_tree('3.13')}")
    outcome, _ = play(env)
    assert outcome.reason == "graded", outcome.grader_log
    assert outcome.details["run"]["executable"] == "/usr/bin/python3"
    assert outcome.details["run"]["host_only"] is os.path.exists(HOST_ONLY)


# -- the command line -----------------------------------------------------------------------

# An author's environment, whole in its own package (the grader imports nothing else of
# the trainer's): reward 1 for 42 in answer.txt, with the grader's Python in the details.
TASK = """
    import sys

    from karotte.environment import Environment, Grade


    class Task(Environment):
        deliverables = ("answer.txt",)

        def prompt(self, seed):
            return "Write 42 to /workspace/answer.txt."

        def grade(self, ctx):
            answer = ctx.read_deliverable("answer.txt", limit=16)
            return Grade(1.0 if answer is not None and answer.strip() == b"42" else 0.0,
                         {"python": sys.version.split()[0]})

        def reference_solution(self, seed):
            return ["echo 42 > answer.txt"]
"""


def _author(tmp_path, *parts: str) -> str:
    """An environment package in tmp_path, importable here and by `karotte` run there."""
    name = f"author_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("".join(map(textwrap.dedent, parts)))
    sys.path.insert(0, str(tmp_path))
    return name


def karotte(*args: str, cwd, env: dict | None = None, timeout: float = 600):
    return subprocess.run([sys.executable, "-m", "karotte.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_karotte_check_stops_at_a_grader_image_without_python3(busybox_tree, tmp_path,
                                                               no_leaks):
    name = _author(tmp_path, TASK, f"""

        class OnImage(Task):
            grader_image = "dir:{busybox_tree}"
    """)
    sys.path.remove(str(tmp_path))
    r = karotte("check", f"{name}:OnImage", "--json", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    results = json.loads(r.stdout)["results"]
    assert [x["name"] for x in results] == ["grader-imports", "host-unaffected"]
    assert not results[0]["passed"] and f"image dir:{busybox_tree} has none" in results[0]["why"]


def test_karotte_run_plays_an_environment_on_an_image(python_tree, tmp_path, no_leaks):
    name = _author(tmp_path, TASK, f"""

        class OnImage(Task):
            image = "dir:{python_tree('3.12')}"
    """)
    sys.path.remove(str(tmp_path))
    r = karotte("run", f"{name}:OnImage", "-n", "2", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["reason"], x["reward"]) for x in records] == [("graded", 1.0)] * 2, records
    assert all(x["details"]["python"].startswith("3.12.") for x in records)


# -- a Debian image of the store (slow: mmdebstrap builds it once, the store keeps it) -------

_debian_why: list[str | None] = []


def _debian_unavailable() -> str | None:
    """Why a debian: image cannot be built here (probed once per session), or None."""
    if not _debian_why:
        why = None
        if shutil.which("mmdebstrap") is None:
            why = "needs mmdebstrap (scripts/setup installs it)"
        else:
            try:
                urllib.request.urlopen("http://deb.debian.org/debian/dists/bookworm/Release",
                                       timeout=10).close()
            except OSError as exc:
                why = f"Debian's archive is unreachable ({exc})"
        _debian_why.append(why)
    return _debian_why[0]


@pytest.fixture(scope="session")
def debian_store():
    """KAROTTE_IMAGE_DIR: a store under /tmp holding DEBIAN, built once a day and kept for
    later runs; the directory to pass to `karotte` on the command line too."""
    why = _debian_unavailable()
    if why:
        pytest.skip(why)
    root = os.path.join(CACHE, f"store-env-images-{datetime.date.today():%Y%m%d}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAROTTE_IMAGE_DIR", root)
        from karotte import images
        images.import_image(DEBIAN)
        yield root


@pytest.mark.slow
def test_on_a_debian_image_the_agent_sees_its_python_and_the_grader_imports_its_pytest(
        debian_store, on_images, no_leaks):
    assert subprocess.run(["/usr/bin/python3", "-c", "import pytest"],
                          capture_output=True).returncode != 0  # the host has no pytest
    host = sorted(glob.glob("/usr/lib/python3*/dist-packages/*"))
    env = on_images(RunReports, DEBIAN)
    outcome, (seen,) = play(env, "ls -d /usr/lib/python3*/dist-packages/*; "
                                 f"test -e {HOST_ONLY} && echo HOST-ONLY; true")
    assert "/usr/lib/python3/dist-packages/pytest" in seen.splitlines(), seen
    assert seen.splitlines() != host and "HOST-ONLY" not in seen
    assert outcome.reason == "graded", outcome.grader_log
    grader, run = outcome.details["grader"], outcome.details["run"]
    assert grader["pytest"] == "/usr/lib/python3/dist-packages/pytest/__init__.py", grader
    assert run["pytest"] == grader["pytest"] and not run["host_only"], run
    assert grader["os_release"].startswith('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"')


@pytest.mark.slow
def test_karotte_run_and_check_pass_the_pytest_example_on_its_debian_image(debian_store,
                                                                          tmp_path, no_leaks):
    target = "karotte.examples.fix_tests_pytest"
    store = {"KAROTTE_IMAGE_DIR": debian_store}
    r = karotte("run", target, "-n", "2", "--json", cwd=tmp_path, env=store)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["reason"], x["reward"]) for x in records] == [("graded", 1.0)] * 2, records
    r = karotte("check", target, "--json", cwd=tmp_path, env=store, timeout=1800)
    report = json.loads(r.stdout)
    failed = [(x["name"], x["why"]) for x in report["results"] if not x["passed"]]
    assert r.returncode == 0 and report["passed"], failed
    first = report["results"][0]
    assert first["name"] == "grader-imports" and first["why"].startswith(
        "the grader imports it under /usr/bin/python3 -I -B (Python 3.11"), first
    assert first["why"].endswith(f", on the image {DEBIAN})")
