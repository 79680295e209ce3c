"""The egress proxy in a small process of its own, a child of the trainer's.

An EgressProxy thread shares the trainer's GIL: a trainer that computes in Python takes
most of its throughput and adds up to a switch interval (5 ms) to each request
(docs/egress.md, "Where the proxy runs"). EgressProcess runs the same EgressProxy in a
child process and drives it over a Unix socketpair: each sandbox's listeners go to it
with SCM_RIGHTS, records come back on request. The child ends when its end of the pair
reads EOF, which is when the trainer closes it or dies, however it dies: no proxy
outlives its trainer, and no sandbox's listener outlives its proxy.

The pair carries pickles between the trainer and its own child only; no byte of it comes
from a sandbox.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from .check import static_resolver, system_resolver
from .policy import EgressPolicy
from .record import EgressRecord
from .server import EgressProxy, listeners_of

MAX_MESSAGE = 1 << 20


class ProcessSession:
    """One sandbox's egress, served by an EgressProcess until close()."""

    def __init__(self, owner: EgressProcess, number: int, policy: EgressPolicy):
        self._owner, self._number, self.policy = owner, number, policy
        self._closed = False

    def record(self) -> EgressRecord:
        """What the sandbox reached so far, as the proxy's process holds it."""
        if self._closed:
            return self._last
        return self._owner._call("record", self._number)

    def mark(self) -> tuple[int, int]:
        """As EgressSession.mark, while the session is open (a round trip)."""
        return self._owner._call("mark", self._number)

    def since(self, mark: tuple[int, int], limit: int) -> EgressRecord:
        """As EgressSession.since, while the session is open (a round trip)."""
        return self._owner._call("since", self._number, mark, limit)

    def close(self, wait: bool = False) -> None:
        """Stop serving the sandbox's listeners; idempotent. The record stays readable."""
        if not self._closed:
            self._last = self._owner._call("close", self._number)
            self._closed = True


class EgressProcess:
    """The egress proxy in a child process: serve() each sandbox, close() at the end.

    hosts: a fixed resolver table for the child (names -> addresses), for pinned hosts
    and for tests; None: the host's resolver."""

    def __init__(self, hosts: Mapping[str, Sequence[str]] | None = None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # the child imports this very karotte, installed or not
        top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join([top] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", "import sys; from karotte.egress.process import "
                 "serve_channel; serve_channel(int(sys.argv[1]))", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path})
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._next = 0
        self.pid = os.getpid()  # the process whose child it is
        self.child_pid = self._child.pid
        self._call("hosts", 0, dict(hosts) if hosts is not None else None)

    def serve(self, policy: EgressPolicy, proxy: socket.socket | None = None,
              upstreams: Mapping[str, socket.socket] | None = None) -> ProcessSession:
        """As EgressProxy.serve; the sockets go to the child (closed here)."""
        listeners = listeners_of(policy, proxy, upstreams)
        with self._lock:
            self._next += 1
            number = self._next
        names = list(listeners)
        try:
            self._call("serve", number, policy, names,
                       fds=[sock.fileno() for sock in listeners.values()])
        finally:
            for sock in listeners.values():
                sock.close()
        return ProcessSession(self, number, policy)

    def _call(self, op: str, number: int, *args, fds: Sequence[int] = ()):
        message = pickle.dumps((op, number, *args))
        with self._lock:
            socket.send_fds(self._sock, [message], list(fds))
            reply = self._sock.recv(MAX_MESSAGE)
        if not reply:
            raise OSError(f"the egress proxy process {self.child_pid} is gone")
        ok, value = pickle.loads(reply)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the child (its sessions with it) and wait for it; idempotent."""
        if self._sock.fileno() >= 0:
            self._sock.close()
            self._child.wait()

    def __enter__(self) -> EgressProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_channel(fd: int) -> None:
    """The child: run an EgressProxy and answer the trainer until it goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the trainer's to handle
    channel = socket.socket(fileno=fd)
    proxy: EgressProxy | None = None
    sessions = {}
    while True:
        message, fds, _flags, _addr = socket.recv_fds(channel, MAX_MESSAGE, 8)
        if not message:
            break  # the trainer closed the pair, or died: its sandboxes are going too
        op, number, *args = pickle.loads(message)
        try:
            if op == "hosts":
                proxy = EgressProxy(static_resolver(args[0]) if args[0] is not None
                                    else system_resolver)
                value = None
            elif op == "serve":
                policy, names = args
                socks = dict(zip(names, (socket.socket(fileno=f) for f in fds)))
                proxy_sock = socks.pop(None, None)
                sessions[number] = proxy.serve(policy, proxy=proxy_sock, upstreams=socks)
                value = None
            elif op == "record":
                value = sessions[number].record()
            elif op == "mark":
                value = sessions[number].mark()
            elif op == "since":
                value = sessions[number].since(*args)
            else:  # close
                session = sessions.pop(number)
                session.close(wait=True)
                value = session.record()
            reply = (True, value)
        except Exception as exc:  # said to the trainer, which raises it
            reply = (False, exc)
        channel.send(pickle.dumps(reply))
    if proxy is not None:
        proxy.close()
