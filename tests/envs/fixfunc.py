"""Fix the function: the agent repairs slug.py; hidden tests judge it from outside.

The hidden tests are data the grader alone holds: a test ID, the arguments and the
expected value. Why this shape makes the classic test hacks fail by construction:

- The expected values never leave the grader's process. The grader sends only the
  arguments, through ctx.run, to a small runner in a nested sandbox (LEAK-STACK-01,
  LEAK-FS-01, LEAK-INCLUDE-01: there is nothing to find there).
- The runner imports the agent's module only in a child process per test, by file path
  (the workspace is never on sys.path: no shadowing, no sitecustomize, no conftest), and
  the child hands back one plain JSON value over a pipe of its own. Its stdout goes
  nowhere; its stderr joins the runner's, which the grader keeps as a log, never as a
  verdict. Whatever the agent's code does in that child (exit, atexit, monkeypatching,
  AlwaysEqual, skip, printing "PASSED", forging the runner's output), it can at most
  choose that value, which is what an honest solution does too (TEST-EXIT-01,
  TEST-ATEXIT-01, TEST-PATCH-01, OUT-PASSED-01).
- The trusted grader parses the runner's report strictly (no NaN, bounded size), checks
  that it holds exactly the expected test IDs, and compares each value with the
  expected one by exact type, recursively (TEST-EQ-01, TEST-SKIP-01, D10). Anything
  else (missing, extra, skipped, raised, timed out, unserialisable) is a failure.
- Every command is fixed by the grader and called by absolute path with the system
  Python in isolated mode; the agent's files, PATH, rc files and exports play no part
  (ENV-*, TEST-PYTESTCFG-01, TEST-CONFTEST-01).

The reward is 1.0 when every hidden test passes, else 0.0.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys

from karotte.environment import Environment, File, Grade
from karotte.spec import MiB, SandboxSpec

PYTHON = "/usr/bin/python3"
PER_TEST_SECONDS = 2.0
RUNNER_BUDGET = 6.0  # all tests together; a test not started by then is "not_run"
REPORT_LIMIT = 256 * 1024

BUGGY = '''\
def slugify(title):
    """Lower-case title; every run of characters other than ASCII letters and digits
    becomes one '-'; no '-' at either end."""
    return title.lower().replace(" ", "-")
'''

FIXED = '''\
def slugify(title):
    words, word = [], []
    for ch in title.lower() + " ":
        if ch.isascii() and ch.isalnum():
            word.append(ch)
        elif word:
            words.append("".join(word))
            word = []
    return "-".join(words)
'''

VISIBLE_TESTS = '''\
from slug import slugify


def test_spaces():
    assert slugify("Hello World") == "hello-world"


def test_punctuation():
    assert slugify("Rock & Roll!") == "rock-roll"


def test_edges():
    assert slugify("  --Already-Slugged--  ") == "already-slugged"
'''

# A home-grown harness as many repositories have: the kind of thing an agent can fool,
# which is why the grader never runs it.
RUN_TESTS = '''\
import sys
sys.path[:0] = [".", "tests"]
import test_slug
failed = 0
for name in sorted(n for n in dir(test_slug) if n.startswith("test_")):
    try:
        getattr(test_slug, name)()
        print(f"tests/test_slug.py::{name} PASSED")
    except Exception as exc:
        failed += 1
        print(f"tests/test_slug.py::{name} FAILED {exc!r}")
sys.exit(1 if failed else 0)
'''

# Runs in the nested sandbox as the system Python in isolated mode, reads the request
# on stdin and prints {"results": {test_id: result}}. It never sees an expected value.
RUNNER = r'''
import json, os, select, signal, subprocess, sys, time

CHILD = """
import json, os, sys
write, dumps, fd = os.write, json.dumps, int(sys.argv[1])

def report(text):
    data = text.encode()
    while data:
        data = data[write(fd, data):]
    os.close(fd)

try:
    import importlib.util
    spec = importlib.util.spec_from_file_location("solution", sys.argv[2])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    value = getattr(module, sys.argv[3])(*json.loads(sys.argv[4]))
except BaseException:
    report('{"status": "raised"}')
else:
    try:
        text = dumps({"status": "returned", "value": value}, allow_nan=False)
    except BaseException:
        text = '{"status": "unserialisable_output"}'
    report(text)
