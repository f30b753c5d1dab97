"""The oldest of many timestamps without a scan: a heap with lazy deletion.

Node silences (last heartbeat per node) and rank progress (last step or phase change per
rank) are checked several times a second; at 2,048 nodes x 8 ranks a scan of every rank on
every check was ~6 ms, ~13 s of CPU per launch. Here ``set`` pushes the key's new time and
``oldest`` pops entries that are no longer the key's current time until it finds one that
is, so a check costs O(log n) amortized. The heap is rebuilt from the live entries when
stale ones outnumber them, so it stays within a small multiple of the keys it holds.
"""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

K = TypeVar("K", int, str)

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

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at
