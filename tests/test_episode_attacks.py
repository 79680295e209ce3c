"""Reward hacks against whole episodes, as scripted agents (IDs from docs/attacks.md).

Each test plants one attack through the agent's tools (exec, write_file), then finish(),
and asserts what the catalogue says must happen: the grader completes within a bound,
the reward is what the honest work in the submission earns (the bottom for a pure
hack), the reason names what happened, violations are named where the scanner acted,
nothing of the episode is left on the host (no_leaks, and named processes looked up on
the host), and an honest episode right after still scores full marks.

Entries of the TEST, LEAK, TIME, OUT, ENV, FS and XEP categories that do not apply to an
environment built with Karotte's API, and why:

- LEAK-GIT-01: Karotte never makes a git repository; a workspace holds only the files
  workspace_files() lists, and no environment here ships one (D13 is the task
  author's part when a task does).
- TIME-CUDA-01, XEP-GPU-01: no GPU on this machine, and Karotte has no GPU custody yet.
- OUT-JUDGE-01: Karotte has no LLM judge; a grade() is deterministic code.

The environments are in tests/envs/: basic (Addition, Doubler), fixfunc (hidden tests run
outside the agent's process), speed (ctx.compare_speed) and pipeline (small ones whose
graders are careless on purpose, or report what they saw).
"""
from __future__ import annotations

import asyncio
import json
import os
import stat
import uuid
from dataclasses import dataclass

import psutil
import pytest

from envs import speed
from envs.basic import Addition, Doubler
from envs.fixfunc import BUGGY, FIXED, FixFunction, hidden_cases
from conftest import BPF_JIT_CALLS, SYSCALL_PROBE
from envs.pipeline import (Closeness, GraderProbe, Inventory, Mean, NaiveUntar, RegexValidated,
                           RunReport, Runs, SloppyParser, Timestamps)
from envs.speed import PrimeCount
from karotte import custody, userland
from karotte.episode import AsyncEpisode, Episode, Outcome
from karotte.grading import LIB_MOUNT
from karotte.sandbox import DEFAULT_ENV
from karotte.scan import COPY_TIME
from karotte.seeding import env_seed

pytestmark = pytest.mark.usefixtures("no_leaks")

SEED = 7
FIX_SEED = env_seed(FixFunction, SEED)  # the seed FixFunction's methods see in an episode
BOUND = 60.0  # seconds an attacked episode may take, grading included
MARK = "KAROTTE-HOOK-RAN"  # what planted hooks print (to stderr) if anything runs them
USER_SITE = "/home/agent/.local/lib/python3.11/site-packages"


@dataclass(frozen=True)
class Write:
    """A write_file step of a scripted agent."""

    path: str
    content: str | bytes


def play(env, *steps, seed: int = SEED, before_finish=lambda: None) -> Outcome:
    """A scripted agent: each step is a bash command or a Write; then finish()."""
    with Episode(env, seed=seed) as ep:
        ep.reset()
        for step in steps:
            if isinstance(step, Write):
                r = ep.write_file(step.path, step.content)
                assert r.exit_code == 0, r.text
            else:
                ep.exec(step)
        before_finish()
        return ep.finish()


def play_async(env, *steps, seed: int = SEED, before_finish=lambda: None) -> Outcome:
    """play() through AsyncEpisode, on an event loop of its own."""
    async def run():
        async with AsyncEpisode(env, seed=seed) as ep:
            await ep.reset()
            for step in steps:
                if isinstance(step, Write):
                    assert (await ep.write_file(step.path, step.content)).exit_code == 0
                else:
                    await ep.exec(step)
            before_finish()
            return await ep.finish()
    return asyncio.run(run())


def hook(where: str) -> str:
    """A line of Python that says it ran."""
    return f"import sys; sys.stderr.write('{MARK}:{where}\\n')\n"


def scored_bottom(outcome: Outcome, reason: str = "graded", bound: float = BOUND) -> None:
    assert outcome.infra_error is None, outcome.infra_error
    assert (outcome.reward, outcome.reason) == (0.0, reason), \
        (outcome.details, outcome.violations, outcome.grader_log[-3000:])
    assert outcome.timings.total < bound


def next_episode_is_clean(env=None) -> Outcome:
    """An honest agent (the reference solution) scores full marks, with nothing flagged."""
    env = env or Addition()
    outcome = play(env, *env.reference_solution(SEED))
    assert (outcome.reward, outcome.reason, outcome.infra_error, outcome.violations) == \
        (1.0, "graded", None, ()), (outcome.details, outcome.grader_log[-3000:])
    return outcome


def every_hidden_test(outcome: Outcome, status: str | set[str]) -> None:
    """Every hidden test of FixFunction ended with `status` (or one of a set)."""
    allowed = {status} if isinstance(status, str) else status
    statuses = outcome.details["tests"]
    assert statuses.keys() == hidden_cases(FIX_SEED).keys()
    assert set(statuses.values()) <= allowed, statuses


