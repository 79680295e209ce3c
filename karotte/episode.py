"""Episode: what a trainer drives. reset -> exec* -> finish -> Outcome, sync or asyncio.

    with Episode(MyEnv(), seed=7) as ep:
        prompt = ep.reset()
        ep.exec("cd /workspace && python3 solve.py > answer.txt")
        outcome = ep.finish()          # kill, scan, copy, grade in a fresh sandbox
    outcome.reward, outcome.reason, outcome.violations, outcome.infra_error

The agent's tools: exec (a bash shell whose cd and exports carry over), read_file and
write_file (run as the agent, with its rights and nothing more) and give_up. An outcome
with infra_error set is the infrastructure's failure: mask it, do not score it. Every
failure the agent's work causes (bad files, a grader crash, a timeout) is reward bottom
with a reason code instead.
"""
from __future__ import annotations

import asyncio
import io
import tarfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from .custody import Custody, deliverable_violations, take_custody
from .environment import Environment, File, load
from .errors import KarotteError, SandboxClosed
from .grading import GradeReport, run_grader
from .results import ExecResult
from .sandbox import AsyncSandbox, Sandbox
from .scan import ScanLimits, Violation
from .seeding import env_seed

SHELL_STATE = "/home/agent/.karotte-shell-state"
# Each command runs in a fresh bash that first restores the previous command's working
# directory and exported variables, and saves them again on exit. No long-lived shell:
# a timeout kills one command's process group and nothing else, and no output marker
# exists that the agent could print to confuse the parser.
SHELL = r"""
if [ -r %(state)s ]; then . %(state)s; fi
__karotte_save() {
    export -n SHLVL _ OLDPWD 2>/dev/null  # this shell is ending: only the saved list changes
    { export -p; printf 'cd -- %%q 2>/dev/null\n' "$PWD"; } > %(state)s 2>/dev/null
}
trap __karotte_save EXIT
eval "$1"
""" % {"state": SHELL_STATE}
TRUNCATED = "\n[karotte: output truncated, only the first {limit} bytes of {stream} are shown]\n"
DEFAULT_CONCURRENCY = 64
MAX_ARGUMENT = 128 * 1024 - 1  # MAX_ARG_STRLEN: the kernel's limit on one argv string


@dataclass(frozen=True)
class ToolResult:
    """One tool call as the agent sees it (text) and as the trainer logs it."""

    text: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    wall_seconds: float


@dataclass(frozen=True)
class ExecRecord:
    tool: str  # "bash", "read_file", "write_file", "give_up"
    argument: str  # the command, or the path
    exit_code: int | None
    timed_out: bool
    truncated: bool
    wall_seconds: float


@dataclass(frozen=True)
class Timings:
    """Seconds per phase of the episode."""

    reset: float = 0.0
    agent: float = 0.0  # the tool calls together
    kill: float = 0.0
    scan: float = 0.0
    grade: float = 0.0
    total: float = 0.0


@dataclass(frozen=True)
class Outcome:
    reward: float
    reason: str  # "graded", "gave_up", "scanner_rejected_required_output", "grader_crashed", ...
    violations: tuple[Violation, ...]
    infra_error: str | None  # set only when the infrastructure failed: mask, do not score
    timings: Timings
    log: tuple[ExecRecord, ...]
    details: Mapping[str, Any] = field(default_factory=dict)  # from the grader
    grader_log: str = ""


def _render(result: ExecResult, limit: int) -> str:
    text = result.stdout.decode("utf-8", errors="replace")
    if result.stdout_truncated:
        text += TRUNCATED.format(limit=limit, stream="stdout")
    err = result.stderr.decode("utf-8", errors="replace")
    if result.stderr_truncated:
        err += TRUNCATED.format(limit=limit, stream="stderr")
    if err:
        text += err
    if result.timed_out:
        text += "\n[karotte: the command timed out and was killed]\n"
    elif result.signal is not None:
        text += f"\n[karotte: the command was killed by signal {result.signal}]\n"
    if result.oom_killed:
        text += "[karotte: the memory limit was reached]\n"
    return text


