"""Clocks passed into the supervisor and agents, so tests can control time."""

from __future__ import annotations

import asyncio
import time


class Clock:
    """Wall time for records, monotonic time for timeouts, and an awaitable sleep."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = Clock()
