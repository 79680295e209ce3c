"""Episode: what a trainer drives. reset -> exec* -> finish -> Outcome, sync or asyncio.

    with Episode(MyEnv(), seed=7, max_turns=50, max_seconds=600) as ep:
        prompt = ep.reset()
        ep.exec("cd /workspace && python3 solve.py > answer.txt")
        outcome = ep.finish()          # kill, scan, copy, grade in a fresh sandbox
    outcome.reward, outcome.reason, outcome.violations, outcome.infra_error
    outcome.to_dict()                  # plain JSON data, of bounded size

The agent's tools: exec (a bash shell whose cd and exports carry over), read_file and
write_file (run as the agent, with its rights and nothing more) and give_up. An outcome
with infra_error set is the infrastructure's failure: mask it, do not score it. Every
failure the agent's work causes (bad files, a grader crash, a timeout, a budget used up)
is reward bottom with a reason code instead.

An Episode is one episode: reset() once, then tool calls, then finish() or give_up(),
whose Outcome later calls of either return again. The budget: at most max_turns tool
calls, and max_seconds of wall time from the end of reset() to finish(). The call that
would go past it is not run; it tells the model, and the episode ends with the bottom
reward and the reason "budget_exhausted".
"""
from __future__ import annotations

import asyncio
import math
import numbers
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Generic, Mapping, TypeVar

from . import imageref, images
from .custody import check_changes_home, take_custody
from .environment import Environment, agent_spec, check_environment, check_files, load
from .errors import KarotteError, SandboxClosed
from .grading import phase_policy, run_grader
from .limiter import DEFAULT_CONCURRENCY, set_concurrency  # noqa: F401 (their old home)
from .limiter import Limiter, Slots, default_limiter
from .mounts import WORKSPACE
from .outcome import ARGUMENT_LOG_LIMIT, ExecRecord, Outcome
from .results import EgressRecord, ExecResult, capped
from .sandbox import AsyncSandbox, Sandbox
from .scan import ScanLimits
from .scoring import Scoring
from .seeding import env_name, env_seed
from .spec import SandboxSpec
from .toolcalls import IMAGE_TOOLS, UNTAR, ToolCall, ToolResult, render, tarball, tool_argv
from .toolcalls import MAX_ARGUMENT, bash_argv  # noqa: F401 (their old home)
from .userland import hide_package

DEFAULT_MAX_TURNS = 1000
_S = TypeVar("_S", Sandbox, AsyncSandbox)
_imported: set[str] = set()  # images this process has imported into the store
_import_lock = threading.Lock()


def import_once(image: str) -> None:
    """Import image into the store before this process's first sandbox on it, one import at
    a time: episodes that start together wait for one import (a debian: build takes a
    minute) instead of each making its own. "host" and dir: trees are not imported."""
    if image in _imported or imageref.parse(image).kind in ("host", "dir"):
        return
    with _import_lock:
        if image not in _imported:
            images.open_image(image)
            _imported.add(image)


def _seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"an episode seed must be an int (any integer type, numpy's too), got "
                        f"{type(seed).__name__} {seed!r}")
    return int(seed)


def _headers(headers: object, env: Environment) -> dict[str, dict[str, str]]:
    """Episode(upstream_headers=...) checked: upstream name -> header -> value, for
    upstreams that the environment's network or grader_network declares."""
    if headers is None:
        return {}
    if not (isinstance(headers, Mapping) and all(
            isinstance(h, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in h.items()) for h in headers.values())):
        raise TypeError("upstream_headers maps an upstream's name to {header: value}, such "
                        "as {'model': {'Authorization': 'Bearer ...'}}")
    declared = {name for network in (env.network, env.grader_network) if network is not None
                for name in network.upstreams}
    unknown = sorted(set(headers) - declared)
    if unknown:
        raise ValueError(f"upstream_headers names the upstreams {unknown}, which neither "
                         f"{type(env).__qualname__}.network nor .grader_network declares "
                         f"({sorted(declared)})")
    return {name: dict(h) for name, h in headers.items()}


def _environment(env: object) -> Environment:
    if isinstance(env, str):
        try:
            cls = load(env)
        except (ImportError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot load the environment {env!r}: {exc}; pass "
                             "'package.module:ClassName', importable from sys.path") from exc
        env = cls()
    return check_environment(env)


