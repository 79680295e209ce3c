"""A task delivered as a git repository: fix calc.py and commit the fix. The grader reads
the repository with ctx.git, and once with a plain git of its own, to show what that meets."""
from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

from karotte.environment import Environment, File, Grade
from karotte.spec import MiB, SandboxSpec

MARK = "KAROTTE-GIT-RAN-AGENT-CODE-42"  # what the planted program prints
BUGGY = "def add(a, b):\n    return a - b\n"


@functools.lru_cache(maxsize=None)
def base_repository() -> dict[str, File]:
    """repo/ with one commit of BUGGY calc.py, made by a real git on the host: every file
    of it, .git included, as the workspace gets it."""
    with tempfile.TemporaryDirectory() as top:
        stamp = {"GIT_AUTHOR_NAME": "Karotte", "GIT_AUTHOR_EMAIL": "karotte@example.com",
                 "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_NAME": "Karotte",
                 "GIT_COMMITTER_EMAIL": "karotte@example.com",
                 "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z", "GIT_CONFIG_NOSYSTEM": "1",
                 "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": top, "PATH": os.environ["PATH"]}
        repo = Path(top) / "repo"
        subprocess.run(["git", "init", "-q", "--template=", "-b", "main", str(repo)],
                       env=stamp, check=True)
        (repo / "calc.py").write_text(BUGGY)
        for argv in (["git", "add", "calc.py"], ["git", "commit", "-qm", "add, with a bug"]):
            subprocess.run(argv, cwd=repo, env=stamp, check=True)
        return {f"repo/{p.relative_to(repo)}": File(p.read_bytes(), 0o644)
                for p in sorted(repo.rglob("*")) if p.is_file()}


class CommitTheFix(Environment):
    """repo/calc.py subtracts; the fix must be committed on top of the base commit, with
    nothing left uncommitted."""

    deliverables = ("repo",)
    limits = SandboxSpec(memory=256 * MiB, timeout=20)

    def prompt(self, seed):
        return ("/workspace/repo is a git repository. Fix add() in calc.py so that it adds, "
                "and commit the fix on top of the current commit; leave nothing uncommitted.")

    def workspace_files(self, seed):
        return base_repository()

    def grade(self, ctx):
        runs = {"log": ctx.git(["log", "--format=%s"], repo="repo"),
                "status": ctx.git(["status", "--porcelain"], repo="repo"),
                "show": ctx.git(["show", "HEAD:calc.py"], repo="repo"),
                "diff": ctx.git(["diff", "HEAD~1", "HEAD"], repo="repo")}
        said = {name: (r.stdout + r.stderr).decode(errors="replace")[-2000:]
                for name, r in runs.items()}
        plain = subprocess.run(["/usr/bin/git", "-C", str(ctx.submission / "repo"), "log"],
                               capture_output=True, text=True)
        # What a grader that hands git the agent's own git dir gets (in a nested run).
        naive = ctx.run(["/usr/bin/git", "--git-dir=/workspace/repo/.git",
                         "--work-tree=/workspace/repo", "status", "--porcelain"], timeout=30)
        done = (runs["log"].stdout.splitlines()[-1:] == [b"add, with a bug"]
                and len(runs["log"].stdout.splitlines()) == 2
                and b"return a + b" in runs["show"].stdout
                and runs["status"].exit_code == 0 and runs["status"].stdout == b"")
        return Grade(1.0 if done else 0.0, {
            "said": said, "ran_agent_code": MARK in str(said), "plain_git": plain.stderr[-500:],
            "git_dir_of_the_agent_ran_its_code": MARK in str(naive.stdout + naive.stderr)})

    def reference_solution(self, seed):
        return ["cd repo && sed -i 's/a - b/a + b/' calc.py && git -c user.name=agent "
                "-c user.email=agent@example.com commit -qam 'fix add'"]
