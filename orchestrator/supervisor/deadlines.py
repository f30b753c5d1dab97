"""The oldest of many timestamps without a scan: a heap with lazy deletion.

Node silences (last heartbeat per node) and rank progress (last step or phase change per
rank) are checked several times a second; at 2,048 nodes x 8 ranks a scan of every rank on
every check was ~6 ms, ~13 s of CPU per launch. Here ``set`` pushes the key's new time and
``oldest`` pops entries that are no longer the key's current time until it finds one that
is, so a check costs O(log n) amortized. The heap is rebuilt from the live entries when
stale ones outnumber them, so it stays within a small multiple of the keys it holds.

``LoopLag`` measures how late the supervisor's own loop is, so that a deadline judged on
what agents said is not missed because the supervisor itself was late to read them.
"""

from __future__ import annotations

import heapq
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from orchestrator.clock import Clock

K = TypeVar("K", int, str)
T = TypeVar("T")


class _Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

# Rebuild once the heap holds this many times more entries than live keys (plus a floor).
_SLACK = 3
_FLOOR = 256


class OldestFirst(Generic[K]):
    """Keys (all ints or all strs) with a time each; ``oldest`` is the smallest time."""

    def __init__(self) -> None:
        self._at: dict[K, float] = {}
        self._heap: list[tuple[float, K]] = []

    def set(self, key: K, at: float) -> None:
        if self._at.get(key) == at:
            return
        self._at[key] = at
        heapq.heappush(self._heap, (at, key))
        if len(self._heap) > _SLACK * len(self._at) + _FLOOR:
            self._heap = [(t, k) for k, t in self._at.items()]
            heapq.heapify(self._heap)

    def discard(self, key: K) -> None:
        self._at.pop(key, None)

    def get(self, key: K) -> float | None:
        return self._at.get(key)

    def oldest(self) -> tuple[K, float] | None:
        heap = self._heap
        while heap:
            at, key = heap[0]
            if self._at.get(key) == at:
                return key, at
            heapq.heappop(heap)
        return None

    def count_older_than(self, at: float) -> int:
        """How many keys have a time before ``at`` (a scan: for the rare check that
        already found the oldest past a limit)."""
        return sum(1 for t in self._at.values() if t < at)

    def items(self) -> list[tuple[K, float]]:
        """Every key with its time (a copy, in no order)."""
        return list(self._at.items())

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at


class LoopLag:
    """How late this process's event loop has been, and the clock that leaves it out.

    A task (``run``) asks to wake every ``period_s``; whatever it wakes later than that
    beyond ``tolerance_s`` is time the supervisor was not reading its sockets (a long
    handler, a burst of messages, the process starved of CPU). ``late_s`` sums it.
    ``service_time`` is the monotonic clock minus ``late_s``: it advances only while the
    supervisor keeps up. Silences are judged on it, so a beat that sat unread in a socket
    while the supervisor was late does not make its node look silent; the deadline
    stretches by exactly the lateness, and ``late_between`` says by how much.

    ``on_late(seconds)`` hears of every wake-up that counted (the metrics count it, the
    supervisor logs the long ones).
    """

    def __init__(self, clock: _Clock, period_s: float = 0.1, tolerance_s: float = 0.02,
                 on_late: Callable[[float], None] | None = None) -> None:
        self._clock = clock
        self.period_s, self.tolerance_s = period_s, tolerance_s
        self._on_late = on_late
        self.late_s = 0.0
        self.worst_s = 0.0
        self.wakeups = 0

    def note(self, overshoot_s: float) -> None:
        """One wake-up ``overshoot_s`` after it was due."""
        self.wakeups += 1
        if overshoot_s <= self.tolerance_s:
            return
        self.late_s += overshoot_s
        self.worst_s = max(self.worst_s, overshoot_s)
        if self._on_late is not None:
            self._on_late(overshoot_s)

    def service_time(self) -> float:
        return self._clock.monotonic() - self.late_s

    async def run(self) -> None:
        while True:
            due = self._clock.monotonic() + self.period_s
            await self._clock.sleep(self.period_s)
            self.note(self._clock.monotonic() - due)


class ServiceClock:
    """``clock`` with ``monotonic`` replaced by ``lag``'s service time: what the progress
    tracker stamps rank beats with and the hang check reads, so a rank is not called hung
    for the seconds the supervisor was too late to read its beats. Wall time, sleeps and
    waits are the clock's own."""

    def __init__(self, clock: Clock, lag: LoopLag) -> None:
        self._clock, self._lag = clock, lag

    def time(self) -> float:
        return self._clock.time()

    def monotonic(self) -> float:
        return self._lag.service_time()

    async def sleep(self, seconds: float) -> None:
        await self._clock.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout: float) -> T:
        return await self._clock.wait_for(aw, timeout)