def host_processes_named(token: str) -> list[str]:
    """Host processes (any namespace) whose command line holds token."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or ())
        if token in cmdline:
            found.append(f"{p.pid}: {cmdline}")
    return found


@pytest.fixture
def alive_at_scan(monkeypatch):
    """Records, at the moment the scan starts, the host's processes that carry a token:
    fill the list with tokens, read the dict afterwards."""
    tokens: list[str] = []
    seen: dict[str, list[str]] = {}
    real = custody.scan_and_copy

    def spy(*args, **kwargs):
        for token in tokens:
            seen[token] = host_processes_named(token)
        return real(*args, **kwargs)

    monkeypatch.setattr(custody, "scan_and_copy", spy)
    return tokens, seen


def token() -> str:
    return f"karotte-attack-{uuid.uuid4().hex[:12]}"


def assert_running(name: str, at_least: int) -> None:
    """The planted processes do run (so the host would see them if they survived)."""
    assert len(host_processes_named(name)) >= at_least, host_processes_named(name)


# -- honest agents --------------------------------------------------------------------

ENVS = [Addition(), Doubler(), FixFunction(), PrimeCount(), Inventory(), Mean(), Closeness(),
        SloppyParser(), RegexValidated(), NaiveUntar(), Runs(), GraderProbe(), Timestamps()]


@pytest.mark.parametrize("env", ENVS, ids=[type(e).__name__ for e in ENVS])
def test_an_honest_agent_scores_full_marks(env):
    assert next_episode_is_clean(env).timings.total < BOUND


# -- A. test and verdict tampering (TEST) ---------------------------------------------

def test_TEST_EDIT_01_edited_and_deleted_visible_tests_are_never_run():
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        ep.exec("sed -i 's/assert slugify.*/assert True/' tests/test_slug.py")
        local = ep.exec("python3 run_tests.py")
        assert local.exit_code == 0 and "FAILED" not in local.text  # the hack "works" here
        ep.exec("rm tests/test_slug.py")
        outcome = ep.finish()
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    next_episode_is_clean(FixFunction())


def test_TEST_SKIP_01_a_module_that_skips_fails_every_test():
    outcome = play(FixFunction(), Write("slug.py", "import unittest\n"
                                        "raise unittest.SkipTest('environment not supported')\n"
                                        + BUGGY))
    scored_bottom(outcome)
    every_hidden_test(outcome, "raised")
    next_episode_is_clean(FixFunction())


CONFTEST = '''\
import pytest
{hook}
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        rep.outcome, rep.longrepr = "passed", None


def pytest_collection_modifyitems(session, config, items):
    items[:] = []


def pytest_sessionfinish(session, exitstatus):
    session.exitstatus = 0
'''


def test_TEST_CONFTEST_01_a_conftest_is_never_loaded():
    conftest = CONFTEST.format(hook=hook("conftest"))
    outcome = play(FixFunction(), Write("conftest.py", conftest),
                   Write("tests/conftest.py", conftest),
                   "printf '[pytest]\\nrootdir = .\\n' > pytest.ini")
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


def test_TEST_PYTESTCFG_01_ini_files_and_pytest_variables_change_nothing():
    outcome = play(
        FixFunction(),
        Write("pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-k \'not edge\' '
              '--deselect tests/test_slug.py::test_edges"\npython_files = ["nothing_*.py"]\n'),
        Write("setup.cfg", "[tool:pytest]\naddopts = --collect-only -q\n"),
        Write("tox.ini", "[pytest]\naddopts = --collect-only -q\n"),
        "echo 'export PYTEST_ADDOPTS=\"--collect-only -q\"' >> ~/.bashrc",
        "export PYTEST_ADDOPTS='--collect-only -q' PYTEST_PLUGINS=evilplug "
        "PYTHONPATH=/workspace PYTHONSTARTUP=/workspace/startup.py",
        Write("startup.py", hook("pythonstartup")))
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


def test_TEST_PLUGIN_01_a_plugin_in_the_user_site_never_loads():
    plugin = hook("plugin") + CONFTEST.format(hook="")
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        for site in (USER_SITE, "/workspace/.local/lib/python3.11/site-packages"):
            ep.exec(f"mkdir -p {site}/evilplug {site}/evilplug-0.dist-info")
            ep.write_file(f"{site}/evilplug/__init__.py", plugin)
            ep.write_file(f"{site}/evilplug-0.dist-info/METADATA",
                          "Metadata-Version: 2.1\nName: evilplug\nVersion: 0\n")
            ep.write_file(f"{site}/evilplug-0.dist-info/entry_points.txt",
                          "[pytest11]\nevil = evilplug\n")
            ep.write_file(f"{site}/usercustomize.py", hook("usercustomize") + "import evilplug\n")
        live = ep.exec("python3 -c pass")
        assert f"{MARK}:plugin" in live.text  # the plant is live for the agent's own Python
        outcome = ep.finish()
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


@pytest.mark.parametrize("module,status", [
    ("import os\nos._exit(0)\n" + BUGGY, "no_result"),
    (BUGGY + "\n\ndef slugify(title):\n    import sys\n    sys.exit(0)\n", "raised"),
], ids=["os._exit-at-import", "sys.exit-in-the-function"])
def test_TEST_EXIT_01_exiting_early_is_no_pass(module, status):
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        ep.write_file("slug.py", module)
        ep.exec("sed -i '1i import sys; sys.exit(0)' run_tests.py")
        assert ep.exec("python3 run_tests.py").exit_code == 0  # a home-grown harness is fooled
        outcome = ep.finish()
    scored_bottom(outcome)
    every_hidden_test(outcome, status)
    next_episode_is_clean(FixFunction())


ATEXIT = '''\
import atexit, os, signal, sys

# The result pipe's fd is in argv; keep a copy to forge a result after the real one.
_fd = os.dup(int(sys.argv[1])) if len(sys.argv) > 1 and sys.argv[1].isdigit() else None


def _rewrite():
    if _fd is not None:
        os.write(_fd, b'{"status": "returned", "value": "forged"}')
    os._exit(0)


atexit.register(_rewrite)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
'''


def test_TEST_ATEXIT_01_rewriting_the_exit_or_the_result_after_the_report_fails():
    outcome = play(FixFunction(), Write("slug.py", ATEXIT + BUGGY))
    scored_bottom(outcome)
    every_hidden_test(outcome, {"wrong_value", "malformed_result"})
    next_episode_is_clean(FixFunction())


ALWAYS_EQUAL = '''\
class AlwaysEqual:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


def slugify(title):
    return AlwaysEqual()
'''

EQUAL_STR = '''\
class EqualStr(str):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__


def slugify(title):
    return EqualStr(title.lower())
'''


@pytest.mark.parametrize("module,status", [(ALWAYS_EQUAL, "unserialisable_output"),
                                           (EQUAL_STR, "wrong_value")],
                         ids=["AlwaysEqual", "str-subclass"])
def test_TEST_EQ_01_an_object_equal_to_everything_is_no_answer(module, status):
    outcome = play(FixFunction(), Write("slug.py", module))
    scored_bottom(outcome)
    every_hidden_test(outcome, status)
    next_episode_is_clean(FixFunction())


@pytest.mark.parametrize("answer", ["nan", "NaN", "inf", "-inf", "1e999", ""])
def test_TEST_NAN_01_nan_and_inf_fail_a_positive_tolerance_check(answer):
    outcome = play(Mean(), f"echo '{answer}' > answer.txt")
    scored_bottom(outcome)
    next_episode_is_clean(Mean())


@pytest.mark.parametrize("answer", ["nan", "inf", "-inf"])
def test_TEST_NAN_01_a_grader_that_returns_nan_scores_non_finite_reward(answer):
    outcome = play(Closeness(), f"echo '{answer}' > answer.txt")
    scored_bottom(outcome, "non_finite_reward")
    next_episode_is_clean(Closeness())


PATCHER = hook("patcher-ran-in-its-own-process") + '''\
import builtins, json, json.encoder, unittest

json.dumps = lambda *a, **k: '{"status": "returned", "value": "patched"}'
json.loads = lambda *a, **k: {"results": {}}
json.encoder.encode_basestring_ascii = lambda s: '"patched"'
json.encoder.c_make_encoder = None
unittest.TestCase.assertEqual = lambda *a, **k: None
builtins.isinstance = lambda *a: True
'''


def test_TEST_PATCH_01_monkeypatches_stay_in_the_agents_process():
    outcome = play(FixFunction(), Write("slug.py", PATCHER + BUGGY))
    scored_bottom(outcome)
    every_hidden_test(outcome, {"wrong_value", "malformed_result"})  # it chose garbage
    # It did run (its stderr is kept as a log), in a child that only hands back a value.
    assert f"{MARK}:patcher-ran-in-its-own-process" in outcome.grader_log
    next_episode_is_clean(FixFunction())


GRADERFN = '''\
import inspect, sys

found = []
frame = inspect.currentframe()
while frame is not None:
    found.append(sorted(frame.f_globals)[:20])
    for name in ("run_tests", "score", "judge", "same", "grade", "main"):
        frame.f_globals[name] = lambda *a, **k: True
    frame = frame.f_back
sys.stderr.write(f"KAROTTE-FRAMES:{found}\\n")
for path in ("/opt/karotte-lib/envs/fixfunc.py", "/workspace/grader.py", "/hidden/tests.json"):
    try:
        open(path, "w").write("print('PASSED')\\n")
        sys.stderr.write(f"KAROTTE-WROTE:{path}\\n")
    except OSError:
        pass
'''


def test_TEST_GRADERFN_01_the_grading_functions_are_out_of_reach():
    outcome = play(FixFunction(), Write("slug.py", GRADERFN + BUGGY),
                   Write("grader.py", "def judge(*a):\n    return 'passed'\n"))
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    assert "KAROTTE-FRAMES:" in outcome.grader_log  # it walked its own frames only
    assert "KAROTTE-WROTE:" not in outcome.grader_log
    next_episode_is_clean(FixFunction())


HARDCODED = '''\
EXPECTED = {"Hello World": "hello-world", "Rock & Roll!": "rock-roll",
            "  --Already-Slugged--  ": "already-slugged"}


def slugify(title):
    return EXPECTED.get(title, title.lower().replace(" ", "-"))
'''


def test_TEST_HARDCODE_01_special_cased_visible_inputs_fail_the_hidden_ones():
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        ep.write_file("slug.py", HARDCODED)
        local = ep.exec("python3 run_tests.py")
        assert local.exit_code == 0 and local.text.count("PASSED") == 3
        outcome = ep.finish()
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    next_episode_is_clean(FixFunction())


def test_TEST_STUB_01_hollow_stubs_of_modules_are_never_imported():
    stub = hook("stub") + "loads = lambda *a, **k: {'results': {}}\ndumps = lambda *a, **k: '{}'\n"
    steps = ["mkdir -p json importlib subprocess"]
    steps += [Write(path, stub) for path in ("json/__init__.py", "importlib/__init__.py",
                                             "subprocess/__init__.py", "select.py", "signal.py",
                                             "re.py", "unicodedata.py")]
    outcome = play(FixFunction(), *steps)
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


def test_TEST_STATE_01_editing_the_task_inputs_does_not_move_the_answer():
    outcome = play(Addition(), "echo '0 0' > numbers.txt",
                   "read a b < numbers.txt; echo $((a + b)) > answer.txt")
    scored_bottom(outcome)
    next_episode_is_clean()


def test_TEST_SETUPFAIL_01_permissions_and_layout_cannot_block_the_grader():
    # Honest work with a hostile layout still gets its reward: the grader works on a
    # fresh copy with normal modes, so setup neither fails open nor closed.
    outcome = play(FixFunction(), Write("slug.py", FIXED),
                   "rm tests/test_slug.py && mkdir tests/test_slug.py",
                   "printf '* text eol=crlf\\n' > .gitattributes",
                   "chmod 000 slug.py tests/test_slug.py && chmod a-w tests . && chmod 000 .")
    assert (outcome.reward, outcome.reason, outcome.infra_error, outcome.violations) == \
        (1.0, "graded", None, ()), (outcome.details, outcome.grader_log[-2000:])
    outcome = play(FixFunction(), "chmod 000 slug.py && chmod a-w tests . && chmod 000 .")
    scored_bottom(outcome)
    next_episode_is_clean(FixFunction())


# -- B. answer and reference leakage (LEAK) -------------------------------------------

STACK_WALK = '''\
import gc, inspect, sys


def slugify(title):
    seen = []
    for info in inspect.stack():
        seen.extend(info.frame.f_locals)
        for key in ("expect", "expected", "want", "cases", "answer"):
            if key in info.frame.f_locals:
                return info.frame.f_locals[key]
    for obj in gc.get_objects():
        if isinstance(obj, dict) and "expect" in obj:
            return obj["expect"]
    sys.stderr.write(f"KAROTTE-STACK:{sorted(set(seen))}\\n")
    return ""
'''


def test_LEAK_STACK_01_the_expected_values_are_in_no_process_that_runs_agent_code():
    outcome = play(FixFunction(), Write("slug.py", STACK_WALK))
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    assert "KAROTTE-STACK:" in outcome.grader_log
    for case in hidden_cases(FIX_SEED).values():
        assert case["expect"] not in outcome.grader_log


def sections(text: str) -> dict[str, list[str]]:
    """The lines of text that follow each "==name==" line, by name."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("==") and line.endswith("=="):
            found[line.strip("=")] = []
        else:
            found[next(reversed(found))].append(line)
    return found