def _tarball(files: Mapping[str, bytes | str | File]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in files.items():
            f = content if isinstance(content, File) else File(content)
            data = f.data()
            info = tarfile.TarInfo(path.lstrip("/"))
            if ".." in info.name.split("/"):
                raise ValueError(f"workspace file path must stay inside: {path!r}")
            info.size, info.mode, info.mtime = len(data), f.mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def bash_argv(command: str) -> list[str]:
    """The agent's bash tool: one command run in the persistent shell state."""
    return ["/bin/bash", "--noprofile", "--norc", "-c", SHELL, "bash", command]


class _Flow:
    """The episode's state and its decisions, shared by the sync and async faces."""

    def __init__(self, env: Environment | str, seed: int, scan_limits: ScanLimits | None,
                 key: bytes | str | None):
        self.env = load(env)() if isinstance(env, str) else env
        self.seed = seed  # the trainer's; the environment only ever sees env_seed
        self.env_seed = env_seed(self.env, seed, key)
        self.scan_limits = scan_limits or self.env.scan_limits
        self.log: list[ExecRecord] = []
        self.t_start = time.monotonic()
        self.t_reset = self.t_agent = 0.0
        self.finished: Outcome | None = None

    def setup_command(self) -> tuple[list[str], bytes] | None:
        files = self.env.workspace_files(self.env_seed)
        if not files:
            return None
        return (["tar", "-x", "--no-same-owner", "-m", "-C", "/workspace", "-f", "-"],
                _tarball(files))

    def argv(self, tool: str, argument: str) -> list[str] | ToolResult:
        """The argv that runs this call of the bash, read_file or write_file tool, or, for
        an argument no process can take (a NUL byte, over the kernel's 128 KiB for one
        argument), the ToolResult that says so: a model's output must never raise into
        the trainer's loop."""
        what = "command" if tool == "bash" else "path"
        size = len(argument.encode("utf-8", "surrogateescape"))
        if "\0" in argument:
            why = f"the {what} contains a NUL byte, which no program can take as an argument"
        elif size > MAX_ARGUMENT:
            why = (f"the {what} is {size} bytes, over the limit of {MAX_ARGUMENT}; "
                   "write long content to a file with write_file")
        else:
            return {"bash": bash_argv(argument),
                    "read_file": ["cat", "--", argument],
                    "write_file": ["/bin/sh", "-c", 'cat > "$1"', "sh", argument]}[tool]
        self.log.append(ExecRecord(tool, argument, None, False, False, 0.0))
        return ToolResult(f"error: {why}; nothing was run", None, False, False, 0.0)

    def record(self, tool: str, argument: str, result: ExecResult, limit: int) -> ToolResult:
        truncated = result.stdout_truncated or result.stderr_truncated
        self.t_agent += result.wall_seconds
        self.log.append(ExecRecord(tool, argument, result.exit_code, result.timed_out,
                                   truncated, result.wall_seconds))
        return ToolResult(_render(result, limit), result.exit_code, result.timed_out,
                          truncated, result.wall_seconds)

    def outcome(self, reward: float | None, reason: str, custody: Custody | None = None,
                report: GradeReport | None = None, infra_error: str | None = None,
                grade_seconds: float = 0.0) -> Outcome:
        bottom = self.env.reward_range[0]
        timings = Timings(self.t_reset, self.t_agent,
                          custody.kill_seconds if custody else 0.0,
                          custody.scan_seconds if custody else 0.0, grade_seconds,
                          time.monotonic() - self.t_start)
        self.finished = Outcome(
            bottom if reward is None else reward, reason,
            custody.violations if custody else (), infra_error, timings, tuple(self.log),
            dict(report.details) if report else {}, report.log if report else "")
        return self.finished

    def judge(self, custody: Custody) -> Outcome | None:
        """The outcome decided before grading, if any."""
        if not custody.kill_confirmed:
            return self.outcome(None, "kill_unconfirmed", custody,
                                infra_error=None)
        if deliverable_violations(custody.violations, self.env.deliverables):
            return self.outcome(None, "scanner_rejected_required_output", custody)
        return None

    def graded(self, custody: Custody, report: GradeReport, seconds: float) -> Outcome:
        if report.reason != "graded":
            return self.outcome(None, report.reason, custody, report, grade_seconds=seconds)
        bottom, top = self.env.reward_range
        if not bottom <= report.reward <= top:
            # A grader that scores the agent's raw input (1 - |x - e| / e) must not hand the
            # trainer -1e296: outside reward_range is the bottom, with the value kept.
            report = replace(report, details={**report.details, "rejected_reward": report.reward})
            return self.outcome(None, "reward_out_of_range", custody, report,
                                grade_seconds=seconds)
        return self.outcome(report.reward, "graded", custody, report, grade_seconds=seconds)

    def finish(self, kill_all: Callable[[], None], workspace_fd: int,
               close: Callable[[], None]) -> Outcome:
        """Custody, then grading; blocking (the async face runs it in a worker thread)."""
        try:
            custody = take_custody(kill_all, workspace_fd, self.scan_limits,
                                   self.env.deliverables)
        except (KarotteError, OSError) as exc:
            close()
            return self.outcome(None, "infra_error", infra_error=f"custody failed: {exc}")
        close()
        try:
            decided = self.judge(custody)
            if decided is not None:
                return decided
            t = time.monotonic()
            try:
                report = run_grader(self.env, self.env_seed, custody.submission)
            except (KarotteError, OSError) as exc:
                return self.outcome(None, "infra_error", custody,
                                    infra_error=f"grading failed: {exc}",
                                    grade_seconds=time.monotonic() - t)
            return self.graded(custody, report, time.monotonic() - t)
        finally:
            custody.discard()


class _Facts:
    """What both faces tell about their episode."""

    _flow: _Flow

    @property
    def env(self) -> Environment:
        return self._flow.env

    @property
    def seed(self) -> int:
        """The trainer's seed (the environment sees one derived from it with the key)."""
        return self._flow.seed

    @property
    def done(self) -> bool:
        """Whether the episode has ended (finish() or give_up())."""
        return self._flow.finished is not None

    def reference_solution(self) -> list[str]:
        """The environment's reference solution for this episode (bash commands)."""
        return list(self._flow.env.reference_solution(self._flow.env_seed))


class Episode(_Facts):
    """One episode, synchronous. Use as a context manager; exit always cleans up."""

    def __init__(self, env: Environment | str, seed: int = 0, *,
                 scan_limits: ScanLimits | None = None, key: bytes | str | None = None):
        """key: the secret that turns seed into the environment's seed (karotte/seeding.py);
        None takes the host's (KAROTTE_KEY, else its key file)."""
        self._flow = _Flow(env, seed, scan_limits, key)
        self._sandbox: Sandbox | None = None

    def reset(self) -> str:
        """Start the agent's sandbox with the task's files; returns the prompt."""
        flow = self._flow
        t = time.monotonic()
        prompt = flow.env.prompt(flow.env_seed)
        self._sandbox = Sandbox(flow.env.limits)
        setup = flow.setup_command()
        if setup:
            r = self._sandbox.exec(setup[0], stdin=setup[1])
            if r.exit_code != 0:
                raise KarotteError(f"placing the task's files failed: {r.stderr[-2000:]!r}")
        flow.t_reset = time.monotonic() - t
        return prompt

    def _live(self) -> Sandbox:
        if self._sandbox is None or self._flow.finished is not None:
            raise SandboxClosed("the episode is not running (call reset(); finish() ends it)")
        return self._sandbox

    def exec(self, command: str, timeout: float | None = None) -> ToolResult:
        """The agent's bash tool: cd and export carry over to the next command."""
        return self._tool("bash", command, timeout=timeout)

    def read_file(self, path: str) -> ToolResult:
        """Read a file with the agent's rights (relative paths are under /workspace)."""
        return self._tool("read_file", path)

    def write_file(self, path: str, content: str | bytes) -> ToolResult:
        """Write a file with the agent's rights (relative paths are under /workspace)."""
        return self._tool("write_file", path, stdin=content)

    def _tool(self, tool: str, argument: str, *, stdin: str | bytes = b"",
              timeout: float | None = None) -> ToolResult:
        sb = self._live()
        argv = self._flow.argv(tool, argument)
        if isinstance(argv, ToolResult):
            return argv
        return self._flow.record(tool, argument, sb.exec(argv, stdin=stdin, timeout=timeout),
                                 sb.spec.output_limit)

    def give_up(self) -> Outcome:
        """The honest way out: the episode ends now with the bottom reward."""
        self._live()
        self._flow.log.append(ExecRecord("give_up", "", None, False, False, 0.0))
        self.close()
        return self._flow.outcome(None, "gave_up")

    def finish(self) -> Outcome:
        """Kill, scan, copy, grade in a fresh sandbox; the Outcome."""
        if self._flow.finished is not None:
            return self._flow.finished
        sb = self._live()
        return self._flow.finish(sb.kill_all, sb.workspace_fd, self.close)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def __enter__(self) -> "Episode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Slots:
    """Per event loop: who may hold a sandbox, and the threads that finish episodes (as
    many as may hold one, so grading is not capped by asyncio's default executor)."""

    semaphore: asyncio.Semaphore
    executor: ThreadPoolExecutor


_slots: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Slots]" = \
    weakref.WeakKeyDictionary()
