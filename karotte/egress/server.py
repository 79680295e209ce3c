"""Where the proxy runs: one thread with its own event loop, in the process that made
the sandboxes (docs/egress.md, "Where the proxy runs").

The thread's loop is not the trainer's, so a trainer that blocks its own loop does not
stall the agents' traffic; it is a daemon thread of the trainer's process, so no proxy
outlives a trainer that crashes. Each sandbox is one EgressSession: its listeners (made
inside the sandbox's network namespace, karotte/net.py), its Gate, and its connections,
which close with it.

A sandbox's start and end do not wake the proxy's thread: its listeners go into an epoll
set of the proxy's own, which the loop watches as one reader, straight from the caller's
thread (epoll_ctl is safe beside a thread waiting in the loop), and a session with no
connection open is closed there too. Only an accepted connection runs on the loop, and
only a close that must cut connections wakes it (docs/egress.md, "What it costs").
"""
from __future__ import annotations

import asyncio
import errno
import os
import select
import socket
import threading
from collections.abc import Mapping

from .check import Resolver, system_resolver
from .http1 import BUFFER
from .policy import EgressConfigError, EgressPolicy, Upstream
from .proxy import Gate, serve
from .record import EgressRecord

ACCEPTS_PER_WAKEUP = 64  # so that one sandbox's backlog does not hold the loop
_OUT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class EgressSession:
    """One sandbox's egress, served by an EgressProxy until close().

    Its lock orders the loop's accepts against close() on the caller's thread: a listener
    is accepted on only while the session is open, so a listener's fd number, closed and
    given to another sandbox's listener, never leads a connection to this session."""

    def __init__(self, proxy: EgressProxy, gate: Gate):
        self._proxy, self._gate = proxy, gate
        self._lock = threading.Lock()
        self._servers: list[socket.socket] = []  # the listeners, while they are accepted on
        self._tasks: set[asyncio.Task] = set()  # one per accepted connection still open
        self._stopped = False
        self._cutting = False

    @property
    def policy(self) -> EgressPolicy:
        return self._gate.policy

    def record(self) -> EgressRecord:
        """What the sandbox reached so far (safe from any thread)."""
        return self._gate.log.snapshot()

    def mark(self) -> tuple[int, int]:
        """Where the record is now, for since() (safe from any thread)."""
        return self._gate.log.mark()

    def since(self, mark: tuple[int, int], limit: int) -> EgressRecord:
        """What the sandbox reached after mark: at most `limit` reaches, the rest counted
        (an exec's record, ExecResult.egress)."""
        return self._gate.log.since(mark, limit)

    def close(self, wait: bool = False) -> None:
        """Stop accepting and cut every open connection; idempotent. The listeners close
        here and now; open connections are cut by the proxy's loop, which the caller waits
        for only with wait=True (a sandbox's teardown does not: its listeners lead nowhere
        once its namespace is gone)."""
        if os.getpid() != self._proxy.pid:
            return  # a forked child's copy: the epoll set and the listeners are its parent's
        with self._lock:
            if not self._stopped:
                self._stopped = True
                for sock in self._servers:
                    self._proxy._unlisten(sock)
                self._servers.clear()
                self._proxy._sessions.discard(self)
            live = bool(self._tasks)
        loop = self._proxy.loop
        if loop.is_closed():
            return
        if wait:
            asyncio.run_coroutine_threadsafe(self._cut(), loop).result()
        elif live and not self._cutting:
            self._cutting = True
            loop.call_soon_threadsafe(self._cancel)

    def _listen(self, listeners: Mapping[str | None, socket.socket]) -> None:
        with self._lock:
            for name, sock in listeners.items():
                up = None if name is None else self._gate.policy.upstream(name)
                sock.setblocking(False)
                self._servers.append(sock)
                self._proxy._listen(sock, self, up)

    def _accept(self, listener: socket.socket, fd: int, up: Upstream | None) -> None:
        """On the loop: take what waits in the listener's backlog."""
        loop = self._proxy.loop
        with self._lock:
            if self._stopped or listener.fileno() != fd:
                return  # closed since the epoll set said it was ready
            for _ in range(ACCEPTS_PER_WAKEUP):
                try:
                    conn, _addr = listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    return
                except OSError as exc:
                    if exc.errno in _OUT_OF:
                        # out of fds or memory: the backlog waits a second, rather than
                        # the loop spinning on a listener that stays ready
                        self._proxy._accepting.modify(fd, 0)
                        loop.call_later(1.0, self._resume, listener, fd)
                        return
                    # a listener that cannot accept is closed: the agent's connect then
                    # fails at once, never waits in a backlog nobody takes
                    self._servers.remove(listener)
                    self._proxy._unlisten(listener)
                    raise
                task = loop.create_task(self._connection(conn, up))
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _resume(self, listener: socket.socket, fd: int) -> None:
        with self._lock:
            if not self._stopped and listener.fileno() == fd:
                self._proxy._accepting.modify(fd, select.EPOLLIN)

    def _done(self, task: asyncio.Task) -> None:
        with self._lock:
            self._tasks.discard(task)

    def _cancel(self) -> None:
        with self._lock:
            tasks = list(self._tasks)
        for task in tasks:
            task.cancel()

    async def _cut(self) -> None:
        self._cancel()
        with self._lock:
            tasks = list(self._tasks)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, conn: socket.socket, up: Upstream | None) -> None:
        # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP, and a
        # listener made with proto 0 (init's, a test's) accepts those with 0: without it a
        # response's head and body wait on a delayed ACK (40 ms)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader, writer = await asyncio.open_connection(sock=conn, limit=BUFFER)
        except BaseException:
            conn.close()
            raise
        try:
            await serve(self._gate, reader, writer, up)
        finally:
            writer.transport.abort()


