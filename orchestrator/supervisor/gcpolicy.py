"""Garbage collection for a supervisor that holds 2,048 nodes' state: rare full collections.

CPython's cycle collector runs a full (generation 2) collection after every 10 collections
of generation 1, once the objects that survived into generation 2 since the last one are a
quarter of those already there. Every heartbeat replaces its node's rank infos (8 pydantic
models, each with its dict and field set), so at 2,048 nodes x 8 ranks about 50,000 objects
a second live long enough to reach generation 2, and a full collection came every 3 s.
Each walks every object the supervisor holds (the nodes, the ranks' progress, the job's
view with its launch records): measured at 1,024 x 8 with ``gc.callbacks``, 26 full
collections in a 77 s run, 0.26 s each on average and up to 0.4 s, 6.7 s in all during
which no heartbeat was read (the heartbeat p99 was 706 ms; the supervisor's loop was
late 10 s in all).

``long_lived_heap`` (around the supervisor's run): what the process holds at start (the
imported modules, pydantic's schemas, the journal's replay) is collected once and frozen
out of every later collection (``gc.freeze``), and a full collection waits for 1,000
collections of generation 1 instead of 10. Young collections (generations 0 and 1, a few
milliseconds) run as before, and reclaim the cycles that die young, which are nearly all
of them; objects are still freed by their reference counts at once. What a full collection
would still find (cycles that lived long, then died) waits longer: a bounded amount, since
a full collection still comes, every few minutes at 2,048 nodes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Collections of generation 1 between full collections (CPython's default is 10).
FULL_EVERY = 1000


@contextmanager
def long_lived_heap(full_every: int = FULL_EVERY) -> Iterator[None]:
    """Collect and freeze what is alive now, and make full collections rare, until exit
    (then the thresholds and the frozen objects are given back: a test's process goes on
    as before)."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(before[0], before[1], max(before[2], full_every))
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
