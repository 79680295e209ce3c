"""The limits of one sandbox over all its connections: how many, how fast, how much."""
from __future__ import annotations

import asyncio
import time

from .policy import EgressLimits


class LimitReached(Exception):
    """A connection is cut: `reason` is "bytes_total" (of karotte.egress.record.REASONS)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Meter:
    """Counts what one sandbox's connections carry. The pacing is a token bucket of one
    second's worth of bytes, shared by all connections, so opening more of them does not
    buy more throughput (EGRESS-FLOOD-01)."""

    def __init__(self, limits: EgressLimits):
        self.limits = limits
        self.connections = 0
        self.total = 0
        self._tokens = float(limits.bytes_per_second or 0)
        self._stamp = time.monotonic()

    def try_open(self) -> bool:
        if self.connections >= self.limits.max_connections:
            return False
        self.connections += 1
        return True

    def close(self) -> None:
        self.connections -= 1

    async def take(self, n: int) -> None:
        """Account n bytes about to be sent on; wait while the pace is ahead."""
        limit = self.limits.max_bytes
        if limit is not None and self.total + n > limit:
            self.total = limit
            raise LimitReached("bytes_total", f"the sandbox's connections carried "
                               f"{limit} bytes, EgressLimits.max_bytes")
        self.total += n
        rate = self.limits.bytes_per_second
        if rate is None:
            return
        now = time.monotonic()
        self._tokens = min(float(rate), self._tokens + (now - self._stamp) * rate) - n
        self._stamp = now
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / rate)
