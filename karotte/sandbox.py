"""Sandbox: create -> exec* -> kill_all -> destroy, with a sync and an asyncio API.

One sandbox is one karotte-init (PID 1 of fresh user, PID, mount, network, IPC, UTS
and cgroup namespaces) in one cgroup. The host drives it over a private socketpair:
each exec sends the command and three pipe fds, init runs it as the agent and
reports how it ended. Output is read by the host directly from the pipes and capped.

This module is the two faces, Sandbox and AsyncSandbox, over one core that makes, runs and
tears down the sandbox (karotte/sandbox_core.py). Each exec's I/O is a state machine of its
own (karotte/exec_io.py), which Sandbox drives with poll() and AsyncSandbox with the asyncio
event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import select
import termios
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from . import cgroups
from .execenv import DEFAULT_ENV, exec_env  # noqa: F401 (public here too)
from .userns import AGENT_UID, DEFAULT_UID_BASE, ns_owner_ids  # noqa: F401 (public here too)
from .results import ExecResult
from .errors import SandboxError
from .exec_io import ExecOp, drive_async, drive_sync
from .sandbox_core import _Core
from .spec import SandboxSpec

SETUP_TIMEOUT = 10.0  # seconds for init to build the root and report ready
BUSY = ("another exec of this sandbox is running (from another thread, or from an on_output "
        "callback), and two would race for init's replies: a Sandbox runs one exec at a time; "
        "use one Sandbox per thread, or AsyncSandbox, which queues concurrent execs")


class _Facts:
    """What both faces tell about their sandbox."""

    _core: _Core

    @property
    def spec(self) -> SandboxSpec:
        return self._core.spec

    @property
    def workspace_fd(self) -> int:
        """A directory fd of /workspace, valid until the sandbox is destroyed."""
        return self._core.workspace_fd

    @property
    def upper_fd(self) -> int | None:
        """On an image, a directory fd of the overlay's upper: exactly what the agent changed
        of the image's tree (karotte.changes.scan_changes reads it after kill_all); None on
        the host's userland. Valid until the sandbox is destroyed."""
        return self._core.upper_fd

    @property
    def cgroup(self) -> cgroups.Cgroup | None:
        return self._core.cgroup

    @property
    def init_pid(self) -> int:
        """Host pid of the sandbox's init."""
        return self._core.pid

    def egress_record(self):
        """What the agent reached through the egress proxy so far, after close() all of
        it (a frozen karotte.egress.EgressRecord), or None with network "none"."""
        session = self._core.egress or self._core.egress_closed
        return session.record() if session is not None else None