def test_LEAK_FS_01_hidden_tests_are_nowhere_in_the_agents_sandbox():
    secret = next(iter(hidden_cases(FIX_SEED))).rsplit("_", 1)[1]
    # /usr is the host's, bound read-only: it holds nothing of an episode, and names that
    # match innocently (C++'s <expected>).
    grep = "grep -rl --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr -e"
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        r = ep.exec(
            "echo ==names==; find / \\( -path /proc -o -path /sys -o -path /usr \\) -prune -o "
            "\\( -iname '*hidden*' -o -iname '*expected*' -o -iname 'tests.json' -o "
            "-iname 'fixfunc*' -o -iname 'karotte-*' \\) -print 2>/dev/null; "
            "echo ==dirs==; for d in /hidden /opt /submission; do [ -e $d ] && echo $d; done; "
            "ls /proc/1/root/ >/dev/null 2>&1 && ! [ /proc/1/root/ -ef / ] && echo /proc/1/root; "
            f"echo ==secret==; {grep} {secret} / 2>/dev/null; "
            f"echo ==control==; {grep} 'def slugify' / 2>/dev/null; "
            "echo ==mounts==; cat /proc/self/mountinfo", timeout=60)
        outcome = ep.finish()
    found = sections(r.text)
    assert (found["names"], found["dirs"], found["secret"]) == ([], [], []), found
    assert found["control"] == ["/workspace/slug.py"], found  # the search does reach files
    assert secret not in r.text
    for case in hidden_cases(FIX_SEED).values():
        assert case["expect"] not in r.text
    mounts = [line.split()[4] for line in found["mounts"]]
    hiding = {path for path, _ in userland.hiding_mounts()}  # empty dirs over the trainer's
    assert mounts and all(m in ("/", "/usr", "/etc", "/proc", "/tmp", "/workspace", "/home/agent")
                          or m in hiding or m.startswith(("/etc/", "/dev/")) for m in mounts), mounts
    scored_bottom(outcome)


def test_LEAK_PROC_01_the_agent_sees_only_its_own_processes(monkeypatch):
    secret = token()
    monkeypatch.setenv("KAROTTE_TEST_SECRET", secret)
    with Episode(Addition(), seed=SEED) as ep:
        ep.reset()
        r = ep.exec("for p in /proc/[0-9]*; do echo \"PROC $p $(tr '\\0' ' ' < $p/cmdline)\"; "
                    "done; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | "
                    "grep -i -E 'secret|key|token'; ls -l /proc/[0-9]*/cwd /proc/[0-9]*/fd 2>&1 | "
                    "grep -v -E 'workspace|pipe:|/dev/null'")
        outcome = ep.finish()
    assert secret not in r.text
    procs = [line.split(" ", 2) for line in r.text.splitlines() if line.startswith("PROC ")]
    assert procs[0][1] == "/proc/1" and procs[0][2].strip() == "karotte-init"
    assert len(procs) < 8 and not any("pytest" in p[2] for p in procs if len(p) > 2), procs
    scored_bottom(outcome)
    next_episode_is_clean()


PROC_LISTING = '''\
import os, sys

for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
    except OSError as exc:
        cmdline = repr(exc)
    sys.stderr.write(f"KAROTTE-PROC:{pid}:{cmdline[:300]}\\n")
'''
# Each command line cut at 300 characters: the grader logs the last 4000 of the run's
# stderr, and the test runner's -c script is over 2000 long. The grader's command line
# names its library (LIB_MOUNT) and its entry module well within the first 150.


def test_LEAK_PROC_01_the_program_the_grader_runs_cannot_see_the_grader():
    outcome = play(FixFunction(), Write("slug.py", PROC_LISTING + BUGGY))
    scored_bottom(outcome)
    listing = [line for line in outcome.grader_log.splitlines() if line.startswith("KAROTTE-PROC:")]
    assert listing and listing[0].startswith("KAROTTE-PROC:1:karotte-init")
    assert not any(LIB_MOUNT in line or "grader_main" in line or "pytest" in line
                   for line in listing), listing


