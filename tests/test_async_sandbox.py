"""AsyncSandbox does its blocking steps in worker threads; a caller cancelled at any moment
of them leaves nothing running and nothing on the host."""
from __future__ import annotations

import asyncio
import contextlib
import time

from karotte.sandbox import AsyncSandbox

# From "before the thread has started" to "after it has returned": cancellations that land
# in each step of a start (spawn, ready wait, first reply) and of an exec (request, run).
DELAYS = (0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)


async def cancelled_after(delay: float, coro) -> None:
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(delay)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_start_cancelled_at_any_moment_leaves_nothing_behind(no_leaks):
    async def main():
        for delay in DELAYS:
            sb = AsyncSandbox()
            await cancelled_after(delay, sb.start())
            await sb.close()

    asyncio.run(main())  # its end waits for the worker threads, and what they undo


def test_an_exec_cancelled_at_any_moment_leaves_no_command_running(no_leaks):
    async def main():
        async with AsyncSandbox() as sb:
            for delay in DELAYS:
                await cancelled_after(delay, sb.exec("sleep 30"))
            deadline = time.monotonic() + 3
            while True:  # the kill of the last one may still be on its way
                r = await sb.exec("cat /proc/[0-9]*/comm")
                if b"sleep" not in r.stdout or time.monotonic() > deadline:
                    return r

    r = asyncio.run(main())
    assert b"sleep" not in r.stdout, r.stdout
