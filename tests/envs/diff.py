"""An environment on an image for tests/test_diff_custody.py: a root agent changes the
image, and grade() reports what the grader sees of it (ctx.changes, ctx.deleted,
ctx.replaced, absolute deliverables) and what the agent's programs run with ctx.run see.

The tests set `image`, `deliverables` and PROBE on the class; PROBE reaches the grader as
a hidden file (the grader imports this module afresh: a test's attributes stay in the
trainer's process). Python 3.9 code: the grader runs under the image's python3.
"""
from __future__ import annotations

import json
import os

from karotte.environment import Environment, Grade
from karotte.spec import SandboxSpec

# Set by the agent's .pth file, if it ever runs in the grader's process (it must not).
PTH_MARK = "KAROTTE_AGENT_PTH"


class DiffReports(Environment):
    """PROBE: {"runs": [argv, ...] for ctx.run, "pristine": [argv, ...] for ctx.run with
    changes=False, "git": [args, ...] for ctx.git on the workspace's repository, "read":
    [path, ...] for ctx.read_deliverable}. grade() returns 1 and details of all it saw;
    `wanted`, if set, is the text read_deliverable must find at the first path of "read"
    for a reward of 1 (a Harbor-style check of a file)."""

    image = "host"
    limits = SandboxSpec(agent_user="root")
    PROBE: dict = {}

    def prompt(self, seed: int) -> str:
        return "Change the image."

    def hidden_files(self, seed: int):
        return {"probe.json": json.dumps(self.PROBE)}

    def grade(self, ctx) -> Grade:
        probe = json.loads((ctx.hidden / "probe.json").read_text())
        seen = {"changes": None if ctx.changes is None else str(ctx.changes),
                "deleted": sorted(ctx.deleted), "replaced": sorted(ctx.replaced),
                "grader_pth": os.environ.get(PTH_MARK)}
        if ctx.changes is not None:
            seen["tree"] = sorted("/" + os.path.relpath(os.path.join(root, name), ctx.changes)
                                  for root, dirs, files in os.walk(ctx.changes)
                                  for name in dirs + files)[:200]
        seen["runs"] = [_ran(ctx.run(argv)) for argv in probe.get("runs", [])]
        seen["pristine"] = [_ran(ctx.run(argv, changes=False))
                            for argv in probe.get("pristine", [])]
        seen["git"] = [_ran(ctx.git(args)) for args in probe.get("git", [])]
        seen["read"] = {}
        for path in probe.get("read", []):
            data = ctx.read_deliverable(path, limit=4096)
            seen["read"][path] = None if data is None else data.decode("utf-8", "replace")
        reward = 1.0
        if "wanted" in probe:
            found = seen["read"][probe["read"][0]]
            reward = 1.0 if found is not None and probe["wanted"] in found else 0.0
        return Grade(reward, seen)


def _ran(result) -> dict:
    return {"exit": result.exit_code, "stdout": result.stdout.decode("utf-8", "replace"),
            "stderr": result.stderr.decode("utf-8", "replace")[-1000:]}