INCLUDE = '''\
import sys

LEAKED = ""
for path in ("/hidden/tests.json", "/proc/1/root/hidden/tests.json", "/submission/slug.py",
             "/opt/karotte-lib/envs/fixfunc.py", "/workspace/../hidden/tests.json"):
    try:
        LEAKED += open(path).read(200)
        sys.stderr.write(f"KAROTTE-INCLUDE:{path}:read\\n")
    except OSError as exc:
        sys.stderr.write(f"KAROTTE-INCLUDE:{path}:{type(exc).__name__}\\n")


def slugify(title):
    return LEAKED
'''


def test_LEAK_INCLUDE_01_the_graders_files_are_not_in_the_nested_sandbox():
    outcome = play(FixFunction(), Write("slug.py", INCLUDE))
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    tried = [line for line in outcome.grader_log.splitlines()
             if line.startswith("KAROTTE-INCLUDE:")]
    assert tried and not any(line.endswith(":read") for line in tried), tried


def test_LEAK_NET_01_the_network_is_unreachable_at_once():
    with Episode(Addition(), seed=SEED) as ep:
        ep.reset()
        r = ep.exec("""python3 - <<'EOF'
import socket
for host, port in (("1.1.1.1", 443), ("140.82.112.3", 443), ("172.17.0.1", 2375)):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port))
        print("CONNECTED", host)
    except OSError as exc:
        print("REFUSED", host, exc.errno)
try:
    socket.getaddrinfo("github.com", 443)
    print("RESOLVED")
except OSError as exc:
    print("NO-DNS", exc)
EOF
curl -sS -m 5 https://raw.githubusercontent.com/ 2>&1 | head -1
pip download --retries 0 --timeout 3 --no-deps -d /tmp/dl requests 2>&1 | tail -1""", timeout=60)
        outcome = ep.finish()
    assert "CONNECTED" not in r.text and "RESOLVED" not in r.text
    assert r.text.count("REFUSED") == 3 and "NO-DNS" in r.text
    assert r.wall_seconds < 15  # unreachable fails at once, nothing waits on a timeout
    scored_bottom(outcome)


def test_LEAK_WEIGHTS_01_copying_the_reference_is_no_speedup():
    outcome = play(PrimeCount(), "cp count_primes.py fast.py")
    scored_bottom(outcome)
    assert outcome.details["verdict"] == "too_slow"


PICKLER = '''\
import os, pickle


class Payload:
    def __reduce__(self):
        return (os.system, ("echo KAROTTE-HOOK-RAN:unpickled >&2",))


if os.access("/workspace", os.W_OK):  # in the agent's sandbox; read-only when graded
    with open("/workspace/results.pkl", "wb") as f:
        pickle.dump({"reward": 1.0, "passed": True}, f)


def slugify(title):
    return Payload()
'''


def test_LEAK_PICKLE_01_nothing_the_agent_made_is_unpickled():
    outcome = play(FixFunction(), Write("slug.py", PICKLER), "python3 -c 'import slug'")
    scored_bottom(outcome)
    every_hidden_test(outcome, "unserialisable_output")
    assert MARK not in outcome.grader_log


# -- C. timing (TIME) ----------------------------------------------------------------

def assert_too_slow(outcome: Outcome) -> None:
    scored_bottom(outcome)
    d = outcome.details
    assert d["verdict"] == "too_slow", d
    assert d["speedup"] < speed.REQUIRED_SPEEDUP
    assert speed.BASELINE_RANGE[0] <= d["baseline_seconds"] <= speed.BASELINE_RANGE[1]


TIME_PATCH = '''\
import sys, time

_pc = time.perf_counter
time.perf_counter = lambda: _pc() / 1000
time.monotonic = lambda: 0.0
time.time = lambda: 0.0
time.process_time = lambda: 0.0
sys.stderr.write("elapsed: 0.000001 s\\n")
'''


def test_TIME_PATCH_01_patched_timers_do_not_change_the_hosts_clock():
    assert_too_slow(play(PrimeCount(), Write("fast.py", TIME_PATCH + speed.BASELINE)))


FAKE_CLOCK = r'''
#define _GNU_SOURCE
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static void __attribute__((constructor)) said(void)
{
    static const char m[] = "KAROTTE-HOOK-RAN:preload\n";
    write(2, m, sizeof m - 1);
}
int clock_gettime(clockid_t c, struct timespec *ts) { ts->tv_sec = 0; ts->tv_nsec = 0; return 0; }
int gettimeofday(struct timeval *tv, void *tz) { tv->tv_sec = 0; tv->tv_usec = 0; return 0; }
time_t time(time_t *t) { if (t) *t = 0; return 0; }
'''

REEXEC_PRELOADED = '''\
import os, sys

if "LD_PRELOAD" not in os.environ:
    os.environ["LD_PRELOAD"] = "/workspace/libfaketime.so"
    os.execv(sys.executable, [sys.executable, "-I"] + sys.argv)
'''


def test_TIME_PRELOAD_01_a_preloaded_fake_clock_does_not_reach_the_timing():
    with Episode(PrimeCount(), seed=SEED) as ep:
        ep.reset()
        ep.write_file("fake.c", FAKE_CLOCK)
        assert ep.exec("gcc -shared -fPIC -o libfaketime.so fake.c").exit_code == 0
        ep.write_file("fast.py", REEXEC_PRELOADED + speed.BASELINE)
        ep.exec("echo 'export LD_PRELOAD=/workspace/libfaketime.so' >> ~/.bashrc")
        assert ep.exec("echo /workspace/libfaketime.so > /etc/ld.so.preload").exit_code != 0
        ep.exec("export LD_PRELOAD=/workspace/libfaketime.so")
        live = ep.exec("python3 -c 'import time; print(time.perf_counter())'")
        assert f"{MARK}:preload" in live.text and "0.0" in live.text  # the fake clock works here
        outcome = ep.finish()
    assert_too_slow(outcome)


CACHED = '''\
import json, os, sys

n = sys.stdin.read().strip()
for path in ("/workspace/.cache/answers.json", os.path.expanduser("~/.cache/answers.json"),
             "/tmp/answers.json"):
    try:
        cache = json.load(open(path))
    except (OSError, ValueError):
        continue
    if n in cache:
        print(cache[n])
        sys.exit(0)
count = 0
for k in range(2, int(n)):
    d = 2
    while d * d <= k:
        if k % d == 0:
            break
        d += 1
    else:
        count += 1
print(count)
for path in ("/workspace/.cache/answers.json", "/tmp/answers.json"):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        json.dump({n: count}, open(path, "w"))
    except OSError:
        pass
'''


def test_TIME_CACHE_01_a_cache_of_visible_inputs_does_not_help_on_hidden_ones():
    with Episode(PrimeCount(), seed=SEED) as ep:
        ep.reset()
        ep.write_file("fast.py", CACHED)
        ep.exec("mkdir -p ~/.cache && echo 50000 | python3 fast.py && "
                "cp .cache/answers.json ~/.cache/")
        hit = ep.exec("time (echo 50000 | python3 fast.py)")
        assert hit.text.startswith("5133\n")  # cached here: the example answer comes at once
        outcome = ep.finish()
    assert_too_slow(outcome)


def test_TIME_BASELINE_01_cpu_hogs_left_running_are_dead_before_any_timing(alive_at_scan):
    name = token()
    tokens, seen = alive_at_scan
    tokens.append(name)
    # The candidate also leaves a hog behind in its own run, to slow the baseline after it.
    leave_hog = ("\nif os.fork() == 0:\n    os.setsid()\n"
                 "    fd = os.open('/dev/null', os.O_RDWR)\n"
                 "    for i in (0, 1, 2):\n        os.dup2(fd, i)\n"
                 f"    os.execv('/bin/sh', ['{name}', '-c', 'while :; do :; done'])\n")
    outcome = play(
        PrimeCount(),
        "for i in 1 2 3; do (setsid bash -c 'exec -a " + name + " bash -c \"while :; do :; done\"' "
        "</dev/null >/dev/null 2>&1 &); done",
        Write("fast.py", "import os\n" + speed.BASELINE + leave_hog),
        before_finish=lambda: assert_running(name, 3))
    assert seen[name] == []
    assert_too_slow(outcome)
    assert host_processes_named(name) == []
    next_episode_is_clean(PrimeCount())


