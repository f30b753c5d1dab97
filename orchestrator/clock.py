"""The one clock the supervisor and agents read, passed in so tests can control time.

Every deadline reads ``monotonic``, every record ``time``, every pause ``sleep`` and every
wait with a timeout ``wait_for``: with the fake clock of the tests (``tests/fakes.py``) a
timeout is asserted exactly, in loop time, without waiting for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Clock:
    """Wall time for records, monotonic time for timeouts, awaitable sleeps and waits."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout: float) -> T:
        """``aw``'s result, or TimeoutError after ``timeout`` seconds of this clock."""
        return await asyncio.wait_for(aw, timeout)


SYSTEM_CLOCK = Clock()
