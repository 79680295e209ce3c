"""Limiter: how many async episodes may hold a sandbox at once.

    heavy = Limiter(4)                  # these episodes hold at most 4 sandboxes at once
    AsyncEpisode(BigBuild(), seed, limiter=heavy)
    AsyncEpisode(Addition(), seed)      # the default limiter: set_concurrency(k), 64 at first

An episode takes a slot at reset() and gives it back at close; the others wait in
reset(). Slots are per event loop (an asyncio.Semaphore belongs to one loop), and each
loop's slots come with as many threads for the blocking work of the episodes that hold
them (the environment's methods, custody, grading): asyncio's default executor, with
min(32, cpus + 4) threads, would cap how many of them run at once.
"""
from __future__ import annotations

import asyncio
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

DEFAULT_CONCURRENCY = 64


@dataclass(frozen=True)
class Slots:
    """One event loop's share of a Limiter."""

    semaphore: asyncio.Semaphore
    executor: ThreadPoolExecutor


class Limiter:
    """At most n episodes that share this Limiter hold a sandbox at once, per event loop."""

    def __init__(self, n: int = DEFAULT_CONCURRENCY):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a Limiter's n must be an int of at least 1, got {n!r}")
        self.n = n
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Slots] = \
            weakref.WeakKeyDictionary()

    def slots(self) -> Slots:
        """The running event loop's slots, made on its first use."""
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            self._loops[loop] = Slots(asyncio.Semaphore(self.n), ThreadPoolExecutor(
                self.n, thread_name_prefix="karotte-episode"))
        return self._loops[loop]

    def __repr__(self) -> str:
        return f"Limiter({self.n})"


_default = Limiter()


def default_limiter() -> Limiter:
    """The limiter of the async episodes given none, as set_concurrency last made it."""
    return _default


def set_concurrency(n: int) -> None:
    """How many async episodes given no limiter may hold a sandbox at once (per event
    loop). Episodes that hold a slot of the previous default keep it until they close."""
    global _default
    if n < 1:
        raise ValueError("concurrency must be at least 1")
    _default = Limiter(n)