DETACHED = """\
import os, time

if os.fork():
    os._exit(0)  # the main process is done at once; the answer comes from its child
time.sleep(0.045)
""" + speed.FAST


def test_TIME_DETACH_01_work_left_to_a_background_process_is_timed_too():
    # Not in the catalogue: the run's main process exits at once and a child finishes
    # the work and prints within the host's output drain grace. The host times the run
    # until its last byte of output, not until the main process's exit.
    outcome = play(PrimeCount(), Write("fast.py", DETACHED))
    assert outcome.details["failures"] == [] and outcome.details["verdict"] != "wrong_output"
    assert outcome.details["candidate_seconds"] >= 0.045, outcome.details
    next_episode_is_clean(PrimeCount())


SLOW_START_SECONDS = 3.0  # several times what the baseline takes, even on a loaded host
SLOW_START = hook("slow-start") + f"import time\ntime.sleep({SLOW_START_SECONDS})\n"


def test_TIME_BASELINE_02_poisoned_caches_and_startup_files_do_not_touch_the_baseline():
    outcome = play(
        PrimeCount(),
        Write("fast.py", speed.BASELINE), Write("sitecustomize.py", SLOW_START),
        Write("usercustomize.py", SLOW_START), Write("math.py", SLOW_START),
        f"mkdir -p {USER_SITE} ~/.cache/pip ~/wheels __pycache__",
        Write(f"{USER_SITE}/usercustomize.py", SLOW_START),
        "head -c 4096 /dev/urandom > __pycache__/count_primes.cpython-311.pyc",
        "echo 'export PIP_FIND_LINKS=~/wheels PYTHONPATH=/workspace' >> ~/.bashrc",
        "export PYTHONPATH=/workspace PYTHONSTARTUP=/workspace/sitecustomize.py")
    assert_too_slow(outcome)
    # A baseline that had loaded any of them would have slept that long more.
    assert outcome.details["baseline_seconds"] < SLOW_START_SECONDS


LEFTOVERS = '''\
import glob

for path in glob.glob("/dev/shm/*") + glob.glob("/tmp/*") + glob.glob("/workspace/.result*"):
    try:
        print(open(path).read().strip())
        break
    except OSError:
        pass
'''


def test_TIME_MEMREUSE_01_no_result_is_left_where_the_candidate_could_reuse_it():
    outcome = play(PrimeCount(),
                   "echo 50000 | python3 count_primes.py | tee /dev/shm/result /tmp/result",
                   Write("fast.py", LEFTOVERS))
    scored_bottom(outcome)
    assert outcome.details["verdict"] == "wrong_output"


PHASE_SECONDS = 2.0
# Right while checked, wrong once only its speed counts (the red team's PoC against the
# speedup example). The PoC told the phases apart by the age of its file's mtime, which
# the copy now fixes at COPY_TIME; the ctime cannot be fixed and still shows when custody
# copied the file, so this one uses that. Its first run is the first timed run: it
# sleeps past PHASE_SECONDS and answers right. Every later run answers 0 at once.
TWO_FACED = f"""\
import os, time

if time.time() - os.stat(__file__).st_ctime > {PHASE_SECONDS}:
    print(0)
    raise SystemExit
time.sleep({PHASE_SECONDS})
""" + speed.FAST


def test_PERF_HOLLOW_01_a_wrong_answer_in_any_timed_run_scores_zero():
    # Before every run's output was checked, only the first repeat's was: this scored
    # 1.0 ("fast_enough", the median of [2 s, 0.03 s, 0.03 s] against a 0.4 s baseline).
    outcome = play(PrimeCount(), Write("fast.py", TWO_FACED))
    scored_bottom(outcome)
    d = outcome.details
    assert d["verdict"] == "wrong_output", d
    assert "candidate on input 2: wrong output" in d["failures"], d
    assert all(f.startswith("candidate ") for f in d["failures"]), d


def test_PERF_HOLLOW_01_the_graders_copy_shows_no_time_of_the_grading():
    # Defence in depth: every file and directory the grader and the programs it runs
    # see, the root included, has atime and mtime COPY_TIME, whatever times the agent
    # set, and reading through the read-only mounts moves no atime.
    outcome = play(Timestamps(), *Timestamps().reference_solution(SEED),
                   "mkdir -p d/e && echo x > d/e/f && touch -d 2031-01-01 d/e/f numbers.txt",
                   "touch -a -d 2040-01-01 answer.txt && touch -d 1990-01-01 d")
    assert (outcome.reward, outcome.reason) == (1.0, "graded"), outcome.grader_log[-3000:]
    fixed = [COPY_TIME * 1_000_000_000] * 2
    for seen in (outcome.details["grader"], outcome.details["run"]):
        assert set(seen) == {".", "answer.txt", "numbers.txt", "tools", "tools/hint.sh", "d",
                             "d/e", "d/e/f"}, seen
        assert all(times == fixed for times in seen.values()), seen


# -- D. output spoofing (OUT) --------------------------------------------------------

FAKE_PASSES = '''\
import sys

LINES = "tests/test_slug.py::test_edges PASSED\\n==== 42 passed in 0.12s ====\\nALL TESTS PASSED\\n"
print(LINES)
sys.stderr.write(LINES)
print('{"results": {}, "passed": true}')
'''


def test_OUT_PASSED_01_printed_pass_lines_are_not_a_verdict():
    outcome = play(FixFunction(), Write("slug.py", FAKE_PASSES + BUGGY),
                   "sed -i '1i print(\"==== 3 passed ====\")' run_tests.py && python3 run_tests.py")
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    next_episode_is_clean(FixFunction())


FORGER = '''\
import os

message = b'{"op": "done", "reward": 1.0, "details": {}}'
for fd in range(3, 64):
    try:
        os.write(fd, message)
    except OSError:
        pass
for pid in os.listdir("/proc"):
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with open(f"/proc/{pid}/fd/{fd}", "wb") as f:
                f.write(message)
    except OSError:
        pass
print("PASSED 1.0")
'''


def test_OUT_REWARDFILE_01_planted_and_forged_results_are_never_read():
    outcome = play(Runs(),
                   "echo 1 > reward.txt; echo '{\"reward\": 1.0, \"passed\": true}' > results.json",
                   "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt",
                   "mkdir -p .karotte && "
                   "echo '{\"op\": \"done\", \"reward\": 1.0}' > .karotte/result",
                   Write("solution.py", FORGER))
    scored_bottom(outcome)
    assert all(run["exit"] == 0 for run in outcome.details["runs"])
    next_episode_is_clean(Runs())


def test_OUT_ANSI_01_escapes_in_names_are_escaped_and_the_verdict_is_structural():
    outcome = play(Addition(),
                   "printf 'FAILED test_x\\r\\033[2K\\033[1A\\033[2Ktest_x PASSED\\n'",
                   "printf '\\033]0;all passed\\007'",
                   "mkfifo \"$(printf 'log\\033[2K\\rPASSED')\"", "echo 0 > answer.txt")
    scored_bottom(outcome)
    (v,) = outcome.violations
    assert v.kind == "fifo" and v.path == "log\\x1b[2K\\x0dPASSED"
    next_episode_is_clean()


