"""A grader that trusts the paths of the agent's diff, for tests/test_diff_custody.py: it
rewards an /etc/answer that holds the hidden word, read by a plain open() under
ctx.changes, as a Harbor-style check of a file might. The agent cannot know the word; a
symlink /etc/answer -> /hidden/expected.txt would hand it over, if the grader's process
followed it (DIFF-SYMLINK-03). Python 3.9 code: the grader runs under the image's
python3.
"""
from __future__ import annotations

import os

from envs.diff import DiffReports
from karotte.environment import Grade


class NaiveDiff(DiffReports):
    def hidden_files(self, seed: int):
        return {**super().hidden_files(seed), "expected.txt": "swordfish\n"}

    def grade(self, ctx) -> Grade:
        expected = (ctx.hidden / "expected.txt").read_text()
        seen = {}
        for rel in ("etc/answer", "etc/way/expected.txt"):
            try:
                seen[rel] = (ctx.changes / rel).read_text()
            except OSError as exc:
                seen[rel] = f"errno {exc.errno}"
        seen["readlink"] = os.readlink(ctx.changes / "etc/answer")
        data = ctx.read_deliverable("/etc/answer")
        seen["read_deliverable"] = None if data is None else data.decode("utf-8", "replace")
        seen["runs"] = [ctx.run(["cat", "/etc/answer"]).exit_code]
        return Grade(1.0 if expected in seen.values() else 0.0, seen)
