"""How a process that holds sandboxes ends, whichever way it ends.

- SIGKILL (or any death): nothing here runs. Each init sees EOF on its control socket
  and exits, and the kernel kills every process of its PID namespace (docs/init.md says
  why no process outlives the trainer). The cgroups and private directories stay until
  `karotte-sandbox gc`, which removes those of dead creators.
- SIGINT, SIGTERM, SIGHUP, once install_signal_handlers() is called (the CLIs call it;
  trainers should): stop_all() kills every sandbox at once and refuses new ones, then
  Terminated (a SystemExit with status 128 + the signal) is raised in the main thread.
  It unwinds every `with`, and the process exits through the net below.
- Exit (normal, or by an exception such as Terminated): cleanup(), registered with
  atexit, destroys every sandbox still live, then removes this process's private
  directories (hidden files, submissions, the grader library copy) and the cgroups it
  kept for reuse.
- A sandbox dropped without close() is destroyed when it is garbage collected.

Sandboxes are tracked weakly: tracking never keeps one alive.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref

from . import cgroups, hostdirs, shutdown
from .errors import KarotteError
from .shutdown import ending, refuse_if_ending  # noqa: F401  (public here, as before)

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_live: "weakref.WeakSet" = weakref.WeakSet()  # sandbox cores started and not destroyed
# Reentrant: a signal handler runs in the main thread, maybe inside track() or forget().
_lock = threading.RLock()


class Terminated(SystemExit):
    """Raised in the main thread by the handlers of install_signal_handlers(): the
    process got `signum` and ends with exit status 128 + signum. Every sandbox has been
    killed when it is raised; unwinding (and, at exit, cleanup()) removes the rest."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def track(core) -> None:
    """Register a sandbox core that has an init (sandbox.py calls this)."""
    with _lock:
        _live.add(core)


def forget(core) -> None:
    with _lock:
        _live.discard(core)


def _tracked() -> list:
    with _lock:
        return list(_live)


def stop_all(signum: int = 0) -> None:
    """Stop every sandbox of this process now and refuse new ones. Only signals are sent
    (SIGKILL to each init, which takes its PID namespace down): no fd is closed and no
    state is changed under the threads that use the sandboxes, so this is safe from a
    signal handler; each sandbox's own teardown (or cleanup()) reaps and removes."""
    shutdown.begin(signum)
    for core in _tracked():
        core.stop()


def cleanup() -> None:
    """Destroy every sandbox this process still holds (kill, reap its init, remove its
    cgroup), then remove this process's private directories and pooled cgroups. At
    exit this runs by itself; call it only as a process's last step: nothing may be
    created afterwards."""
    stop_all(0)
    failed = []
    for core in _tracked():
        try:
            core.destroy()
        except (KarotteError, OSError) as exc:
            failed.append(str(exc))
    hostdirs.remove_created_by()
    cgroups.drain_pool()
    for why in failed:  # gc removes what is left once this process is gone
        print(f"karotte: a sandbox could not be removed at exit: {why}; "
              "run `karotte-sandbox gc` after this process has ended", file=sys.stderr)


_installed_by: int | None = None  # the pid that installed the handlers


def _on_signal(signum: int, _frame) -> None:
    if os.getpid() != _installed_by:
        # A child forked without exec (pyroute2's netns helper, a fork-started worker):
        # its forker expects the signal's default action, not an exception raised into
        # its code. Its own sandboxes stopped, it dies by the signal.
        stop_all(signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    first = shutdown.ending() is None
    stop_all(signum)
    if first:  # once: a second signal must not break the unwinding of the first
        raise Terminated(signum)


def install_signal_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP each end this process the same way: stop_all(), then
    Terminated (exit status 128 + the signal) raised in the main thread, the first time
    only; later signals only stop_all() again. Call it from the main thread, before
    asyncio.run() in an asyncio program (asyncio.run then cancels its tasks, whose
    `async with` blocks close their episodes). Slurm, Kubernetes and timeout(1) send
    SIGTERM first: without this, the default action kills the process like SIGKILL."""
    global _installed_by
    _installed_by = os.getpid()
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def terminated(exc: Terminated, program: str) -> int:
    """How a command-line program ends on Terminated: cleanup(), a line on stderr that
    names the signal, and the exit status to return (128 + the signal)."""
    cleanup()
    print(f"{program}: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
    return exc.code


def _forget_all() -> None:
    """In a forked child: the sandboxes are the parent's, not ours to stop or destroy."""
    global _live, _lock
    _live, _lock = weakref.WeakSet(), threading.RLock()


atexit.register(cleanup)
os.register_at_fork(after_in_child=_forget_all)