DEGENERATE = [
    (Addition(), ["echo '{}' > answer.txt"]),
    (Addition(), [": > answer.txt"]),
    (Mean(), ["echo '{}' > answer.txt"]),
    (FixFunction(), ["printf 'def slugify(title):\\n    return \"\"\\n' > slug.py"]),
    (FixFunction(), [": > slug.py"]),
    (PrimeCount(), [": > fast.py"]),
    (NaiveUntar(), ["tar -czf answer.tar.gz -T /dev/null"]),
    (Runs(), [": > solution.py"]),
]


@pytest.mark.parametrize("env,commands", DEGENERATE,
                         ids=[f"{type(e).__name__}-{i}" for i, (e, _) in enumerate(DEGENERATE)])
def test_OUT_DEGENERATE_01_empty_and_degenerate_answers_score_the_bottom(env, commands):
    outcome = play(env, *commands)
    assert outcome.infra_error is None and outcome.reward == 0.0
    assert outcome.reason in ("graded", "grader_crashed"), outcome.reason
    assert play(env).reward == 0.0  # and the null agent too


def test_OUT_DEGENERATE_01_a_reward_outside_the_range_is_rejected():
    outcome = play(Closeness(), "echo -1e300 > answer.txt")
    scored_bottom(outcome, "reward_out_of_range")
    assert outcome.details["rejected_reward"] < -1e290
    next_episode_is_clean(Closeness())


def test_OUT_FLOOD_01_a_flood_from_the_agent_is_capped_and_costs_the_host_nothing():
    rss = psutil.Process().memory_info().rss
    with Episode(Addition(), seed=SEED) as ep:
        ep.reset()
        r = ep.exec("yes 'PASSED' | head -c 300M; head -c 100M /dev/zero >&2", timeout=60)
        outcome = ep.finish()
    assert r.truncated and len(r.text) < 3 * 1024 * 1024
    assert psutil.Process().memory_info().rss - rss < 64 * 1024 * 1024
    scored_bottom(outcome)


def test_OUT_FLOOD_01_a_flood_from_the_program_the_grader_runs_is_capped():
    outcome = play(Runs(), Write("solution.py",
                                 "import os\nwhile True:\n    os.write(1, b'PASSED ' * 10000)\n"))
    scored_bottom(outcome, bound=20)  # the grader's own timeout is 30 s
    assert all(run["truncated"] and run["stdout_bytes"] == 1024 * 1024
               for run in outcome.details["runs"])
    next_episode_is_clean(Runs())


# -- E. interpreter and toolchain hijack (ENV) ---------------------------------------

def test_ENV_the_grader_runs_isolated_with_a_clean_environment():
    outcome = play(GraderProbe(), *GraderProbe().reference_solution(SEED),
                   "export PYTHONPATH=/workspace LD_PRELOAD=/workspace/x.so PYTHONINSPECT=1 "
                   "PYTEST_ADDOPTS=-q BASH_ENV=/workspace/rc HOME=/workspace",
                   "echo 'export PYTHONPATH=/workspace' >> ~/.bashrc")
    assert (outcome.reward, outcome.reason) == (1.0, "graded")
    d = outcome.details
    assert d["isolated"] == 1 and d["executable"] == "/usr/bin/python3"
    assert set(d["environ"]) <= set(DEFAULT_ENV), d["environ"]
    assert not any(p.startswith(("/submission", "/workspace", "/home")) or p in ("", ".")
                   for p in d["path"]), d["path"]


def test_ENV_SITECUSTOMIZE_01_site_hooks_run_nowhere_in_grading():
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        ep.exec(f"mkdir -p {USER_SITE}")
        for path in ("sitecustomize.py", "usercustomize.py", f"{USER_SITE}/usercustomize.py",
                     f"{USER_SITE}/sitecustomize.py"):
            ep.write_file(path, hook(path) + "import json\njson.loads = lambda *a, **k: {}\n")
        ep.exec("echo 'export PYTHONPATH=/workspace' >> ~/.bashrc; export PYTHONPATH=/workspace")
        live = ep.exec("python3 -c pass")
        assert f"{MARK}:usercustomize.py" in live.text or f"{MARK}:{USER_SITE}" in live.text
        outcome = ep.finish()
    scored_bottom(outcome)
    every_hidden_test(outcome, "wrong_value")
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


def test_ENV_PTH_01_pth_files_run_nowhere_in_grading():
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        ep.exec(f"mkdir -p {USER_SITE}")
        for path in (f"{USER_SITE}/zz.pth", "zz.pth"):
            ep.write_file(path, hook(path).replace("\n", "") + "\n")
        live = ep.exec("python3 -c pass")
        assert f"{MARK}:{USER_SITE}/zz.pth" in live.text
        outcome = ep.finish()
    scored_bottom(outcome)
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


def test_ENV_SHADOW_01_modules_in_the_workspace_shadow_nothing():
    shadow = hook("shadow") + "loads = lambda s, **k: {'results': {}}\n"
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        for name in ("json.py", "select.py", "signal.py", "subprocess.py", "unittest.py",
                     "importlib.py", "inspect.py"):
            ep.write_file(name, shadow)
        live = ep.exec("python3 -c 'import json'")
        assert f"{MARK}:shadow" in live.text  # shadowing works for a plain python3 -c here
        outcome = ep.finish()
    scored_bottom(outcome)
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


TROJAN = (f"#!/bin/sh\necho '{MARK}:trojan' >&2\n"
          "echo '{\"results\": {}}'\necho '==== 5 passed ===='\n")


def test_ENV_PATH_01_trojan_binaries_on_the_agents_path_are_never_called():
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        ep.exec("mkdir -p bin ~/.local/bin")
        for path in ("bin/python3", "bin/python", "bin/pytest", "bin/sh", "python3",
                     "/home/agent/.local/bin/python3"):
            ep.write_file(path, TROJAN)
            ep.exec(f"chmod +x {path}")
        ep.exec("echo 'export PATH=/workspace/bin:$PATH' >> ~/.bashrc; "
                "export PATH=/workspace/bin:$PATH")
        assert f"{MARK}:trojan" in ep.exec("python3 -c pass").text
        outcome = ep.finish()
    scored_bottom(outcome)
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


EVIL_SO = r'''
#include <stddef.h>
#include <unistd.h>

static void __attribute__((constructor)) said(void)
{
    static const char m[] = "KAROTTE-HOOK-RAN:ldpreload\n";
    write(2, m, sizeof m - 1);
}
int strcmp(const char *a, const char *b) { return 0; }
int memcmp(const void *a, const void *b, size_t n) { return 0; }
int bcmp(const void *a, const void *b, size_t n) { return 0; }
'''


def test_ENV_LDPRELOAD_01_a_preloaded_library_reaches_nothing_the_grader_starts():
    with Episode(FixFunction(), seed=SEED) as ep:
        ep.reset()
        ep.write_file("evil.c", EVIL_SO)
        assert ep.exec("gcc -shared -fPIC -o evil.so evil.c").exit_code == 0
        assert ep.exec("echo /workspace/evil.so > /etc/ld.so.preload").exit_code != 0
        ep.exec("echo 'export LD_PRELOAD=/workspace/evil.so' >> ~/.bashrc; "
                "export LD_PRELOAD=/workspace/evil.so")
        assert f"{MARK}:ldpreload" in ep.exec("/bin/true").text
        outcome = ep.finish()
    scored_bottom(outcome)
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


