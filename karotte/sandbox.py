"""Sandbox: create -> exec* -> kill_all -> destroy, with a sync and an asyncio API.

One sandbox is one karotte-init (PID 1 of fresh user, PID, mount, network, IPC, UTS
and cgroup namespaces) in one cgroup. The host drives it over a private socketpair:
each exec sends the command and three pipe fds, init runs it as the agent and
reports how it ended. Output is read by the host directly from the pipes and capped.

This module is the life cycle. Each exec's I/O is a state machine of its own
(karotte/exec_io.py), which Sandbox drives with poll() and AsyncSandbox with the asyncio
event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import termios
import threading
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from . import cgroups, imageroot, lifecycle, native, net, plan, start_errors
from . import protocol as p
from .execenv import exec_cwd, exec_env
from .execenv import DEFAULT_ENV  # noqa: F401 (public here too)
from .userns import identity
from .userns import AGENT_UID, DEFAULT_UID_BASE, ns_owner_ids  # noqa: F401 (public here too)
from .results import EXEC_REACHES, ExecResult
from .errors import CgroupError, HostUnsupported, SandboxClosed, SandboxError, out_of_fds
from .protections import CGROUP_LINES, NO_CGROUP
from .exec_io import KILL_GRACE, ExecOp, drive_async, drive_sync
from .fds import fd_exhaustion, naming_fd_exhaustion
from .spec import SandboxSpec

SETUP_TIMEOUT = 10.0  # seconds for init to build the root and report ready
MAX_PASS_FDS = 5  # extra fds a command may get (MAX_FDS of csrc/init/init.h less stdio)

def _write_proc(pid: int, name: str, text: str) -> None:
    fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class _Core:
    """State shared by the sync and async faces: creation, channel, teardown."""

    def __init__(self, spec: SandboxSpec, cgroup_parent: cgroups.Cgroup | None = None):
        self._creator = os.getpid()  # a forked child's copy must not act on its init
        self._lock = threading.RLock()  # teardown: the owner, cleanup() and __del__
        self.spec = spec
        self.root: imageroot.ImageRoot | None = None  # the image, resolved at start
        self._leases = contextlib.ExitStack()  # the store's hold on the image's tree
        self.cgroup_parent = cgroup_parent
        self.cgroup: cgroups.Cgroup | None = None
        self.sock: socket.socket | None = None
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.workspace_fd: int | None = None
        self.egress = None  # the EgressSession serving its listeners (karotte/net.py)
        self.egress_closed = None  # that session once closed, for its record
        self.ip = None  # the ip mode's IpLink: its veth and nftables table (karotte/net.py)
        self.ip_closed = None  # that link once closed, for its record
        self.upper_fd: int | None = None  # on an image: the overlay's upper, the agent's diff
        self.broken: str | None = None
        self.closed = False
        self._next_id = 1
        self._oom_before = 0
        self._egress_mark = None  # where the egress record was as the running exec began
        self._ip_mark = None  # the ip mode's record as the running exec began
        self._spawn_args = None

    # -- creation: start() then finish_start(reply) once init answers

    def start(self) -> None:
        spec = self.spec
        try:
            lifecycle.refuse_if_ending("a sandbox")
            lifecycle.track(self)
            self.root = imageroot.resolve_root(spec, self._leases)
            self.cgroup = self._make_cgroup()
            if (self.cgroup is not None and not self.cgroup.swap_enforced
                    and "cgroup-swap" not in spec.allow_degraded):
                raise HostUnsupported(
                    "cgroup-swap", "this host's memory cgroup cannot forbid swap "
                    "(no memory.memsw.* files: boot with swapaccount=1, or turn swap off); "
                    "pass allow_degraded={'cgroup-swap'} to accept it")
            ident = identity()
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.sock = parent
            try:
                child_fd = child.fileno()
                if child_fd == native.CHILD_FD:
                    child_fd = os.dup(child_fd)  # dup3 onto itself would fail
                    child.close()
                    child = socket.socket(fileno=child_fd)
                cg = self.cgroup
                owner = ident.ns_owner()
                try:
                    self.pid, self.pidfd, self._spawn_args = native.spawn_init(
                        child.fileno(), cg and cg.clone_fd(), cg and cg.tasks_files(),
                        cg and cg.freezer_state_file(), owner)
                except native.SpawnError as exc:
                    raise start_errors.spawn_error(exc, cg) from exc
            finally:
                child.close()
            # A stop_all() that ran during the spawn found no pidfd here to signal.
            lifecycle.refuse_if_ending("a sandbox")
            # The child waits for the go: its ids must be in place before it. It starts
            # in its cgroup (v2: CLONE_INTO_CGROUP; v1: cloned by a thread moved there,
            # which a move of the whole trainer by someone else could undo: checked).
            if cg is not None and cg.clone_fd() is None:  # v2: CLONE_INTO_CGROUP is atomic
                cg.place(self.pid)
            if ident.deny_setgroups:
                _write_proc(self.pid, "setgroups", "deny")
            _write_proc(self.pid, "uid_map", ident.agent_uid_map(owner))
            _write_proc(self.pid, "gid_map", ident.gid_map)
            self.ip = net.start_ip(spec, self.pid)  # init waits for its go: no agent code yet
            self.send(p.Message(p.GO).to_bytes(), [])
            self._send_config(ident)
        except BaseException as exc:
            self.destroy()
            if out_of_fds(exc):
                raise fd_exhaustion() from exc
            raise

    def _send_config(self, ident) -> None:
        """The plan, and on an image for a root caller its lowers idmapped onto the sandbox's
        user namespace (an unprivileged caller's init binds them itself)."""
        root = self.root
        config = plan.config_message(self.spec, ident, root and root.tree, root and root.changes)
        if root is None or ident.nested:
            self.send(config, [])
            return
        userns = os.open(f"/proc/{self.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        try:
            lowers = imageroot.lower_fds(root, userns)
        finally:
            os.close(userns)
        try:
            self.send(config, lowers)
        finally:
            for fd in lowers:
                os.close(fd)

    def _make_cgroup(self) -> cgroups.Cgroup | None:
        spec = self.spec
        try:
            return cgroups.acquire(
                cgroups.CgroupLimits(memory=spec.memory, pids=spec.pids, cpus=spec.cpus),
                parent=self.cgroup_parent)
        except (HostUnsupported, CgroupError) as exc:
            if out_of_fds(exc):
                raise fd_exhaustion() from exc  # not the host's fault: no degrading for it
            if NO_CGROUP <= spec.allow_degraded:
                return None  # the caller accepted: no memory, pids or CPU limit
            detail = exc.detail if isinstance(exc, HostUnsupported) else str(exc)
            raise HostUnsupported(
                CGROUP_LINES, f"{detail}. Without a cgroup the sandbox has no memory, process or "
                "CPU limit; pass allow_degraded=karotte.protections.NO_CGROUP (every cgroup-* "
                "line) to run without one") from exc

    def finish_start(self, reply: p.Reply | None, fds: list[int]) -> None:
        self._spawn_args = None  # init has exec'd (or died): its arguments may go
        if reply is not None and reply.type == p.READY and fds:
            self.workspace_fd = fds[0]
            if self.root is not None and len(fds) > 1:
                self.upper_fd = fds[1]
            if self.root is not None and self.upper_fd is None:
                self.destroy()
                raise SandboxError("karotte-init sent no fd of the overlay's upper with READY; "
                                   "rebuild it (pip install -e .) so that it matches karotte")
            try:
                self.egress = net.start_egress(self.spec, fds[1 + (self.upper_fd is not None):])
            except BaseException:
                self.destroy()
                raise
            try:
                # An OOM should kill the agent's processes, not init (which resets this for
                # each command). Only now: until its exec init shared our memory, and the
                # kernel applies it to every process sharing that, the trainer too. Needs
                # CAP_SYS_RESOURCE; without it init stays the smallest candidate.
                _write_proc(self.pid, "oom_score_adj", "-1000")
            except PermissionError:
                pass
            except OSError as exc:
                self.destroy()
                raise (fd_exhaustion() if out_of_fds(exc) else exc) from exc
            return
        for fd in fds:
            os.close(fd)
        error = start_errors.init_gone(self.pidfd) if reply is None else (
            start_errors.setup_error(reply) if reply.type == p.SETUP_ERR
            else SandboxError(f"unexpected first message {reply.type} from karotte-init"))
        self.destroy()
        raise error

    # -- channel

    def send(self, data: bytes, fds: list[int]) -> None:
        if self.sock is None:
            raise SandboxClosed("the sandbox is closed")
        try:
            socket.send_fds(self.sock, [data], fds)
        except (BrokenPipeError, ConnectionResetError) as exc:
            self.mark_broken("the sandbox's init is gone")
            raise SandboxClosed("the sandbox's init is gone (killed, or died of OOM); "
                                "create a new sandbox") from exc

    def recv_with_fds(self) -> tuple[p.Reply | None, list[int]]:
        try:
            data, fds, flags = p.recv(self.sock, 3 + net.MAX_UPSTREAMS)
        except (BlockingIOError, InterruptedError):
            raise
        except OSError:
            return None, []
        if flags & socket.MSG_CTRUNC:  # the kernel dropped fds we had no room for
            for fd in fds:
                os.close(fd)
            self.mark_broken("file descriptors sent by init were dropped")
            raise fd_exhaustion()
        if not data:
            return None, fds
        return p.parse(data), fds

    def signal(self, exec_id: int, sig: int) -> None:
        try:
            self.send(p.Message(p.SIGNAL, exec_id).u32(p.T_SIGNAL, sig).to_bytes(), [])
        except SandboxClosed:
            pass

    def mark_broken(self, why: str) -> None:
        if self.broken is None:
            self.broken = why

    # -- exec

    @naming_fd_exhaustion
    def begin_exec(self, argv, stdin, timeout, env, cwd, on_output=None,
                   terminal=False, pass_fds=()) -> ExecOp:
        if self.closed:
            raise SandboxClosed("the sandbox is closed")
        if self.broken:
            raise SandboxClosed(f"{self.broken}; create a new sandbox")
        if isinstance(argv, str):
            argv = ["/bin/sh", "-c", argv]
        argv = [os.fsdecode(a) for a in argv]
        if not argv:
            raise ValueError("exec needs a command")
        full_env = exec_env(self.spec, env, self.root)
        if isinstance(stdin, str):
            stdin = stdin.encode()
        timeout = self.spec.timeout if timeout is None else float(timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if len(pass_fds) > MAX_PASS_FDS:
            raise ValueError(f"at most {MAX_PASS_FDS} extra fds can be passed, got {len(pass_fds)}")
        if self.cgroup is not None:
            self.cgroup.reset_memory_peak()
            self._oom_before = self.cgroup.oom_kills()
        self._egress_mark = self.egress.mark() if self.egress is not None else None
        self._ip_mark = self.ip.record() if self.ip is not None else None
        exec_id = self._next_id
        self._next_id += 1
        return ExecOp(self, exec_id, argv, stdin or b"", timeout, full_env,
                       exec_cwd(cwd, self.root), on_output, terminal, pass_fds)

    @naming_fd_exhaustion
    def end_exec(self, op: ExecOp) -> ExecResult:
        peak, oom = None, False
        if self.cgroup is not None:
            peak = self.cgroup.memory_peak()
            oom = self.cgroup.oom_kills() > self._oom_before
        result = op.result(peak, oom)
        if self.ip is not None:  # what the rules counted while it ran (docs/egress.md)
            return replace(result, egress_ip=self.ip.record().since(self._ip_mark)
                           .bounded(EXEC_REACHES))
        if self.egress is None:
            return result
        # every reach opened from the exec's start to its end, by whichever of the
        # sandbox's processes (docs/egress.md, "The record of each exec")
        return replace(result, egress=self.egress.since(self._egress_mark, EXEC_REACHES)
                       .bounded(EXEC_REACHES))

    # -- teardown

    @naming_fd_exhaustion
    def kill_all(self) -> None:
        """Kill every process of the sandbox, init included, and confirm none is left.

        SIGKILL to init first: the kernel then kills every process of the PID namespace,
        forks racing it included, and lets init's exit complete only once all of them
        are reaped. The cgroup kill after it confirms the cgroup is empty (and, without
        a PID namespace to lean on, would freeze and kill by itself)."""
        with self._lock:
            if self.cgroup is not None and not self.cgroup.owned_here():
                # A forked child's copy: the cgroup is its creator's, which may have reused
                # it for another sandbox by now; the pidfd still names this one's init.
                self.cgroup = None
            if self.pidfd is not None:
                try:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                waiter = select.poll()  # not select(): fds above 1024 are common here
                waiter.register(self.pidfd, select.POLLIN)
                exited = bool(waiter.poll(KILL_GRACE * 1000))
            if self.cgroup is not None:
                self.cgroup.kill_all()
            if self.pidfd is not None:
                if not exited and self.cgroup is None:
                    raise SandboxError(f"init (pid {self.pid}) did not exit within "
                                       f"{KILL_GRACE:g} s of SIGKILL; a process may be stuck "
                                       "in the kernel (state D)")
                try:
                    os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED)  # reap: init is our child
                except ChildProcessError:
                    pass  # a forked child's copy: init is its creator's to reap
                os.close(self.pidfd)
                self.pidfd = None
            self.mark_broken("the sandbox was killed")

    def stop(self) -> None:
        """SIGKILL to init and nothing more (lifecycle.stop_all), which kills the PID
        namespace. Safe in a signal handler and beside a thread using the sandbox: it
        closes nothing, and that thread's teardown reaps. (A pidfd number reused meanwhile
        is another sandbox's, and every sandbox is being stopped.)"""
        pidfd = self.pidfd
        if pidfd is None or self._creator != os.getpid():
            return
        self.mark_broken("the process is ending: every sandbox was stopped")
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:  # exited already, or the fd is gone
            pass

    def destroy(self, reuse_cgroup: bool = True) -> None:
        """Kill, reap, close and release. Idempotent; a call after an interrupted one
        (an exception raised by a signal handler) finishes what that one left, which
        lifecycle.cleanup() relies on."""
        with self._lock:
            self.closed = True
            try:
                self.kill_all()
            finally:
                if self.egress is not None:
                    self.egress.close()
                    self.egress_closed, self.egress = self.egress, None  # its record stays
                if self.ip is not None:
                    self.ip.close()
                    self.ip_closed, self.ip = self.ip, None  # its record stays
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None
                for name in ("workspace_fd", "upper_fd"):
                    fd = getattr(self, name)
                    if fd is not None:
                        setattr(self, name, None)
                        os.close(fd)
                if self.cgroup is not None:
                    # kill_all() confirmed it empty: it may be reused
                    (self.cgroup.release if reuse_cgroup else self.cgroup.destroy)()
                    self.cgroup = None
                if self.pidfd is None:
                    self._leases.close()  # the tree is no longer in use: gc may take it
                    lifecycle.forget(self)

    def __del__(self) -> None:
        # Dropped without close() (a Sandbox never closed, an AsyncSandbox never awaited
        # to its end): destroy it now, not when the process ends, and reap its init. Not
        # into the cgroup pool: a garbage collection can run this inside the pool's lock.
        # Not in a forked child: the sandbox is its parent's.
        if (self.pidfd is not None or self.cgroup is not None or self.sock is not None) \
                and self._creator == os.getpid():
            self.destroy(reuse_cgroup=False)


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

    def ip_record(self):
        """What the ip mode's rules counted so far, after close() all of it (a frozen
        karotte.results.IpRecord), or None in the other modes."""
        link = self._core.ip or self._core.ip_closed
        return link.record() if link is not None else None


class Sandbox(_Facts):
    """A live sandbox. Use as a context manager; exit always cleans up.

        with Sandbox(SandboxSpec(memory=512 * MiB)) as sb:
            r = sb.exec(["python3", "-c", "print(42)"])
    """

    def __init__(self, spec: SandboxSpec | None = None, *,
                 cgroup_parent: cgroups.Cgroup | None = None):
        """cgroup_parent nests this sandbox's cgroup under another (which, on cgroup v2,
        must hold no processes): its limits then bound this one too."""
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
        op = self._core.begin_exec(argv, stdin, timeout, env, cwd, on_output,
                                   pass_fds=pass_fds)
        return self._finish(op)

    def open_terminal(self, argv: Sequence[str] | str, *, timeout: float | None = None,
                      env: Mapping[str, str] | None = None,
                      cwd: str | None = None) -> "Terminal":
        """Start a command on a new pty of the sandbox (its controlling terminal).

        Relay Terminal.fd (the pty master) yourself, then call Terminal.wait().
        """
        op = self._core.begin_exec(argv, b"", timeout, env, cwd, terminal=True)
        try:
            drive_sync(op, until=lambda: op.terminal_fd is not None)
        except BaseException:
            op.cancel()
            raise
        if op.terminal_fd is None:  # it could not start
            return Terminal(self, op, -1)
        return Terminal(self, op, op.terminal_fd)

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