class _Flow(Scoring):
    """The episode's state and its decisions, shared by the sync and async faces; its end
    is a Scoring (karotte/scoring.py)."""

    def __init__(self, env: Environment | str, seed: int, scan_limits: ScanLimits | None,
                 key: bytes | str | None, max_turns: int, max_seconds: float | None,
                 upstream_headers: Mapping[str, Mapping[str, str]] | None = None):
        self.env = _environment(env)
        # The credentials stay here, in the trainer: in the proxy's policy, never in a
        # sandbox, never in a record. The grader's are checked now, used at grading.
        self.headers = _headers(upstream_headers, self.env)
        name = type(self.env).__qualname__
        self.network = phase_policy(self.env.network, self.headers, f"{name}.network")
        phase_policy(self.env.grader_network, self.headers, f"{name}.grader_network")
        self.egress_of: Callable[[], EgressRecord | None] = lambda: None
        self.seed = _seed(seed)  # the trainer's; the environment only ever sees env_seed
        self.env_seed = env_seed(self.env, self.seed, key)
        self.name = env_name(self.env)
        if scan_limits is not None and not isinstance(scan_limits, ScanLimits):
            raise TypeError(f"scan_limits must be a ScanLimits, got {type(scan_limits).__name__}")
        self.scan_limits = scan_limits or self.env.scan_limits
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive int (tool calls), got {max_turns!r}")
        if max_seconds is not None and (isinstance(max_seconds, bool) or not isinstance(
                max_seconds, numbers.Real) or not 0 < max_seconds < math.inf):
            raise ValueError(f"max_seconds must be a positive finite number of seconds, or "
                             f"None for no limit; got {max_seconds!r}")
        self.max_turns, self.max_seconds = max_turns, max_seconds
        self.log: list[ExecRecord] = []
        self.turns = 0
        self.t_start = time.monotonic()
        self.t_reset = self.t_agent = 0.0
        self.deadline = math.inf
        self.reset_called = False
        self.running = False
        self.finished: Outcome | None = None

    # -- reset

    def agent_spec(self) -> SandboxSpec:
        """The environment's limits on its image, with its own package hidden from the host's
        userland (karotte/userland.py). Its image is imported here if need be, and the
        host must be able to keep the agent's diff of it (check_changes_home)."""
        if self.on_image:
            check_changes_home()
        import_once(self.env.image)
        return hide_package(replace(agent_spec(self.env), network=self.network),
                            type(self.env).__module__)

    @property
    def on_image(self) -> bool:
        return self.env.image != "host"

    def tools_there(self, result: ExecResult) -> None:
        """Raises unless the agent's image has what the tools run (IMAGE_TOOLS)."""
        missing = ["/bin/sh"] if result.error else result.stdout.decode(errors="replace").split()
        if missing:
            raise KarotteError(
                f"the agent's image {self.env.image} has no {', '.join(missing)}: the episode's "
                "tools run /bin/bash (the bash tool), /bin/sh (write_file), cat (read_file) "
                "and tar (placing the task's files); install bash, coreutils and tar in it "
                "(debian: images have them; `apk add bash coreutils tar` on Alpine), or set "
                f"{type(self.env).__qualname__}.image to an image that has them")

    def begin_reset(self) -> None:
        if self.finished is not None:
            raise SandboxClosed("the episode is over (finish() or give_up() ended it); make a "
                                "new Episode for another")
        if self.reset_called:
            raise RuntimeError("reset() was already called on this Episode; an Episode is one "
                               "episode: make a new Episode(env, seed) for another")
        self.reset_called = True

    def prepare(self) -> tuple[str, tuple[list[str], bytes] | None]:
        """The prompt and the command that places the task's files, from the environment's
        methods, each checked: an author's mistake fails here, named, before any agent."""
        env, seed = self.env, self.env_seed
        prompt = env.prompt(seed)
        if not isinstance(prompt, str):
            raise TypeError(f"{type(env).__name__}.prompt() must return a str, got "
                            f"{type(prompt).__name__}")
        files = check_files(env.workspace_files(seed), "workspace_files", allow_file=True)
        check_files(env.hidden_files(seed), "hidden_files", allow_file=False)
        return prompt, (UNTAR, tarball(files)) if files else None

    @staticmethod
    def placed(result: ExecResult) -> None:
        """Raises unless the command that placed the task's files succeeded."""
        if result.exit_code != 0:
            raise KarotteError(f"placing the task's files failed: {result.stderr[-2000:]!r}")

    def started(self, t0: float) -> None:
        now = time.monotonic()
        self.t_reset = now - t0
        if self.max_seconds is not None:
            self.deadline = now + self.max_seconds
        self.running = True

    def live(self) -> None:
        if self.finished is not None:
            raise SandboxClosed("the episode is over (finish() or give_up() ended it); make a "
                                "new Episode for another")
        if not self.running:
            raise SandboxClosed("the episode's sandbox was closed before it finished; make a "
                                "new Episode" if self.reset_called else
                                "the episode has not started: call reset() first")

    # -- tool calls

    def call(self, tool: str, argument: object, stdin: object = b"",
             timeout: object = None) -> ToolCall | ToolResult:
        """The tool call to run, or the ToolResult that says why it is not run: an argument
        no process can take (a NUL byte, over the kernel's 128 KiB for one argument, text
        that is not valid), or the budget used up. A model's output must never raise into
        the trainer's loop; the trainer's own mistakes (a list for a command, a bad
        timeout) raise, named."""
        what = "command" if tool == "bash" else "path"
        if not isinstance(argument, str):
            example = "ep.exec('ls -l')" if tool == "bash" else f"ep.{tool}('notes.txt', ...)"
            raise TypeError(f"the {tool} tool takes the {what} as one str, e.g. {example}; got "
                            f"{type(argument).__name__} {capped(repr(argument), 200)}")
        if not isinstance(stdin, (str, bytes)):
            raise TypeError(f"write_file content must be str or bytes, got {type(stdin).__name__}")
        wanted = self._timeout(timeout)
        self.turns += 1
        left = self.deadline - time.monotonic()
        if self.turns > self.max_turns or left <= 0:
            return self.refuse(tool, argument, self.budget_note(), end=True)
        argv = tool_argv(tool, argument)
        if isinstance(argv, str):
            return self.refuse(tool, argument, argv)
        return ToolCall(tool, argument, argv, stdin, min(wanted, left), left < wanted)

    def _timeout(self, timeout: object) -> float:
        """The command's time limit: the trainer's timeout, cut to the environment's
        limits.timeout. A trainer may lower the author's limit, never raise it, and one
        trainer's timeout works with every environment."""
        limit = self.env.limits.timeout
        if timeout is None:
            return limit
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"timeout must be seconds (a number), got {type(timeout).__name__}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be positive finite seconds (None: the environment's "
                             f"limit of {limit:g} s), got {timeout!r}")
        return min(float(timeout), limit)

    def budget_note(self) -> str:
        if self.turns > self.max_turns:
            return f"the episode's budget of {self.max_turns} tool calls is used up"
        return f"the episode's budget of {self.max_seconds:g} s is used up"

    def refuse(self, tool: str, argument: str, why: str, end: bool = False) -> ToolResult:
        self.log.append(ExecRecord(tool, capped(argument, ARGUMENT_LOG_LIMIT), None, False,
                                   False, 0.0))
        if end:
            self.outcome(None, "budget_exhausted")
            return ToolResult(f"error: {why}; {tool} was not run and the episode is over",
                              None, False, False, 0.0)
        return ToolResult(f"error: {why}", None, False, False, 0.0)

    def record(self, call: ToolCall, result: ExecResult, limit: int) -> ToolResult:
        truncated = result.stdout_truncated or result.stderr_truncated
        self.t_agent += result.wall_seconds
        egress = result.egress
        self.log.append(ExecRecord(call.tool, capped(call.argument, ARGUMENT_LOG_LIMIT),
                                   result.exit_code, result.timed_out, truncated,
                                   result.wall_seconds, egress.total if egress else 0,
                                   len(egress.refused) if egress else 0))
        text = render(result, limit, call.timeout)
        if result.timed_out and call.cut_by_budget:
            self.outcome(None, "budget_exhausted")
            text += f"[karotte: {self.budget_note()}; the episode is over]\n"
        return ToolResult(text, result.exit_code, result.timed_out, truncated,
                          result.wall_seconds, egress)

    def give_up(self) -> Outcome:
        self.log.append(ExecRecord("give_up", "", None, False, False, 0.0))
        return self.outcome(None, "gave_up")

    def out_of_time(self) -> Outcome | None:
        """At finish(): the budget's outcome if the agent phase took longer than max_seconds."""
        if time.monotonic() > self.deadline:
            return self.outcome(None, "budget_exhausted")
        return None

    def finish(self, kill_all: Callable[[], None], workspace_fd: int,
               close: Callable[[], None], upper_fd: int | None = None) -> Outcome:
        """Custody, then grading; blocking (the async face runs it in a worker thread).
        upper_fd: on an image, the overlay's upper (the agent's diff of the image)."""
        try:
            custody = take_custody(kill_all, workspace_fd, self.scan_limits,
                                   self.env.deliverables, upper_fd)
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
                report = run_grader(self.env, self.env_seed, custody.submission,
                                    custody.for_grader(), self.headers)
            except (KarotteError, OSError) as exc:
                return self.outcome(None, "infra_error", custody,
                                    infra_error=f"grading failed: {exc}",
                                    grade_seconds=time.monotonic() - t)
            return self.graded(custody, report, time.monotonic() - t)
        finally:
            custody.discard()


