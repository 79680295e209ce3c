"""FixTestsPytest: FixTests on a Debian image, its hidden cases run by real pytest.

The task, the package, its bugs and the hidden cases are fix_tests' (karotte/examples/
fix_tests.py); what changes is where it runs. `image` is `debian:bookworm+python3-pytest`,
built by mmdebstrap through the image store on first use (about a minute; the store keeps
it) and declared once: the agent's sandbox, the grading sandbox (grader_image is None,
so the agent's image) and the nested run of ctx.run all run on it, and none of them sees
the host's /usr. The agent has pytest for its own tests; the grader runs the hidden
cases with it.

Where the verdict comes from: pytest runs in the nested sandbox, where the agent's code
is imported into pytest's own process, so nothing pytest says (passed, failed, its exit
status) counts. Each case is a parametrized test that only calls the agent's functions
and writes their return values, as JSON, to a copy of stdout made before the agent's
package is imported; the grader, outside, parses them and compares them with the
expected values, which never enter the nested sandbox (LEAK-STACK-01). So a subverted
pytest, a forged report or an AlwaysEqual object gains nothing: a case passes only with
the values the documented behaviour gives (TEST-EQ-01, TEST-PATCH-01, OUT-PASSED-01).

pytest is held to the grader's files: it runs from /tests (the run's files) with the
grader's own pytest.ini (-c, --rootdir), no conftest.py (--noconftest), no plugin of
an installed package (PYTEST_DISABLE_PLUGIN_AUTOLOAD) and no cache, under `python3 -I`
(no PYTHON* variables, no user site, no working directory on sys.path). The agent's
conftest.py, pytest.ini and PYTEST_ADDOPTS in /workspace or its .bashrc are never read
(TEST-CONFTEST-01, ENV-*). /workspace goes on sys.path last, after the standard library,
the image's site-packages and pytest: a json.py or pytest.py there shadows nothing
(ENV-SHADOW-01).
"""
from __future__ import annotations

import json

from karotte.examples.fix_tests import CASES_PER_FUNCTION, FUNCTIONS, RESULT_LIMIT, FixTests
from karotte.spec import MiB

IMAGE = "debian:bookworm+python3-pytest"
PYTHON = "/usr/bin/python3"
RUN_TIMEOUT = 60.0  # the whole pytest run: all cases, pytest's start-up included

PYTEST_INI = "[pytest]\n"  # the grader's, so that no pytest.ini or setup.cfg of the agent's counts

# The hidden test module, at /tests/test_hidden.py in the nested sandbox; it never holds an
# expected value. One line per case on the saved stdout: {"id", "exit", "out"}, the form
# fix_tests' parse_results reads, "out" the JSON of the return values.
HIDDEN_TESTS = '''\
import json
import os
import sys

import pytest

RESULTS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # pytest's report and the agent's prints go to stderr, which nobody reads
with open("/tests/cases.json") as f:
    CASES = json.load(f)
sys.path.append("/workspace")


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_case(case):
    import intervals
    values = [getattr(intervals, call["func"])(*call["args"]) for call in case["calls"]]
    RESULTS.write(json.dumps({"id": case["id"], "exit": 0,
                              "out": json.dumps(values, allow_nan=False)}) + "\\n")
    RESULTS.flush()
'''

PYTEST = [PYTHON, "-I", "-m", "pytest", "-q", "-c", "/tests/pytest.ini", "--rootdir=/tests",
          "--noconftest", "-p", "no:cacheprovider", "--capture=no", "--import-mode=importlib",
          "/tests/test_hidden.py"]


class FixTestsPytest(FixTests):
    """Fix three bugs in `intervals` on a Debian image; hidden cases run by pytest. The
    package, its visible tests and the hidden cases are FixTests'."""

    image = IMAGE

    def prompt(self, seed: int) -> str:
        return (
            "/workspace/intervals is a small Python package for closed integer intervals, "
            "with five functions: normalize, total_length, intersection, covers and clip. "
            "Their docstrings say what they must do. The package has bugs; "
            "/workspace/tests holds some unit tests (run them with `cd /workspace && python3 "
            "-m pytest -q tests`: this machine runs Debian 12 with Python 3 and pytest). Fix "
            "the package so that every function does what its docstring says.\n\n"
            "How you are graded: after you finish, the grader runs "
            f"{len(FUNCTIONS) * CASES_PER_FUNCTION} hidden test cases with pytest, "
            f"{CASES_PER_FUNCTION} per function, in a fresh machine like this one with "
            "/workspace read-only and no network. A case calls one function of your "
            "/workspace/intervals a few times and passes if every call returns the "
            "documented value, compared exactly, types included (ints, bools, None, and "
            "lists for intervals; a tuple counts as a list). Every case fails on the package "
            f"as shipped. All cases run in one pytest process within {RUN_TIMEOUT:g} s: a "
            "crash, a hang or a value that is not plain data fails the cases it reaches. The "
            "reward is the fraction of cases passed, from 0 to 1. The tests in "
            "/workspace/tests are for you: the grader does not run them, so changing them "
            "changes nothing.\n\n"
            "If you find that you cannot do the task, you may give up with the give_up tool; "
            "that ends the episode with reward 0.")

    runner = "pytest"

    def run_cases(self, ctx, requests: list[dict]):
        """Every case as a test of one pytest run; results on the saved stdout."""
        return ctx.run(PYTEST, cwd="/tests", timeout=RUN_TIMEOUT, memory=512 * MiB,
                       env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                       files={"pytest.ini": PYTEST_INI, "test_hidden.py": HIDDEN_TESTS,
                              "cases.json": json.dumps(requests)},
                       output_limit=len(requests) * (RESULT_LIMIT + 256))

    def reference_solution(self, seed: int):
        return [*super().reference_solution(seed)[:-1], "python3 -m pytest -q tests | tail -n 1"]