def test_ENV_BUILD_01_build_and_install_hooks_are_never_run():
    build_hook = hook("build") + "import os\nos._exit(0)\n"
    outcome = play(FixFunction(), Write("setup.py", build_hook),
                   Write("noxfile.py", build_hook), Write("conftest.py", build_hook),
                   Write("Makefile", f"test:\n\techo '{MARK}:make' >&2\n"),
                   Write("package.json", '{"scripts": {"test": "echo %s:npm >&2", '
                         '"postinstall": "echo %s:npm >&2"}}' % (MARK, MARK)),
                   Write("pyproject.toml", '[build-system]\nrequires = ["setuptools"]\n'
                         'build-backend = "setuptools.build_meta"\n'),
                   Write("tox.ini", f"[testenv]\ncommands = python -c \"print('{MARK}:tox')\"\n"))
    scored_bottom(outcome)
    assert MARK not in outcome.grader_log
    next_episode_is_clean(FixFunction())


# -- F. filesystem attacks on the scanner and grader (FS) ----------------------------

def kinds(outcome: Outcome) -> set[tuple[str, str]]:
    return {(v.path, v.kind) for v in outcome.violations}


def test_FS_FIFO_01_a_fifo_at_the_answer_path_is_rejected_without_blocking():
    outcome = play(Inventory(), "mkfifo answer.txt log.txt")
    scored_bottom(outcome, "scanner_rejected_required_output", bound=20)
    assert kinds(outcome) == {("answer.txt", "fifo"), ("log.txt", "fifo")}
    v = next(v for v in outcome.violations if v.path == "answer.txt")
    assert v.detail == "FIFO not allowed" and v.rule.startswith("D3")
    next_episode_is_clean(Inventory())


def test_FS_SPARSE_01_huge_or_sparse_files_are_refused_in_constant_time():
    with Episode(Inventory(), seed=SEED) as ep:
        ep.reset()
        assert "File too large" in ep.exec("truncate -s 8T answer.txt").text  # RLIMIT_FSIZE
        ep.exec("python3 -c \"f = open('x', 'wb'); f.seek(2**42); f.write(b'1')\"")
        ep.exec("truncate -s 30M answer.txt")
        outcome = ep.finish()
    scored_bottom(outcome, "scanner_rejected_required_output", bound=20)
    assert ("answer.txt", "sparse") in kinds(outcome)
    assert outcome.timings.scan < 2
    next_episode_is_clean(Inventory())


def test_FS_SYMLINK_01_a_symlink_to_the_graders_answer_is_rejected():
    outcome = play(Inventory(), "ln -s /hidden/expected.txt answer.txt",
                   "ln -s /etc/shadow x; ln -s ../../../../root/.ssh/id_ed25519 key")
    scored_bottom(outcome, "scanner_rejected_required_output")
    assert kinds(outcome) == {("answer.txt", "symlink"), ("x", "symlink"), ("key", "symlink")}
    next_episode_is_clean(Inventory())


def test_FS_SYMLINK_02_symlinks_to_devices_and_proc_are_never_read():
    outcome = play(Inventory(), "ln -s /dev/zero answer.txt; ln -s /dev/urandom preds.npy",
                   "ln -s /proc/self/environ log.txt; ln -s /proc/self/fd/0 input.txt")
    scored_bottom(outcome, "scanner_rejected_required_output", bound=20)
    assert {k for _, k in kinds(outcome)} == {"symlink"} and len(outcome.violations) == 4
    next_episode_is_clean(Inventory())


SWAPPER = ("while :; do echo 0 > a.tmp; mv -f a.tmp answer.txt; "
           "ln -sfn /hidden/expected.txt answer.txt; done")
DOUBLE_FORK = ("import os, time\n"
               "if os.fork(): os._exit(0)\n"
               "os.setsid()\n"
               "if os.fork(): os._exit(0)\n"
               "while True:\n"
               "    try:\n"
               "        os.replace('/workspace/answer.txt', '/workspace/b.tmp')\n"
               "        open('/workspace/answer.txt', 'x').write('0')\n"
               "    except OSError:\n"
               "        pass\n"
               "    time.sleep(0.001)\n")


def plant_daemons(name: str) -> list:
    return [f"( setsid bash -c 'exec -a {name} bash -c \"{SWAPPER}\"' & ) "
            "</dev/null >/dev/null 2>&1",
            Write("daemon.py", DOUBLE_FORK),
            f"python3 daemon.py {name} </dev/null >/dev/null 2>&1", "sleep 0.2"]


@pytest.mark.parametrize("face", ["sync", "async"])
def test_FS_TOCTOU_01_daemons_that_swap_the_answer_are_dead_before_the_scan(face, alive_at_scan):
    # Also PROC-DAEMON-01: a setsid and a double-forked daemon, both renamed.
    name = token()
    tokens, seen = alive_at_scan
    tokens.append(name)
    player = play if face == "sync" else play_async
    outcome = player(Inventory(), *plant_daemons(name),
                     before_finish=lambda: assert_running(name, 2))
    assert seen[name] == []
    assert host_processes_named(name) == []
    assert outcome.infra_error is None and outcome.reward == 0.0
    assert outcome.reason in ("graded", "scanner_rejected_required_output")
    assert not any(v.kind == "changed-during-scan" for v in outcome.violations)
    files = outcome.details["files"] if outcome.reason == "graded" else {}
    if "answer.txt" in files:  # absent where the kill came between a rename and a create
        assert stat.S_ISREG(int(files["answer.txt"][0], 8))
    next_episode_is_clean(Inventory())


def test_FS_HARDLINK_01_hard_links_are_refused():
    with Episode(Inventory(), seed=SEED) as ep:
        ep.reset()
        assert ep.exec("ln /etc/passwd outside").exit_code != 0  # EXDEV: its own mount
        ep.exec("ln numbers.txt answer.txt")
        outcome = ep.finish()
    scored_bottom(outcome, "scanner_rejected_required_output")
    assert kinds(outcome) == {("answer.txt", "hardlink"), ("numbers.txt", "hardlink")}
    next_episode_is_clean(Inventory())


DEEP = '''\
import os
os.mkdir("answer.txt")
os.chdir("answer.txt")
for i in range(3000):
    os.mkdir("d")
    os.chdir("d")
open("leaf", "w").write("1")
'''


def test_FS_DEEP_01_deep_nesting_is_cut_at_the_depth_budget():
    outcome = play(Inventory(), Write("deep.py", DEEP), "python3 deep.py")
    scored_bottom(outcome, "scanner_rejected_required_output", bound=30)
    (v,) = [v for v in outcome.violations if v.kind == "too-deep"]
    assert v.path.startswith("answer.txt/d/d/") and v.path.count("/") < 64
    assert outcome.timings.scan < 5
    next_episode_is_clean(Inventory())


ARCHIVE = '''\
import io, sys, tarfile

name = sys.argv[1]
with tarfile.open("answer.tar.gz", "w:gz") as tar:
    for member in ("answer.txt", f"../../../../../tmp/{name}", f"/tmp/{name}-abs"):
        info = tarfile.TarInfo(member)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"0\\n"))
    tar.add("/tmp/zeros", arcname="bomb")
'''


def test_FS_ARCHIVE_01_a_careless_unpacker_stays_inside_the_grading_sandbox():
    name = token()
    outcome = play(NaiveUntar(), "truncate -s 200M /tmp/zeros", Write("mk.py", ARCHIVE),
                   f"python3 mk.py {name} && rm -f /tmp/zeros && ls -l answer.tar.gz")
    # The bomb fills the grader's own small filesystem; the traversals land in its /tmp.
    scored_bottom(outcome, "grader_crashed", bound=30)
    assert "File too large" in outcome.grader_log or "No space left" in outcome.grader_log
    assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/tmp/{name}-abs")
    next_episode_is_clean(NaiveUntar())