class _Facts(Generic[_S]):
    """What both faces tell about their episode, and their sandbox's hand-over."""

    _flow: _Flow
    _sandbox: _S | None

    @property
    def env(self) -> Environment:
        return self._flow.env

    @property
    def seed(self) -> int:
        """The trainer's seed (the environment sees one derived from it with the key)."""
        return self._flow.seed

    @property
    def done(self) -> bool:
        """Whether the episode has ended (finish(), give_up() or its budget)."""
        return self._flow.finished is not None

    def reference_solution(self) -> list[str]:
        """The environment's reference solution for this episode (bash commands)."""
        return list(self._flow.env.reference_solution(self._flow.env_seed))

    def _live(self) -> _S:
        """The sandbox, while the episode runs; SandboxClosed, saying why, otherwise."""
        self._flow.live()
        return self._sandbox

    def _let_go(self) -> _S | None:
        """The sandbox to close, no longer the episode's (None if it has none)."""
        self._flow.running = False
        sb, self._sandbox = self._sandbox, None
        return sb


class Episode(_Facts[Sandbox]):
    """One episode, synchronous. Use as a context manager; exit always cleans up."""

    def __init__(self, env: Environment | str, seed: int = 0, *,
                 scan_limits: ScanLimits | None = None, key: bytes | str | None = None,
                 max_turns: int = DEFAULT_MAX_TURNS, max_seconds: float | None = None,
                 upstream_headers: Mapping[str, Mapping[str, str]] | None = None):
        """env: an Environment instance, or its 'module:Name'. key: the secret that turns
        seed into the environment's seed (karotte/seeding.py); None takes the host's
        (KAROTTE_KEY, else its key file). The budget: max_turns, the most tool calls
        (bash, read_file, write_file) the agent gets; max_seconds, the most wall time from
        the end of reset() to finish() (None: no limit). A call past either is not run:
        the model is told, and the episode ends with the bottom reward and the reason
        "budget_exhausted". upstream_headers: the credentials of the upstreams that the
        environment's network and grader_network declare, by upstream name ({'model':
        {'Authorization': 'Bearer ...'}}), over those its headers_from_env takes from
        this process's environment; added by the host-side proxy, never in a sandbox."""
        self._flow = _Flow(env, seed, scan_limits, key, max_turns, max_seconds,
                           upstream_headers)
        self._sandbox: Sandbox | None = None

    def reset(self) -> str:
        """Start the agent's sandbox with the task's files; returns the prompt. Once per
        Episode."""
        flow = self._flow
        flow.begin_reset()
        t = time.monotonic()
        prompt, setup = flow.prepare()
        self._sandbox = Sandbox(flow.agent_spec())
        flow.egress_of = self._sandbox.egress_record  # readable after its close too
        try:
            if flow.on_image:
                flow.tools_there(self._sandbox.exec(IMAGE_TOOLS))
            if setup:
                flow.placed(self._sandbox.exec(setup[0], stdin=setup[1]))
        except BaseException:
            self.close()
            raise
        flow.started(t)
        return prompt

    def exec(self, command: str, timeout: float | None = None) -> ToolResult:
        """The agent's bash tool: cd and export carry over to the next command. timeout:
        seconds, cut to the environment's limits.timeout (also its default)."""
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
        call = self._flow.call(tool, argument, stdin, timeout)
        if not isinstance(call, ToolResult):
            call = self._flow.record(call, sb.exec(call.argv, stdin=call.stdin,
                                                   timeout=call.timeout, cwd=WORKSPACE),
                                     sb.spec.output_limit)
        if self.done:  # the budget ended it
            self.close()
        return call

    def give_up(self) -> Outcome:
        """The honest way out: the episode ends now with the bottom reward. Once it has
        ended, the Outcome it ended with."""
        if self._flow.finished is not None:
            return self._flow.finished
        self._live()
        self.close()
        return self._flow.give_up()

    def finish(self) -> Outcome:
        """Kill, scan, copy, grade in a fresh sandbox; the Outcome (the same one again once
        the episode has ended)."""
        flow = self._flow
        if flow.finished is not None:
            return flow.finished
        sb = self._live()
        late = flow.out_of_time()
        if late is not None:
            self.close()
            return late
        return flow.finish(sb.kill_all, sb.workspace_fd, self.close, sb.upper_fd)

    def close(self) -> None:
        sb = self._let_go()
        if sb is not None:
            sb.close()

    def __enter__(self) -> "Episode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncEpisode(_Facts[AsyncSandbox]):
    """The asyncio face of Episode. At most limiter.n of the episodes that share a limiter
    hold a sandbox at once, per event loop (karotte/limiter.py); the others wait in
    reset(). The blocking work (the environment's methods, creating and destroying
    sandboxes, custody, grading) runs in the limiter's threads, never on the event loop."""

    def __init__(self, env: Environment | str, seed: int = 0, *,
                 scan_limits: ScanLimits | None = None, key: bytes | str | None = None,
                 max_turns: int = DEFAULT_MAX_TURNS, max_seconds: float | None = None,
                 limiter: Limiter | None = None,
                 upstream_headers: Mapping[str, Mapping[str, str]] | None = None):
        """As Episode. limiter: a Limiter shared with the episodes it bounds; None takes
        the default one (set_concurrency's) as it is at reset()."""
        if limiter is not None and not isinstance(limiter, Limiter):
            raise TypeError(f"limiter must be a karotte.limiter.Limiter (Limiter(n): n "
                            f"episodes at once), got {type(limiter).__name__}")
        self._flow = _Flow(env, seed, scan_limits, key, max_turns, max_seconds,
                           upstream_headers)
        self._limiter = limiter
        self._sandbox: AsyncSandbox | None = None
        self._slots: Slots | None = None  # held from reset() to close()

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a thread of the limiter: the loop goes on with other episodes."""
        return await asyncio.get_running_loop().run_in_executor(self._slots.executor, fn, *args)

    async def reset(self) -> str:
        flow = self._flow
        flow.begin_reset()
        slots = (self._limiter or default_limiter()).slots()
        await slots.semaphore.acquire()
        self._slots = slots
        t = time.monotonic()
        try:
            prompt, setup = await self._in_thread(flow.prepare)
            # On an image, in a thread: its first use in this process imports it.
            spec = await self._in_thread(flow.agent_spec) if flow.on_image else flow.agent_spec()
            self._sandbox = await AsyncSandbox(spec).start()
            flow.egress_of = self._sandbox.egress_record
            if flow.on_image:
                flow.tools_there(await self._sandbox.exec(IMAGE_TOOLS))
            if setup:
                flow.placed(await self._sandbox.exec(setup[0], stdin=setup[1]))
        except BaseException:
            await self.close()
            raise
        flow.started(t)
        return prompt

    async def exec(self, command: str, timeout: float | None = None) -> ToolResult:
        return await self._tool("bash", command, timeout=timeout)

    async def read_file(self, path: str) -> ToolResult:
        return await self._tool("read_file", path)

    async def write_file(self, path: str, content: str | bytes) -> ToolResult:
        return await self._tool("write_file", path, stdin=content)

    async def _tool(self, tool: str, argument: str, *, stdin: str | bytes = b"",
                    timeout: float | None = None) -> ToolResult:
        sb = self._live()
        call = self._flow.call(tool, argument, stdin, timeout)
        if not isinstance(call, ToolResult):
            call = self._flow.record(call, await sb.exec(call.argv, stdin=call.stdin,
                                                         timeout=call.timeout, cwd=WORKSPACE),
                                     sb.spec.output_limit)
        if self.done:  # the budget ended it
            await self.close()
        return call

    async def give_up(self) -> Outcome:
        if self._flow.finished is not None:
            return self._flow.finished
        self._live()
        await self.close()
        return self._flow.give_up()

    async def finish(self) -> Outcome:
        flow = self._flow
        if flow.finished is not None:
            return flow.finished
        sb = self._live()
        outcome = flow.out_of_time() or await self._in_thread(
            flow.finish, sb.kill_all_blocking, sb.workspace_fd, sb.close_blocking, sb.upper_fd)
        await self.close()
        return outcome

    async def close(self) -> None:
        sb = self._let_go()
        if sb is not None:
            await sb.close()
        if self._slots is not None:
            slots, self._slots = self._slots, None
            slots.semaphore.release()

    async def __aenter__(self) -> "AsyncEpisode":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