_concurrency = DEFAULT_CONCURRENCY


def set_concurrency(n: int) -> None:
    """How many async episodes may hold a sandbox at once (per event loop)."""
    global _concurrency
    if n < 1:
        raise ValueError("concurrency must be at least 1")
    _concurrency = n
    for slots in _slots.values():
        slots.executor.shutdown(wait=False)
    _slots.clear()


def _loop_slots() -> _Slots:
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = _Slots(asyncio.Semaphore(_concurrency), ThreadPoolExecutor(
            _concurrency, thread_name_prefix="karotte-finish"))
    return _slots[loop]


class AsyncEpisode(_Facts):
    """The asyncio face of Episode. At most set_concurrency() episodes per event loop hold
    a sandbox at once; the others wait in reset()."""

    def __init__(self, env: Environment | str, seed: int = 0, *,
                 scan_limits: ScanLimits | None = None, key: bytes | str | None = None):
        """key: the secret that turns seed into the environment's seed (karotte/seeding.py);
        None takes the host's (KAROTTE_KEY, else its key file)."""
        self._flow = _Flow(env, seed, scan_limits, key)
        self._sandbox: AsyncSandbox | None = None
        self._slot: asyncio.Semaphore | None = None

    async def reset(self) -> str:
        flow = self._flow
        slot = _loop_slots().semaphore
        await slot.acquire()
        self._slot = slot
        t = time.monotonic()
        try:
            prompt = flow.env.prompt(flow.env_seed)
            self._sandbox = await AsyncSandbox(flow.env.limits).start()
            setup = flow.setup_command()
            if setup:
                r = await self._sandbox.exec(setup[0], stdin=setup[1])
                if r.exit_code != 0:
                    raise KarotteError(f"placing the task's files failed: {r.stderr[-2000:]!r}")
        except BaseException:
            await self.close()
            raise
        flow.t_reset = time.monotonic() - t
        return prompt

    def _live(self) -> AsyncSandbox:
        if self._sandbox is None or self._flow.finished is not None:
            raise SandboxClosed("the episode is not running (call reset(); finish() ends it)")
        return self._sandbox

    async def exec(self, command: str, timeout: float | None = None) -> ToolResult:
        return await self._tool("bash", command, timeout=timeout)

    async def read_file(self, path: str) -> ToolResult:
        return await self._tool("read_file", path)

    async def write_file(self, path: str, content: str | bytes) -> ToolResult:
        return await self._tool("write_file", path, stdin=content)

    async def _tool(self, tool: str, argument: str, *, stdin: str | bytes = b"",
                    timeout: float | None = None) -> ToolResult:
        sb = self._live()
        argv = self._flow.argv(tool, argument)
        if isinstance(argv, ToolResult):
            return argv
        return self._flow.record(tool, argument,
                                 await sb.exec(argv, stdin=stdin, timeout=timeout),
                                 sb.spec.output_limit)

    async def give_up(self) -> Outcome:
        self._live()
        self._flow.log.append(ExecRecord("give_up", "", None, False, False, 0.0))
        await self.close()
        return self._flow.outcome(None, "gave_up")

    async def finish(self) -> Outcome:
        if self._flow.finished is not None:
            return self._flow.finished
        sb = self._live()
        outcome = await asyncio.get_running_loop().run_in_executor(
            _loop_slots().executor, self._flow.finish, sb.kill_all_blocking, sb.workspace_fd,
            sb.close_blocking)
        await self.close()
        return outcome

    async def close(self) -> None:
        if self._sandbox is not None:
            sb, self._sandbox = self._sandbox, None
            await sb.close()
        if self._slot is not None:
            slot, self._slot = self._slot, None
            slot.release()

    async def __aenter__(self) -> "AsyncEpisode":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