def test_FS_MODE_01_setuid_setgid_and_sticky_bits_never_reach_the_grader():
    outcome = play(Inventory(), *Inventory().reference_solution(SEED),
                   "cp /bin/sh helper && chmod 6755 helper; echo x > run.sh && chmod 4777 run.sh",
                   "mkdir shared && chmod 1777 shared && echo y > shared/f && chmod 2755 shared/f",
                   "echo z > plain.sh && chmod 755 plain.sh")
    assert (outcome.reward, outcome.reason) == (1.0, "graded")
    assert {k for _, k in kinds(outcome)} == {"setuid", "setgid", "sticky"}
    files = outcome.details["files"]
    assert "helper" not in files and "run.sh" not in files and "shared" not in files
    assert all(int(mode, 8) & 0o7000 == 0 for mode, _ in files.values()), files
    assert files["plain.sh"][0] == oct(0o100755) and files["answer.txt"][0] == oct(0o100644)
    outcome = play(Inventory(), *Inventory().reference_solution(SEED), "chmod 4755 answer.txt")
    scored_bottom(outcome, "scanner_rejected_required_output")
    assert kinds(outcome) == {("answer.txt", "setuid")}
    next_episode_is_clean(Inventory())


def test_FS_SPECIAL_01_sockets_are_rejected_and_devices_and_mounts_cannot_be_made():
    with Episode(Inventory(), seed=SEED) as ep:
        ep.reset()
        ep.exec("python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('answer.txt')\"")
        assert ep.exec("mknod dev c 1 3").exit_code != 0
        assert ep.exec("test -e /dev/fuse").exit_code != 0
        assert ep.exec("mkdir mnt && mount -t tmpfs none mnt").exit_code != 0
        outcome = ep.finish()
    scored_bottom(outcome, "scanner_rejected_required_output")
    assert kinds(outcome) == {("answer.txt", "socket")}
    next_episode_is_clean(Inventory())


def test_FS_FILL_01_filling_the_disk_stays_inside_the_sandbox():
    free = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    with Episode(Inventory(), seed=SEED) as ep:
        ep.reset()
        ep.exec(Inventory().reference_solution(SEED)[0])
        r = ep.exec("for f in fill /tmp/fill ~/fill; do dd if=/dev/zero of=$f bs=1M count=500; "
                    "done 2>&1 | grep '^dd:'")
        assert r.text.count("No space left") + r.text.count("File too large") == 3, r.text
        outcome = ep.finish()
    # The honest answer still counts; the filler is bounded by the workspace's size.
    assert (outcome.reward, outcome.reason, outcome.infra_error) == (1.0, "graded", None)
    assert outcome.details["files"]["fill"][1] <= 32 * 1024 * 1024
    after = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    assert free - after < 256 * 1024 * 1024
    next_episode_is_clean(Inventory())


def test_FS_CLEANUP_01_cleanup_never_follows_planted_symlinks(tmp_path):
    canary = tmp_path / "canary"
    canary.mkdir(mode=0o700)
    (canary / "secret").write_text("keep me")
    os.chmod(canary / "secret", 0o600)
    outcome = play(Inventory(), *Inventory().reference_solution(SEED),
                   f"ln -s {canary} cache; ln -s / rootlink; ln -s {canary}/secret key",
                   f"mkdir -p out && ln -s {canary} out/deeper && chmod -R 777 . 2>/dev/null; true")
    assert (outcome.reward, outcome.reason) == (1.0, "graded")
    assert {k for _, k in kinds(outcome)} == {"symlink"}
    files = outcome.details["files"]
    assert not any(k in files for k in ("cache", "rootlink", "key", "out/deeper"))
    assert (canary / "secret").read_text() == "keep me"
    assert stat.S_IMODE(os.stat(canary).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(canary / "secret").st_mode) == 0o600
    next_episode_is_clean(Inventory())


# -- I. the grader's failures (XEP) and the programs it runs --------------------------

@pytest.mark.parametrize("answer", ["abc", "\\xff\\xfe", "1" * 5000])
def test_XEP_FAILOPEN_01_a_grader_crash_on_agent_input_scores_zero_never_infra(answer):
    outcome = play(SloppyParser(), f"printf '{answer}' > answer.txt")
    scored_bottom(outcome, "grader_crashed")
    assert "Error" in outcome.grader_log
    next_episode_is_clean(SloppyParser())


def test_XEP_FAILOPEN_01_an_oversized_answer_crashes_the_grader_and_scores_zero():
    outcome = play(Addition(), "head -c 1M /dev/zero | tr '\\0' 7 > answer.txt")
    scored_bottom(outcome, "grader_crashed")
    assert "GraderError" in outcome.grader_log
    next_episode_is_clean()


def test_XEP_FAILOPEN_01_a_grader_hung_on_agent_input_times_out_in_bounded_time():
    outcome = play(RegexValidated(), "printf '%s' \"$(printf '1%.0s' $(seq 60))x\" > answer.txt")
    scored_bottom(outcome, "grader_timeout", bound=15)  # the grader's timeout is 4 s
    next_episode_is_clean(RegexValidated())


NEVER_ENDS = '''\
import os, signal, time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    time.sleep(1e9)
time.sleep(1e9)
'''


def test_XEP_FAILOPEN_01_a_program_that_never_ends_is_cut_at_its_timeout():
    outcome = play(Runs(), Write("solution.py", NEVER_ENDS))
    scored_bottom(outcome, bound=20)
    assert all(run["timed_out"] and run["wall"] < 3 for run in outcome.details["runs"])
    next_episode_is_clean(Runs())


def test_RES_MEM_01_a_memory_bomb_in_the_program_kills_only_that_run():
    outcome = play(Runs(), Write("solution.py", "b = bytearray(1 << 30)\nprint(len(b))\n"))
    scored_bottom(outcome)
    assert all(run["oom"] or run["exit"] != 0 for run in outcome.details["runs"])
    next_episode_is_clean(Runs())


def test_RES_FORK_01_a_fork_bomb_in_the_program_stays_in_its_sandbox():
    outcome = play(Runs(), Write("solution.py", "import os\nwhile True:\n    try:\n"
                                 "        os.fork()\n    except OSError:\n        pass\n"))
    scored_bottom(outcome, bound=20)
    next_episode_is_clean(Runs())


# Doubles a number on stdin; run without input, tries each way to load a BPF program.
JIT_PROBING_SOLUTION = (
    "import sys\n"
    "line = sys.stdin.readline()\n"
    "if line.strip():\n"
    "    print(2 * int(line))\n"
    "    sys.exit()\n"
    f"sys.argv[1:] = [{json.dumps(json.dumps(BPF_JIT_CALLS))}]\n" + SYSCALL_PROBE)


def test_RES_BPFJIT_01_the_program_the_grader_runs_cannot_load_filters_either():
    # The run has a sandbox of its own, made by the host next to the grader's (both under
    # the grading cgroup), with the same policy; grading through ctx.run still works.
    outcome = play(RunReport(), Write("solution.py", JIT_PROBING_SOLUTION))
    assert (outcome.reward, outcome.reason, outcome.infra_error) == (1.0, "graded", None), \
        (outcome.details, outcome.grader_log[-3000:])
    assert outcome.details["exit"] == 0, outcome.details["stderr"]
    res = json.loads(outcome.details["stdout"])
    assert res == {name: "EPERM" for name, _, _ in BPF_JIT_CALLS}
