"""Environment: what a task author writes.

An environment is a class, importable as ``module:Name`` and constructible without
arguments. The trainer's process calls prompt(), workspace_files() and hidden_files();
grade() runs only inside the grading sandbox, a fresh sandbox that holds the hidden
files and a vetted copy of the agent's deliverables, never in the trainer and never
next to the agent.

    class Addition(Environment):
        deliverables = ("answer.txt",)

        def prompt(self, seed):
            a, b = divmod(seed, 1000)
            return f"Write {a} + {b} as a decimal integer to /workspace/answer.txt."

        def hidden_files(self, seed):
            a, b = divmod(seed, 1000)
            return {"expected.txt": str(a + b)}

        def grade(self, ctx):
            expected = (ctx.hidden / "expected.txt").read_text()
            answer = ctx.read_deliverable("answer.txt", limit=100)
            return 1.0 if answer is not None and answer.strip() == expected.encode() else 0.0

This module is imported inside the grading sandbox too (by the system Python, with only
the standard library): keep its imports to spec and the standard library.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from .spec import GiB, MiB, SandboxSpec, ScanLimits

if TYPE_CHECKING:
    from .grader_runtime import GradeContext


@dataclass(frozen=True)
class File:
    """A file to place in the agent's workspace, with its mode."""

    content: bytes | str
    mode: int = 0o644

    def data(self) -> bytes:
        return self.content.encode() if isinstance(self.content, str) else self.content


@dataclass(frozen=True)
class Grade:
    """What grade() may return instead of a bare float."""

    reward: float
    details: Mapping[str, Any] = field(default_factory=dict)  # JSON-serialisable


class Environment:
    """Base class of a task. Override prompt() and grade(); the rest has defaults."""

    #: the agent's sandbox
    limits: ClassVar[SandboxSpec] = SandboxSpec()
    #: the grading sandbox; its timeout bounds the whole grading, nested runs included
    grader_limits: ClassVar[SandboxSpec] = SandboxSpec(memory=1 * GiB, pids=256, timeout=300.0,
                                                       disk=256 * MiB)
    #: paths under /workspace that grade() reads. A violation on one (a symlink, a FIFO,
    #: a file over the size cap...) scores the bottom reward with a reason.
    deliverables: ClassVar[Sequence[str]] = ()
    #: the custody scan's budgets (docs/scan.md); tighten them to what the task needs
    scan_limits: ClassVar[ScanLimits] = ScanLimits()
    #: (bottom, top) of the rewards grade() returns; a give-up or a failure scores bottom
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    #: a deep task's reward does not saturate (a measured speedup): `karotte check` then
    #: asks the reference solution to beat the bottom, not to reach the top
    deep: ClassVar[bool] = False

    def prompt(self, seed: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define prompt(seed)")

    def workspace_files(self, seed: int) -> Mapping[str, bytes | str | File]:
        """Files the agent starts with, by path relative to /workspace."""
        return {}

    def hidden_files(self, seed: int) -> Mapping[str, bytes | str]:
        """Files only the grader sees, at /hidden in the grading sandbox."""
        return {}

    def grade(self, ctx: "GradeContext") -> float | Grade:
        """Runs in the grading sandbox. ctx gives the vetted deliverables, the hidden files
        and ctx.run() for the agent's programs (in a sandbox nested under the grader's)."""
        raise NotImplementedError(f"{type(self).__name__} must define grade(ctx)")

    def reference_solution(self, seed: int) -> Sequence[str]:
        """Bash commands that solve the task, for `karotte run` and `karotte check`."""
        return ()


def load(target: str) -> type[Environment]:
    """'package.module:Name', or 'package.module' holding exactly one Environment."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    if attr:
        cls = getattr(module, attr, None)
        if cls is None:
            raise ValueError(f"{module_name} has no attribute {attr!r}")
    else:
        found = [v for v in vars(module).values() if isinstance(v, type)
                 and issubclass(v, Environment) and v is not Environment
                 and v.__module__ == module.__name__]
        if len(found) != 1:
            raise ValueError(f"{module_name} defines {len(found)} Environment classes; "
                             f"name one as {module_name}:Name")
        cls = found[0]
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"{target} is not an Environment subclass")
    return cls


def target_of(env: Environment) -> str:
    """The 'module:Name' that loads env's class again (in the grading sandbox)."""
    cls = type(env)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(f"{cls.__qualname__} must be defined at the top level of an importable "
                         "module: the grader imports it again inside its sandbox")
    return f"{cls.__module__}:{cls.__qualname__}"