class Sandbox(_Facts):
    """A live sandbox. Use as a context manager; exit always cleans up.

        with Sandbox(SandboxSpec(memory=512 * MiB)) as sb:
            r = sb.exec(["python3", "-c", "print(42)"])
    """

    def __init__(self, spec: SandboxSpec | None = None, *,
                 cgroup_parent: cgroups.Cgroup | None = None):
        """cgroup_parent nests this sandbox's cgroup under another (which, on cgroup v2,
        must hold no processes): its limits then bound this one too."""
        self._driving = threading.Lock()  # held by the one exec being run (BUSY)
        self._core = _Core(spec or SandboxSpec(), cgroup_parent)
        self._core.start()
        poller = select.poll()
        poller.register(self._core.sock.fileno(), select.POLLIN)
        try:
            if not poller.poll(SETUP_TIMEOUT * 1000):
                raise SandboxError(f"karotte-init did not get ready within {SETUP_TIMEOUT:.0f} s")
            reply, fds = self._core.recv_with_fds()
        except BaseException:
            self._core.destroy()
            raise
        self._core.finish_start(reply, fds)

    def exec(self, argv: Sequence[str] | str, *, stdin: bytes | str = b"",
             timeout: float | None = None, env: Mapping[str, str] | None = None,
             cwd: str | None = None,
             on_output: Callable[[int, bytes], None] | None = None,
             pass_fds: Sequence[int] = ()) -> ExecResult:
        """Run a command as the agent and wait for it; a string runs under /bin/sh -c.

        on_output(stream, data) sees output as it arrives (stream 1 or 2); the result
        still keeps the first output_limit bytes of each. pass_fds are host fds that
        the command gets as fds 3, 4, ... (a private channel to its caller).
        """
        with self._one_exec():
            op = self._core.begin_exec(argv, stdin, timeout, env, cwd, on_output,
                                       pass_fds=pass_fds)
            return self._finish(op)

    def open_terminal(self, argv: Sequence[str] | str, *, timeout: float | None = None,
                      env: Mapping[str, str] | None = None,
                      cwd: str | None = None) -> "Terminal":
        """Start a command on a new pty of the sandbox (its controlling terminal).

        Relay Terminal.fd (the pty master) yourself, then call Terminal.wait().
        """
        with self._one_exec():
            op = self._core.begin_exec(argv, b"", timeout, env, cwd, terminal=True)
            try:
                drive_sync(op, until=lambda: op.terminal_fd is not None)
            except BaseException:
                op.cancel()
                raise
        if op.terminal_fd is None:  # it could not start
            return Terminal(self, op, -1)
        return Terminal(self, op, op.terminal_fd)

    @contextlib.contextmanager
    def _one_exec(self):
        if not self._driving.acquire(blocking=False):
            raise SandboxError(BUSY)
        try:
            yield
        finally:
            self._driving.release()

    def _finish(self, op: ExecOp) -> ExecResult:
        try:
            drive_sync(op)
        except BaseException:
            op.cancel()
            raise
        return self._core.end_exec(op)

    def kill_all(self) -> None:
        """Freeze, kill and confirm gone every process of the sandbox (it is then dead)."""
        self._core.kill_all()

    def close(self) -> None:
        self._core.destroy()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Terminal:
    """A command running on a pty of the sandbox; see Sandbox.open_terminal."""

    sandbox: Sandbox
    op: ExecOp
    fd: int  # the pty master: read the command's output, write its input; -1 if it failed

    def resize(self, rows: int, cols: int) -> None:
        termios.tcsetwinsize(self.fd, (rows, cols))

    def wait(self) -> ExecResult:
        """Wait for the command to end (output may still be buffered in fd)."""
        with self.sandbox._one_exec():
            return self.sandbox._finish(self.op)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AsyncSandbox(_Facts):
    """The asyncio face of Sandbox: ``async with AsyncSandbox(spec) as sb: await sb.exec(...)``.

    Many sandboxes can be driven from one event loop; one exec at a time per sandbox.
    """

    def __init__(self, spec: SandboxSpec | None = None):
        self._core = _Core(spec or SandboxSpec())
        self._lock = asyncio.Lock()
        self._started = False
        self._busy: asyncio.Future | None = None  # the last step sent to a worker thread

    async def start(self) -> "AsyncSandbox":
        """Create the sandbox. The blocking steps (the cgroup's files, the spawn, the id
        maps, init's first reply) run in a worker thread: with a hundred sandboxes
        starting at once they held the event loop for up to a second."""
        core = self._core
        await self._in_thread(core.start, lambda _: core.destroy())
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = core.sock.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, SETUP_TIMEOUT)
        except BaseException as exc:
            loop.remove_reader(fd)
            await loop.run_in_executor(None, core.destroy)
            if isinstance(exc, asyncio.TimeoutError):
                raise SandboxError(
                    f"karotte-init did not get ready within {SETUP_TIMEOUT:.0f} s") from None
            raise
        loop.remove_reader(fd)
        await self._in_thread(self._ready, lambda _: core.destroy())
        self._started = True
        return self

    def _ready(self) -> None:
        core = self._core
        try:
            reply, fds = core.recv_with_fds()
        except BaseException:
            core.destroy()
            raise
        core.finish_start(reply, fds)

    async def _in_thread(self, fn: Callable[[], object], undo: Callable[[object], None]) -> object:
        """fn() in a worker thread, the event loop going on. If the caller is cancelled,
        fn runs to its end and undo(its result) after it, so a late spawn or exec leaves no
        init, cgroup or command behind; whichever finishes second (thread or caller) runs
        undo, with no callback on a loop that may be closing."""
        lock = threading.Lock()
        state: dict[str, object] = {}

        def run() -> object:
            result = fn()
            with lock:
                state["result"] = result
                abandoned = "abandoned" in state
            if abandoned:
                undo(result)
            return result

        loop = asyncio.get_running_loop()
        future = self._busy = loop.run_in_executor(None, run)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            with lock:
                state["abandoned"] = True
                finished = "result" in state
            if finished:
                loop.run_in_executor(None, undo, state["result"])
            raise

    async def exec(self, argv: Sequence[str] | str, *, stdin: bytes | str = b"",
                   timeout: float | None = None, env: Mapping[str, str] | None = None,
                   cwd: str | None = None,
                   on_output: Callable[[int, bytes], None] | None = None) -> ExecResult:
        """As Sandbox.exec; concurrent calls on one sandbox run one after another. The
        request and the cgroup's counters are written and read in a worker thread."""
        core = self._core
        async with self._lock:
            op = await self._in_thread(
                lambda: core.begin_exec(argv, stdin, timeout, env, cwd, on_output), ExecOp.cancel)
            try:
                await drive_async(op)
            except BaseException:
                op.cancel()
                raise
            return await self._in_thread(lambda: core.end_exec(op), lambda _: None)

    async def kill_all(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._core.kill_all)

    def kill_all_blocking(self) -> None:
        """kill_all for a worker thread (custody runs there, next to the scan)."""
        self._core.kill_all()

    def close_blocking(self) -> None:
        """close for a worker thread."""
        self._core.destroy()

    async def close(self) -> None:
        if self._busy is not None:  # a cancelled step may still run: the core is not
            await asyncio.wait({self._busy})  # to be torn down under it
        await asyncio.get_running_loop().run_in_executor(None, self._core.destroy)

    async def __aenter__(self) -> "AsyncSandbox":
        if not self._started:
            await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
