"""One exec's I/O: its pipes, the output caps, the pacing of reads, and its deadlines.

ExecOp is a small state machine that says which fds it waits on and until when; a
driver reports readiness and the passing of time. drive_sync drives it with poll(),
drive_async with the asyncio event loop, so the logic is written once. The sandbox's life
cycle (karotte/sandbox.py) makes one per exec and hands it its channel to init, an
ExecChannel. Why the reads are paced: docs/exec-io.md.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import select
import signal
import socket
import time
from typing import Callable, Mapping, Protocol, Sequence

from . import protocol as p
from .fds import naming_fd_exhaustion
from .results import ExecResult
from .spec import SandboxSpec

DRAIN_GRACE = 0.05  # after exit, how long to wait for output held open by background jobs
KILL_GRACE = 5.0  # after a timeout kill, how long the exit report may take
# Past output_limit, a stream is spliced into /dev/null, OVERFLOW_PIPE_SIZE at most once
# per OVERFLOW_READ_INTERVAL: a flood drained at the agent's pace cost the trainer a core.
OVERFLOW_READ_INTERVAL = 0.004
OVERFLOW_PIPE_SIZE = 1 << 20
# Below it, small reads (< SMALL_READ) that come less than SMALL_READ_INTERVAL apart wait
# that long before the next, so a byte-at-a-time writer is read in batches.
SMALL_READ = 4096
SMALL_READ_INTERVAL = 0.001


class ExecChannel(Protocol):
    """What an exec uses of its sandbox: the spec, the channel to init, and the note that
    the sandbox broke."""

    @property
    def spec(self) -> SandboxSpec: ...

    @property
    def sock(self) -> socket.socket | None: ...

    @property
    def broken(self) -> str | None: ...

    def send(self, data: bytes, fds: list[int]) -> None: ...

    def recv_with_fds(self) -> tuple[p.Reply | None, list[int]]: ...

    def signal(self, exec_id: int, sig: int) -> None: ...

    def mark_broken(self, why: str) -> None: ...


class _Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.chunks: list[bytes] = []
        self.kept = 0
        self.truncated = False

    def feed(self, data: bytes) -> None:
        room = self.limit - self.kept
        if len(data) > room:
            self.truncated = True
            data = data[:room]
        if data:
            self.chunks.append(data)
            self.kept += len(data)

    def value(self) -> bytes:
        return b"".join(self.chunks)


class ExecOp:
    """One exec as a state machine: the driver asks what to wait for, and reports
    readiness and the passing of time. It owns the host ends of the three pipes."""

    def __init__(self, core: ExecChannel, exec_id: int, argv: list[str], stdin: bytes,
                 timeout: float, env: Mapping[str, str], cwd: str,
                 on_output: Callable[[int, bytes], None] | None = None,
                 terminal: bool = False, pass_fds: Sequence[int] = ()):
        self.core = core
        self.on_output = on_output
        self.id = exec_id
        self.timeout = timeout
        self.out = _Capture(core.spec.output_limit)
        self.err = _Capture(core.spec.output_limit)
        self.stdin = memoryview(stdin)
        self.exit_reply: p.Reply | None = None
        self.error: str | None = None
        self.error_step: str | None = None
        self.timed_out = False
        self.kill_deadline: float | None = None
        self.drain_deadline: float | None = None
        self.init_died = False

        msg = p.Message(p.EXEC, exec_id)
        msg.strings(p.T_ARGV, argv)
        msg.strings(p.T_ENV, [f"{k}={v}" for k, v in env.items()])
        msg.string(p.T_CWD, cwd)
        self.readers: dict[int, _Capture] = {}
        self.paced: dict[int, float] = {}  # reader past its limit -> when to read it next
        self.overflowing: set[int] = set()  # readers past their limit: drained, not kept
        self.sink: int | None = None  # /dev/null, open while a reader is overflowing
        self.last_read: dict[int, float] = {}  # reader -> when it was last read
        self.stdin_fd: int | None = None
        self.terminal_fd: int | None = None  # the pty master, once init sends it
        if terminal:
            # init makes the pty in the sandbox's devpts; the caller relays its master.
            msg.record(p.T_TTY)
            core.send(msg.to_bytes(), [])
        else:
            pipes: list[tuple[int, int]] = []
            try:
                while len(pipes) < 3:
                    pipes.append(os.pipe2(os.O_CLOEXEC))
            except BaseException:
                for fd in (fd for pipe in pipes for fd in pipe):
                    os.close(fd)
                raise
            (in_r, in_w), (out_r, out_w), (err_r, err_w) = pipes
            for fd in (in_w, out_r, err_r):
                os.set_blocking(fd, False)
            try:
                core.send(msg.to_bytes(), [in_r, out_w, err_w, *pass_fds])
            except BaseException:
                for fd in (in_w, out_r, err_r):
                    os.close(fd)
                raise
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            self.readers = {out_r: self.out, err_r: self.err}
            self.stdin_fd = in_w
        if not self.stdin:
            self._close_stdin()
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.end: float | None = None

    # -- what the driver waits on

    @property
    def done(self) -> bool:
        return (self.exit_reply is not None or self.error is not None or self.init_died) \
            and not self.readers

    def want_read(self) -> list[int]:
        fds = [fd for fd in self.readers if fd not in self.paced]
        if self.exit_reply is None and self.error is None and not self.init_died:
            fds.append(self.core.sock.fileno())
        return fds

    def want_write(self) -> list[int]:
        return [self.stdin_fd] if self.stdin_fd is not None else []

    def next_deadline(self) -> float:
        if self.drain_deadline is not None:
            due = self.drain_deadline
        elif self.kill_deadline is not None:
            due = self.kill_deadline
        else:
            due = self.deadline
        return min(due, *self.paced.values()) if self.paced else due

    # -- events

    @naming_fd_exhaustion
    def on_readable(self, fd: int) -> None:
        if fd == self.core.sock.fileno():
            self._on_reply()
            return
        capture = self.readers.get(fd)
        if capture is None:
            return
        if fd in self.overflowing:
            try:
                moved = os.splice(fd, self.sink, OVERFLOW_PIPE_SIZE, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                return
            if moved:
                self.paced[fd] = time.monotonic() + OVERFLOW_READ_INTERVAL
            else:
                self._close_reader(fd)
            return
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if data:
            capture.feed(data)
            if self.on_output is not None:
                self.on_output(1 if capture is self.out else 2, data)
            elif capture.truncated:
                self._overflow(fd)
            elif len(data) < SMALL_READ:
                now = time.monotonic()
                if now - self.last_read.get(fd, -1.0) < SMALL_READ_INTERVAL:
                    self.paced[fd] = now + SMALL_READ_INTERVAL
                self.last_read[fd] = now
        else:
            self._close_reader(fd)

    def _overflow(self, fd: int) -> None:
        """From now on fd's stream is drained at a paced rate and dropped."""
        if self.sink is None:
            self.sink = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        self.overflowing.add(fd)
        self.paced[fd] = time.monotonic() + OVERFLOW_READ_INTERVAL
        try:  # fewer, larger drains; the kernel may refuse (the user's pipe-buffer quota)
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, OVERFLOW_PIPE_SIZE)
        except OSError:
            pass

    def on_writable(self, fd: int) -> None:
        try:
            n = os.write(fd, self.stdin[:65536])
        except BlockingIOError:
            return
        except BrokenPipeError:
            n = len(self.stdin)  # the command stopped reading; drop the rest
        self.stdin = self.stdin[n:]
        if not self.stdin:
            self._close_stdin()

    def on_time(self, now: float) -> None:
        for fd, due in list(self.paced.items()):
            if now >= due:
                del self.paced[fd]
        if self.drain_deadline is not None and now >= self.drain_deadline:
            for fd in list(self.readers):  # background jobs hold the pipes: stop waiting
                self._close_reader(fd)
        elif self.kill_deadline is not None and now >= self.kill_deadline:
            self.core.mark_broken("init did not report the exit of a killed command")
            self.init_died = True
            self._finish(now)
        elif not self.timed_out and now >= self.deadline:
            self.timed_out = True
            self.core.signal(self.id, signal.SIGKILL)
            self.kill_deadline = now + KILL_GRACE

    def _on_reply(self) -> None:
        reply, fds = self.core.recv_with_fds()
        now = time.monotonic()
        if reply is not None and reply.type == p.TTY and reply.id == self.id and fds:
            self.terminal_fd = fds.pop(0)
        for fd in fds:
            os.close(fd)
        if reply is None:
            self.core.mark_broken("the sandbox's init is gone (killed, or died of OOM)")
            self.init_died = True
            self._finish(now)
        elif reply.id != self.id:
            return  # stale report of an earlier, abandoned exec
        elif reply.type == p.EXITED:
            self.exit_reply = reply
            self._finish(now)
        elif reply.type == p.EXEC_ERR:
            err = reply.u32(p.T_ERRNO)
            self.error = f"{reply.text(p.T_WHAT)}: {os.strerror(err)}"
            self.error_step = reply.step
            self._finish(now)

    def _finish(self, now: float) -> None:
        self.end = now
        self.drain_deadline = now + DRAIN_GRACE
        self._close_stdin()

    def _close_reader(self, fd: int) -> None:
        del self.readers[fd]
        self.paced.pop(fd, None)
        self.last_read.pop(fd, None)
        self.overflowing.discard(fd)
        os.close(fd)
        if not self.overflowing and self.sink is not None:
            os.close(self.sink)
            self.sink = None

    def _close_stdin(self) -> None:
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None

    def cancel(self) -> None:
        """Close everything and have init kill the command (the exec was cancelled or the
        driver failed)."""
        for fd in list(self.readers):
            self._close_reader(fd)
        self._close_stdin()
        self.core.signal(self.id, signal.SIGKILL)

    def result(self, peak: int | None, oom: bool) -> ExecResult:
        wall = (self.end or time.monotonic()) - self.start
        exit_code = sig = None
        cpu = 0.0
        error = self.error
        if self.exit_reply is not None:
            status = self.exit_reply.u32(p.T_WAIT_STATUS)
            if os.WIFEXITED(status):
                exit_code = os.WEXITSTATUS(status)
            elif os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
            user, system, _ = p.rusage(self.exit_reply)
            cpu = user + system
        elif error is not None:
            exit_code = 127
        else:
            sig = signal.SIGKILL  # init died with the command (e.g. the sandbox OOM-killed)
            error = self.core.broken or "the sandbox's init died"
        stderr = self.err.value()
        if error is not None and self.exit_reply is None:
            stderr += f"karotte: {error}\n".encode()
        return ExecResult(exit_code, sig, self.out.value(), stderr, self.out.truncated,
                          self.err.truncated, self.timed_out, oom, wall, cpu, peak, error,
                          self.error_step if error == self.error else None)


