"""CommitTheFix with the repository at the workspace's root: the grader reads it with
ctx.git's default repo ".", the workspace itself."""
from __future__ import annotations

from karotte.environment import Environment, Grade
from karotte.spec import MiB, SandboxSpec

from .gitrepo import base_repository


class CommitTheFixAtTheRoot(Environment):
    deliverables = (".git", "calc.py")
    limits = SandboxSpec(memory=256 * MiB, timeout=20)

    def prompt(self, seed):
        return ("/workspace is a git repository. Fix add() in calc.py so that it adds, and "
                "commit the fix on top of the current commit; leave nothing uncommitted.")

    def workspace_files(self, seed):
        return {path.removeprefix("repo/"): f for path, f in base_repository().items()}

    def grade(self, ctx):
        log, status = ctx.git(["log", "--format=%s"]), ctx.git(["status", "--porcelain"])
        done = log.stdout == b"fix add\nadd, with a bug\n" and status.exit_code == 0 \
            and status.stdout == b""
        return Grade(1.0 if done else 0.0, {"log": log.stdout.decode(errors="replace"),
                                            "status": status.stdout.decode(errors="replace")})

    def reference_solution(self, seed):
        return ["sed -i 's/a - b/a + b/' calc.py && git -c user.name=agent "
                "-c user.email=agent@example.com commit -qam 'fix add'"]
