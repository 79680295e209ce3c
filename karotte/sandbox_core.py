"""One sandbox's resources, made and unmade in order, written once for both of its faces.

_Core makes the sandbox: its image root, its cgroup (or none, where the caller accepted
that), init spawned into the cgroup over a socketpair, the id maps, the GO and the plan;
then the fds of init's READY (the workspace, the overlay's upper, the egress listeners).
It carries each exec from its request to its ExecResult (the cgroup's counters and the
egress record around it), and destroy() tears everything down, idempotently: SIGKILL to
init, the reap, the cgroup confirmed empty and released. It does not wait for init's
replies: Sandbox (karotte/sandbox.py) waits for them with poll(), AsyncSandbox on the event
loop, with the blocking steps in worker threads.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
from dataclasses import replace

from . import cgroups, imageroot, lifecycle, native, net, plan, start_errors
from . import protocol as p
from .execenv import exec_cwd, exec_env
from .userns import identity
from .results import EXEC_REACHES, ExecResult
from .errors import CgroupError, HostUnsupported, SandboxClosed, SandboxError, out_of_fds
from .protections import CGROUP_LINES, NO_CGROUP
from .exec_io import KILL_GRACE, ExecOp
from .fds import fd_exhaustion, naming_fd_exhaustion
from .spec import SandboxSpec

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
        self.upper_fd: int | None = None  # on an image: the overlay's upper, the agent's diff
        self.broken: str | None = None
        self.closed = False
        self._next_id = 1
        self._oom_before = 0
        self._egress_mark = None  # where the egress record was as the running exec began
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
                    self.ip = None
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
