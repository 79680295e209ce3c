"""Where the proxy runs: one thread with its own event loop, in the process that made
the sandboxes (docs/egress.md, "Where the proxy runs").

The thread's loop is not the trainer's, so a trainer that blocks its own loop does not
stall the agents' traffic; it is a daemon thread of the trainer's process, so no proxy
outlives a trainer that crashes. Each sandbox is one EgressSession: its listeners (made
inside the sandbox's network namespace, karotte/net.py), its Gate, and its connections,
which close with it.
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Mapping

from .check import Resolver, system_resolver
from .http1 import BUFFER
from .policy import EgressConfigError, EgressPolicy
from .proxy import Gate, serve
from .record import EgressRecord


class EgressSession:
    """One sandbox's egress, served by an EgressProxy until close()."""

    def __init__(self, proxy: EgressProxy, gate: Gate):
        self._proxy, self._gate = proxy, gate
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task] = set()
        self._starting: asyncio.Task | None = None  # _start, on the proxy's loop
        self._closing = None

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
        """Stop accepting and cut every open connection; idempotent. The proxy's loop
        does it at once; the caller waits for it only with wait=True (a sandbox's
        teardown does not: its listeners lead nowhere once its namespace is gone)."""
        if self._proxy.loop.is_closed():
            return
        if self._closing is None:
            self._closing = asyncio.run_coroutine_threadsafe(self._close(), self._proxy.loop)
        if wait:
            self._closing.result()

    async def _close(self) -> None:
        # Scheduled after _start (call_soon_threadsafe keeps the order), it may still
        # find _start waiting inside start_server: the servers it adds are closed too.
        await asyncio.wait({self._starting})
        for server in self._servers:
            server.close()
        self._servers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._proxy._sessions.discard(self)

    async def _start(self, listeners: Mapping[str | None, socket.socket]) -> None:
        self._starting = asyncio.current_task()
        try:
            await self._listen(listeners)
        except BaseException:
            # an agent connecting then gets a refusal at once, never a hang in the backlog
            for sock in listeners.values():
                sock.close()
            raise

    async def _listen(self, listeners: Mapping[str | None, socket.socket]) -> None:
        for name, sock in listeners.items():
            up = None if name is None else self._gate.policy.upstream(name)

            async def accepted(reader, writer, up=up):
                # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP,
                # and a listener made with proto 0 (init's, a test's) accepts those with 0:
                # without it a response's head and body wait on a delayed ACK (40 ms)
                writer.get_extra_info("socket").setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # close() cancels the inner task; this callback itself ends normally
                task = asyncio.ensure_future(serve(self._gate, reader, writer, up))
                self._tasks.add(task)
                try:
                    await asyncio.wait({task})
                finally:
                    self._tasks.discard(task)
                    writer.transport.abort()
            self._servers.append(await asyncio.start_server(accepted, sock=sock,
                                                            limit=BUFFER))


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
        session = EgressSession(self, Gate(policy, self._resolve))
        # Not waited for: the listeners already listen, so a connection that comes before
        # the loop takes them over waits in the kernel's backlog (create costs no round trip)
        asyncio.run_coroutine_threadsafe(session._start(listeners), self.loop)
        self._sessions.add(session)
        return session

    def close(self) -> None:
        """Stop the loop and its thread; sessions still open are cut."""
        if self.loop.is_closed():
            return
        for session in list(self._sessions):
            session.close(wait=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def __enter__(self) -> EgressProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