def drive_sync(op: ExecOp, until: Callable[[], bool] = lambda: False) -> None:
    """Run op with poll() until it is done (or until() says stop)."""
    poller = select.poll()
    while not op.done and not until():
        registered = {}
        for fd in op.want_read():
            registered[fd] = select.POLLIN
        for fd in op.want_write():
            registered[fd] = registered.get(fd, 0) | select.POLLOUT
        for fd, mask in registered.items():
            poller.register(fd, mask)
        wait = max(0.0, op.next_deadline() - time.monotonic())
        events = poller.poll(wait * 1000)
        for fd in registered:
            poller.unregister(fd)
        for fd, ev in events:
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                if fd in op.want_read():
                    op.on_readable(fd)
            if ev & (select.POLLOUT | select.POLLERR) and fd in op.want_write():
                op.on_writable(fd)
        op.on_time(time.monotonic())


async def drive_async(op: ExecOp) -> None:
    """Run op on the running asyncio loop until it is done."""
    loop = asyncio.get_running_loop()
    while not op.done:
        woke = loop.create_future()
        ready: list[tuple[int, bool]] = []

        def wake(fd: int, is_read: bool) -> None:
            ready.append((fd, is_read))
            if not woke.done():
                woke.set_result(None)

        reads, writes = op.want_read(), op.want_write()
        for fd in reads:
            loop.add_reader(fd, wake, fd, True)
        for fd in writes:
            loop.add_writer(fd, wake, fd, False)
        timer = loop.call_at(loop.time() + max(0.0, op.next_deadline() - time.monotonic()),
                             lambda: woke.done() or woke.set_result(None))
        try:
            await woke
        finally:
            timer.cancel()
            for fd in reads:
                loop.remove_reader(fd)
            for fd in writes:
                loop.remove_writer(fd)
        for fd, is_read in ready:
            if is_read and fd in op.want_read():
                op.on_readable(fd)
            elif not is_read and fd in op.want_write():
                op.on_writable(fd)
        op.on_time(time.monotonic())
