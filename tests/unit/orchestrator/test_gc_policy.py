"""The supervisor's garbage-collection policy (``supervisor.gcpolicy``): full collections
are rare while it runs, and everything is given back after.

At 2,048 nodes x 8 ranks every heartbeat's rank infos live a second and reach the oldest
generation, and CPython's defaults then ran a full collection every few seconds, each
walking every object the supervisor holds (0.26 s on average at 1,024 x 8) with no
heartbeat read meanwhile. The tests count collections through ``gc.callbacks``; nothing
here is timed."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from orchestrator.supervisor.gcpolicy import FULL_EVERY, long_lived_heap


@contextmanager
def full_collections() -> Iterator[list[int]]:
    seen: list[int] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


def _beats(rounds: int) -> None:
    """What heartbeats do to the heap: each round replaces the previous round's objects,
    which lived long enough to be promoted (a node's rank infos until its next beat)."""
    held: list[dict[str, Any]] = []
    for _ in range(rounds):
        held = [{"rank": i, "info": [i]} for i in range(5_000)]
    del held


def test_full_collections_wait_while_the_heap_is_long_lived() -> None:
    thresholds = gc.get_threshold()
    gc.collect()
    with full_collections() as default:
        _beats(60)
    assert default, "CPython's defaults ran no full collection: the test shows nothing"
    with long_lived_heap(), full_collections() as ours:
        assert gc.get_threshold()[2] >= FULL_EVERY
        assert gc.get_freeze_count() > 0  # what was alive at start is out of collections
        _beats(60)
    assert ours == [], f"{len(ours)} full collections (defaults: {len(default)})"
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0


def test_young_cycles_are_still_collected() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self

    with long_lived_heap():
        gc.collect(0)
        before = len([o for o in gc.get_objects(0) if isinstance(o, Node)])
        for _ in range(10_000):
            Node()  # garbage, in a cycle: only the collector frees it
        left = sum(1 for o in gc.get_objects() if isinstance(o, Node))
    assert before == 0 and left < 10_000, left