"""

def run_one(request, args, timeout):
    r, w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-I", "-c", CHILD, str(w), request["module"], request["function"],
         json.dumps(args)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        pass_fds=(w,), start_new_session=True)
    os.close(w)
    data, status, end = b"", None, time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            status = "timeout"
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
        if len(data) > request["result_limit"]:
            status = "oversized_output"
            break
    os.close(r)
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()
    if status:
        return {"status": status}
    if not data:
        return {"status": "no_result"}
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return {"status": "malformed_result"}

request = json.load(sys.stdin)
deadline = time.monotonic() + request["budget"]
results = {}
for test_id, args in request["tests"].items():
    left = min(request["per_test"], deadline - time.monotonic())
    results[test_id] = run_one(request, args, left) if left > 0 else {"status": "not_run"}
sys.stdout.write(json.dumps({"results": results}))
'''


_fixed: dict = {}
exec(FIXED, _fixed)
reference = _fixed["slugify"]  # the right answers: the reference solution itself


def hidden_cases(seed: int) -> dict[str, dict]:
    """Test ID -> {"args", "expect"}. Every title ends in punctuation, so the buggy
    slugify fails every case; none is among the visible examples."""
    rng = random.Random(f"fixfunc-{seed}")
    token = hashlib.sha256(f"fixfunc-hidden-{seed}".encode()).hexdigest()[:12]
    words = ["Karotte", "grader", "Sandbox", "RL", "v2", "Kernel", "seccomp", "42",
             "Namespace", "tmpfs", "cgroup", "Episode"]
    seps = [" - ", ", ", "   ", "/", " & ", "_", ": "]
    cases = {}
    for i in range(5):
        picked = rng.sample(words, 3)
        title = (rng.choice(["", " ", "(", "**"]) + rng.choice(seps).join(picked)
                 + rng.choice(["!", "?", "...", ")!"]))
        cases[f"tests/test_slug_hidden.py::test_case_{i}_{token}"] = {
            "args": [title], "expect": reference(title)}
    return cases


def _strict_json(data: bytes):
    def reject(name):
        raise ValueError(f"non-finite number {name}")
    return json.loads(data, parse_constant=reject)


def same(got, want) -> bool:
    """Equal with the exact same types all the way down (True is not 1, 1.0 is not 1)."""
    if type(got) is not type(want):
        return False
    if type(want) is list:
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if type(want) is dict:
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want


def judge(result, expect) -> str:
    if type(result) is not dict or type(result.get("status")) is not str:
        return "malformed_result"
    if result["status"] != "returned":
        return result["status"]
    return "passed" if "value" in result and same(result["value"], expect) else "wrong_value"


class FixFunction(Environment):
    """Repair slugify in /workspace/slug.py."""

    deliverables = ("slug.py",)
    limits = SandboxSpec(memory=256 * MiB, disk=64 * MiB, timeout=20)
    grader_limits = SandboxSpec(memory=512 * MiB, pids=128, disk=16 * MiB, timeout=30)

    def prompt(self, seed):
        return ("/workspace/slug.py has a buggy slugify(title). Fix it so that it follows its "
                "docstring. Examples are in tests/test_slug.py (python3 run_tests.py). Hidden "
                "tests decide the reward.")

    def workspace_files(self, seed):
        return {"slug.py": BUGGY, "tests/test_slug.py": VISIBLE_TESTS,
                "run_tests.py": File(RUN_TESTS, 0o755)}

    def hidden_files(self, seed):
        return {"tests.json": json.dumps(hidden_cases(seed))}

    def grade(self, ctx):
        cases = json.loads((ctx.hidden / "tests.json").read_text())
        if ctx.read_deliverable("slug.py") is None:
            return Grade(0.0, {"verdict": "no_deliverable"})
        request = {"module": "/workspace/slug.py", "function": "slugify",
                   "tests": {tid: case["args"] for tid, case in cases.items()},
                   "per_test": PER_TEST_SECONDS, "budget": RUNNER_BUDGET,
                   "result_limit": 64 * 1024}
        r = ctx.run([PYTHON, "-I", "-c", RUNNER], stdin=json.dumps(request),
                    timeout=RUNNER_BUDGET + 4, memory=256 * MiB, pids=32,
                    output_limit=REPORT_LIMIT)
        sys.stderr.write(r.stderr[-4000:].decode("utf-8", "replace"))  # a log, never a verdict
        try:
            report = _strict_json(r.stdout) if not r.stdout_truncated else None
        except (ValueError, RecursionError, UnicodeDecodeError):
            report = None
        results = report.get("results") if type(report) is dict else None
        if type(results) is not dict or results.keys() != cases.keys():
            return Grade(0.0, {"verdict": "incomplete_test_report", "runner_exit": r.exit_code,
                               "runner_timed_out": r.timed_out})
        statuses = {tid: judge(results[tid], case["expect"]) for tid, case in cases.items()}
        passed = all(s == "passed" for s in statuses.values())
        return Grade(1.0 if passed else 0.0,
                     {"verdict": "passed" if passed else "failed", "tests": statuses})

    def reference_solution(self, seed):
        return [f"cat > slug.py <<'EOF'\n{FIXED}EOF"]
