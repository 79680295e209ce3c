"""The default host userland does not show the trainer (karotte/userland.py): a Karotte
installed into a venv under /usr/local, with an environment package beside it, is invisible
from inside the agent's sandbox, the grader's and ctx.run's, while /usr/bin/python3, its
standard library and Debian's python3-* packages still work there."""
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"
DEBIAN_SITE = "/usr/lib/python3/dist-packages"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/local", os.W_OK),
                                reason="needs root: the tests install into /usr/local")


def _run(argv, cwd="/", **kw):
    """argv's result, run from / (not this checkout, whose karotte '' would import)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd, **kw)


def _debian_module() -> str | None:
    """A package of Debian's dist-packages that the system Python imports, or None."""
    if not os.path.isdir(DEBIAN_SITE):
        return None
    for name in sorted(os.listdir(DEBIAN_SITE)):
        if name.isidentifier() and os.path.isfile(os.path.join(DEBIAN_SITE, name, "__init__.py")):
            if _run([SYSTEM_PYTHON, "-I", "-c", f"import {name}"]).returncode == 0:
                return name
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Karotte as a wheel, built from this checkout's files (tracked and new)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    files = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO).stdout
    for rel in filter(None, files.split("\0")):
        if os.path.lexists(REPO / rel):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel, follow_symlinks=False)
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)])
    if built.returncode != 0:
        pytest.skip(f"cannot build Karotte's wheel (its build requirements from PyPI?): "
                    f"{built.stderr[-500:]}")
    return next(out.glob("karotte-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel):
    """/usr/local/karotte-test-venv-<random>: the system Python's venv (with the system's
    site directories, so Debian's dist-packages is on the trainer's path too), Karotte
    installed by pip, and tests/envs/basic.py as the package leakenv with a canary."""
    if _run([SYSTEM_PYTHON, "-c", "import venv, ensurepip"]).returncode != 0:
        pytest.skip(f"{SYSTEM_PYTHON} has no venv module (apt install python3-venv)")
    path = Path(f"/usr/local/karotte-test-venv-{secrets.token_hex(4)}")
    canary = f"KAROTTE-LEAK-CANARY-{secrets.token_hex(8)}"
    try:
        made = _run([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", str(path)])
        assert made.returncode == 0, made.stderr
        installed = _run([str(path / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index",
                          str(wheel)])
        assert installed.returncode == 0, installed.stderr
        python = str(path / "bin" / "python")
        site_dir = Path(_run([python, "-c", "import karotte, os; "
                              "print(os.path.dirname(os.path.dirname(karotte.__file__)))"]
                             ).stdout.strip())
        assert site_dir.is_relative_to(path), site_dir
        if _run([python, "-c", "import _cffi_backend"]).returncode != 0:
            pytest.skip("the system Python has no _cffi_backend (apt install "
                        "python3-cffi-backend)")
        (site_dir / "leakenv").mkdir()
        (site_dir / "leakenv" / "__init__.py").write_text("")
        (site_dir / "leakenv" / "basic.py").write_text(
            f"# {canary}\n" + (REPO / "tests" / "envs" / "basic.py").read_text())
        yield {"path": str(path), "python": python, "site": str(site_dir), "canary": canary}
    finally:
        shutil.rmtree(path, ignore_errors=True)


# Run by the venv's python: episodes of leakenv, whose agent looks for what it must not see.
TRAINER = textwrap.dedent(r"""
    import json, sys
    from karotte.episode import Episode
    from karotte.sandbox import Sandbox
    from leakenv.basic import Addition, Doubler
    venv, site, canary, debian = sys.argv[1:5]
    looks = {
        "ls_venv": f"ls -A {venv}",
        "cat_episode_py": f"cat {site}/karotte/episode.py",
        "cat_env": f"cat {site}/leakenv/basic.py",
        "find_episode_py": "find / -path /proc -prune -o -name episode.py -print 2>/dev/null",
        "find_venv_files": "find / -path /proc -prune -o \\( -name pyvenv.cfg -o -name "
                           "'karotte-init' -o -name 'leakenv' -o -name 'karotte*.dist-info' "
                           "\\) -print 2>/dev/null",
        "grep_canary": f"grep -rl --include='*.py' {canary} / 2>/dev/null",
        "import_karotte": "/usr/bin/python3 -c 'import karotte' 2>&1 | tail -1",
        "import_leakenv": "/usr/bin/python3 -c 'import leakenv' 2>&1 | tail -1",
        "venv_python": f"{venv}/bin/python -c 1 2>&1; echo $?",
        "stdlib": "/usr/bin/python3 -c 'import json, sqlite3, ssl, decimal; print(\"stdlib ok\")'",
        "debian": f"/usr/bin/python3 -c 'import {debian}; print({debian}.__file__)'"
                  if debian else "true",
    }
    found = {}
    with Episode(Addition(), seed=3) as ep:
        ep.reset()
        for name, command in looks.items():
            found[name] = ep.exec(command).text
        for step in ep.reference_solution():
            ep.exec(step)
        found["addition_reward"] = ep.finish().reward
    # The agent's program, run by the grader with ctx.run, earns the reward only if the
    # venv's files are out of its sight too.
    solution = ("import os\n"
                f"seen = os.listdir({venv!r})\n"
                "n = int(input())\n"
                "print(2 * n if not seen else 'seen')\n")
    with Episode(Doubler(), seed=3) as ep:
        ep.reset()
        ep.write_file("solution.py", solution)
        found["doubler_reward"] = ep.finish().reward
    with Sandbox() as sb:  # a plain sandbox, no episode: the same
        found["sandbox_ls_venv"] = sb.exec(["ls", "-A", venv]).stdout.decode()
    print(json.dumps(found))
""")


@pytest.fixture(scope="module")
def seen(venv):
    """What the agent found, looking from inside, in the episodes TRAINER runs."""
    r = _run([venv["python"], "-c", TRAINER, venv["path"], venv["site"], venv["canary"],
              _debian_module() or ""])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_LEAK_USERLAND_01_a_karotte_installed_in_a_venv_under_usr_local_is_invisible_inside(
        seen, venv):
    assert seen["ls_venv"] == "" and seen["sandbox_ls_venv"] == ""
    assert "No such file" in seen["cat_episode_py"]
    assert "No such file" in seen["cat_env"] and venv["canary"] not in seen["cat_env"]
    assert seen["find_episode_py"] == "", seen["find_episode_py"]
    assert seen["find_venv_files"] == "", seen["find_venv_files"]
    assert seen["grep_canary"] == "", seen["grep_canary"]
    assert "ModuleNotFoundError" in seen["import_karotte"]
    assert "ModuleNotFoundError" in seen["import_leakenv"]
    assert seen["venv_python"].strip().endswith("127"), seen["venv_python"]


def test_LEAK_USERLAND_01_the_system_python_and_its_standard_library_still_work_inside(seen):
    assert seen["stdlib"].strip() == "stdlib ok"


def test_debians_python3_packages_stay_visible_though_they_are_on_the_trainers_path(seen):
    name = _debian_module()
    if name is None:
        pytest.skip(f"no package in {DEBIAN_SITE} that {SYSTEM_PYTHON} imports")
    assert seen["debian"].strip().startswith(f"{DEBIAN_SITE}/{name}/"), seen["debian"]


def test_LEAK_USERLAND_01_the_grader_still_imports_the_environment_from_its_own_copy(seen):
    assert seen["addition_reward"] == 1.0


def test_LEAK_USERLAND_01_the_agents_program_run_by_the_grader_does_not_see_the_venv(seen):
    assert seen["doubler_reward"] == 1.0


# Run by this checkout's python in a fresh process: its first sandbox computes what to hide.
LOOK = textwrap.dedent(r"""
    import json, sys
    from karotte.sandbox import Sandbox
    with Sandbox() as sb:
        print(json.dumps({path: sb.exec(["cat", path]).stdout.decode("utf-8", "replace")
                          for path in sys.argv[1:]}))
""")


def _look(*paths: str) -> dict[str, str]:
    r = _run([sys.executable, "-c", LOOK, *paths])
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture
def other_venv():
    """Another trainer's venv under /usr/local (not the running interpreter's)."""
    path = Path(f"/usr/local/karotte-test-other-{secrets.token_hex(4)}")
    try:
        path.mkdir()
        (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
        (path / "secret.txt").write_text("the other trainer's secret\n")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_LEAK_USERLAND_02_a_hard_link_elsewhere_in_usr_to_a_hidden_file_is_hidden_too(
        other_venv):
    link = Path(f"/usr/local/share/karotte-test-link-{secrets.token_hex(4)}")
    os.link(other_venv / "secret.txt", link)
    try:
        seen = _look(str(other_venv / "secret.txt"), str(link), "/usr/bin/env")
    finally:
        link.unlink()
    assert seen[str(other_venv / "secret.txt")] == ""
    assert seen[str(link)] == ""
    assert seen["/usr/bin/env"] != ""  # the rest of /usr is there


def test_LEAK_USERLAND_03_what_pip_installed_as_root_into_usr_local_is_hidden_entry_by_entry():
    """A distribution in /usr/local/lib/python3.X/dist-packages (where `pip install` as root
    writes) and the console script its RECORD lists in /usr/local/bin are hidden; the rest
    of /usr/local/bin is not."""
    site_dirs = sorted(Path("/usr/local/lib").glob("python3*/dist-packages"))
    if not site_dirs:
        pytest.skip("no /usr/local/lib/python3.X/dist-packages on this host")
    tag = secrets.token_hex(4)
    dist = site_dirs[0] / f"karotte_leak_test_{tag}-1.0.dist-info"
    script = Path(f"/usr/local/bin/karotte-leak-test-{tag}")
    neighbour = Path(f"/usr/local/bin/karotte-leak-neighbour-{tag}")
    module = site_dirs[0] / f"karotte_leak_test_{tag}.py"
    try:
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: karotte-leak-test-{tag}\n"
                                       "Version: 1.0\n")
        (dist / "RECORD").write_text(f"karotte_leak_test_{tag}.py,,\n"
                                     f"../../../bin/{script.name},,\n")
        module.write_text("SECRET = 1\n")
        script.write_text("#!/bin/sh\necho trainer\n")
        neighbour.write_text("#!/bin/sh\necho admin's own tool\n")
        seen = _look(str(module), str(script), str(neighbour))
    finally:
        shutil.rmtree(dist, ignore_errors=True)
        for path in (module, script, neighbour):
            path.unlink(missing_ok=True)
    assert seen[str(module)] == ""
    assert seen[str(script)] == ""
    assert seen[str(neighbour)] == "#!/bin/sh\necho admin's own tool\n"


# Run by the venv's python: an episode of an environment installed in Debian's own
# dist-packages, which stays visible; the environment's package there does not.
DEBIAN_ENV = textwrap.dedent(r"""
    import importlib, json, sys
    from karotte.episode import Episode
    package, debian = sys.argv[1:3]
    Addition = importlib.import_module(package + ".basic").Addition
    with Episode(Addition(), seed=5) as ep:
        ep.reset()
        found = {"ls": ep.exec(f"ls -A /usr/lib/python3/dist-packages/{package}").text,
                 "debian": ep.exec(f"/usr/bin/python3 -c 'import {debian}; print(1)'").text}
        for step in ep.reference_solution():
            ep.exec(step)
        found["reward"] = ep.finish().reward
    print(json.dumps(found))
""")


def test_LEAK_USERLAND_04_an_environment_package_in_debians_dist_packages_is_hidden_alone(venv):
    debian = _debian_module()
    if debian is None:
        pytest.skip(f"no package in {DEBIAN_SITE} that {SYSTEM_PYTHON} imports")
    package = f"karotte_leak_env_{secrets.token_hex(4)}"
    where = Path(DEBIAN_SITE) / package
    try:
        where.mkdir()
        (where / "__init__.py").write_text("")
        shutil.copyfile(REPO / "tests" / "envs" / "basic.py", where / "basic.py")
        r = _run([venv["python"], "-c", DEBIAN_ENV, package, debian])
    finally:
        shutil.rmtree(where, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.splitlines()[-1])
    assert found["ls"] == ""  # the package's directory is an empty one
    assert found["debian"].strip() == "1"  # the rest of dist-packages is there
    assert found["reward"] == 1.0  # and the grader imports its own copy