def listeners_of(policy: EgressPolicy, proxy: socket.socket | None,
                 upstreams: Mapping[str, socket.socket] | None
                 ) -> dict[str | None, socket.socket]:
    """The listeners of a session by upstream name (None: the forward proxy), checked
    against the policy's upstreams."""
    upstreams = dict(upstreams or {})
    names = {u.name for u in policy.upstreams}
    if set(upstreams) != names:
        raise EgressConfigError(f"listeners for upstreams {sorted(upstreams)} but the "
                                f"policy names {sorted(names)}: give one listener each")
    listeners: dict[str | None, socket.socket] = dict(upstreams)
    if proxy is not None:
        listeners[None] = proxy
    return listeners


class EgressProxy:
    """The egress proxy of this process: start() once, serve() each sandbox."""

    def __init__(self, resolve: Resolver = system_resolver):
        self._resolve = resolve
        self.pid = os.getpid()  # the process whose thread serves it
        self.loop = asyncio.new_event_loop()
        self._sessions: set[EgressSession] = set()
        # every session's listeners, by fd: one reader of the loop for all of them
        self._accepting = select.epoll()
        self._listeners: dict[int, tuple[EgressSession, socket.socket, Upstream | None]] = {}
        self.loop.add_reader(self._accepting.fileno(), self._ready)
        self._thread = threading.Thread(target=self._run, name="karotte-egress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def serve(self, policy: EgressPolicy, proxy: socket.socket | None = None,
              upstreams: Mapping[str, socket.socket] | None = None) -> EgressSession:
        """Serve a sandbox's listeners: `proxy` (the forward proxy) and one per named
        upstream of the policy. The sockets are listening; the proxy takes them over."""
        listeners = listeners_of(policy, proxy, upstreams)
        if self.loop.is_closed():
            raise EgressConfigError("this EgressProxy is closed: serve with a new one")
        session = EgressSession(self, Gate(policy, self._resolve))
        # No round trip to the loop: a connection that comes before the loop sees the
        # listener ready waits in the kernel's backlog
        try:
            session._listen(listeners)
        except BaseException:
            # an agent connecting then gets a refusal at once, never a hang in the backlog
            session.close()
            for sock in listeners.values():
                sock.close()
            raise
        self._sessions.add(session)
        return session

    def _listen(self, sock: socket.socket, session: EgressSession,
                up: Upstream | None) -> None:
        # in the table before the epoll set, so that any readiness finds its session
        self._listeners[sock.fileno()] = (session, sock, up)
        try:
            self._accepting.register(sock.fileno(), select.EPOLLIN)
        except BaseException:
            del self._listeners[sock.fileno()]
            raise

    def _unlisten(self, sock: socket.socket) -> None:
        """Under the session's lock: out of the epoll set and the table, then closed."""
        fd = sock.fileno()
        entry = self._listeners.get(fd)
        if entry is not None and entry[1] is sock:
            del self._listeners[fd]
            self._accepting.unregister(fd)
        sock.close()

    def _ready(self) -> None:
        """On the loop: the epoll set has listeners with connections waiting."""
        for fd, _events in self._accepting.poll(0, ACCEPTS_PER_WAKEUP):
            target = self._listeners.get(fd)
            if target is not None:
                session, sock, up = target
                session._accept(sock, fd, up)

    def close(self) -> None:
        """Stop the loop and its thread; sessions still open are cut."""
        if self.loop.is_closed():
            return
        for session in list(self._sessions):
            session.close(wait=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.remove_reader(self._accepting.fileno())
        self.loop.close()
        self._accepting.close()

    def __enter__(self) -> EgressProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
