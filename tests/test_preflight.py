"""The preflight: an environment that its grader cannot import is the author's error,
named with its cause, never a score of the agent's."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import pytest

from karotte.episode import Episode

TASK = '''
from karotte.environment import Environment


class Task(Environment):
    deliverables = ("answer.txt",)

    def prompt(self, seed):
        return "Write 42 to /workspace/answer.txt."

    def grade(self, ctx):
        return 1.0 if ctx.read_deliverable("answer.txt", limit=8) == b"42\\n" else 0.0

    def reference_solution(self, seed):
        return ["echo 42 > answer.txt"]
'''


@pytest.fixture
def author(tmp_path):
    """Writes an author's package into tmp_path, importable by the trainer; its name."""
    sys.path.insert(0, str(tmp_path))

    def write(files: dict[str, str]) -> str:
        name = f"author_{uuid.uuid4().hex[:8]}"
        for path, text in files.items():
            (tmp_path / name / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / path).write_text(textwrap.dedent(text))
        return name

    yield write
    sys.path.remove(str(tmp_path))


def outcome_of(target: str):
    with Episode(target, seed=1) as ep:
        ep.reset()
        ep.exec("echo 42 > answer.txt")
        return ep.finish()


def test_a_module_the_system_python_lacks_is_an_infra_error_that_names_it(no_leaks, author):
    import psutil  # noqa: F401  the trainer has it: only the grader does not

    name = author({"__init__.py": "import psutil\n" + TASK})
    outcome = outcome_of(f"{name}:Task")
    assert (outcome.reason, outcome.reward) == ("infra_error", 0.0), outcome.grader_log
    assert (f"{name}/__init__.py:1: ModuleNotFoundError: No module named 'psutil'"
            in outcome.infra_error), outcome.infra_error
    assert "/usr/bin/python3" in outcome.infra_error and "standard library" in outcome.infra_error


def test_a_construct_the_graders_python_cannot_parse_is_an_infra_error_with_its_line(
        no_leaks, author):
    # A fallback only the grader takes (the trainer has psutil), in a syntax newer than
    # the grader's Python 3.11: the trainer never sees it.
    name = author({"__init__.py": "try:\n    import psutil\nexcept ImportError:\n"
                                  "    from . import portable\n" + TASK,
                   "portable.py": "x = 1\ntype Number = int | float\n"})
    outcome = outcome_of(f"{name}:Task")
    assert outcome.reason == "infra_error", outcome.grader_log
    assert f"{name}/portable.py:2: SyntaxError: invalid syntax" in outcome.infra_error, \
        outcome.infra_error
    assert "Graders run under /usr/bin/python3 3." in outcome.infra_error


def test_check_stops_at_a_grader_that_cannot_import_the_environment(no_leaks, author, tmp_path):
    name = author({"__init__.py": "import psutil\n" + TASK})
    r = subprocess.run([sys.executable, "-m", "karotte.cli.main", "check", f"{name}:Task",
                        "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    results = json.loads(r.stdout)["results"]
    assert [x["name"] for x in results] == ["grader-imports", "host-unaffected"]
    assert not results[0]["passed"] and "No module named 'psutil'" in results[0]["why"]
