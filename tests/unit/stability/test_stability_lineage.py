"""LineageMonitor: one monitor over a run's generations, redone steps and rollbacks."""

from __future__ import annotations

import json
import math

import pytest

from stability import StabilityConfig, StabilityMonitor, StepRecord
from stability.lineage import LineageMonitor

CFG = StabilityConfig(warmup_steps=5, grad_spike={"window": 5})


def rec(step: int, g: float, *, batch: int | None = None, ckpt: bool = False,
        loss: float = 2.0) -> dict:
    out = {"step": step, "loss": loss + 0.001 * (step % 3), "grad_norm": g,
           "batch": step - 1 if batch is None else batch}
    if ckpt:
        out["ckpt_block_s"] = 0.01
    return out


def g_at(step: int) -> float:
    return 1.0 + 0.002 * (step % 4)


def stream(first: int, last: int, spikes: dict[int, float] | None = None,
           batch_shift: int = 0, every: int = 10) -> list[dict]:
    spikes = spikes or {}
    return [rec(s, spikes.get(s, g_at(s)), batch=s - 1 + batch_shift, ckpt=s % every == 0)
            for s in range(first, last + 1)]


def feed_all(lm: LineageMonitor, records: list[dict], generation: int) -> list[tuple]:
    out = []
    for r in records:
        out += [(e.kind, e.step) for e in lm.feed(r, generation)]
    return out


def plain_events(records: list[dict]) -> list[tuple]:
    mon = StabilityMonitor(CFG)
    out = []
    for r in records:
        out += [(e.kind, e.step) for e in mon.update(StepRecord.from_dict(r))]
    return out


def test_one_generation_is_a_plain_monitor() -> None:
    records = stream(1, 30, {12: 9.0, 20: 7.0, 21: 7.0})
    lm = LineageMonitor(CFG)
    assert feed_all(lm, records, 1) == plain_events(records)
    assert ("grad_spike", 12) in plain_events(records)
    assert lm.last_step == 30 and lm.generation == 1


def test_a_restart_redoing_steps_resets_to_the_checkpoint_snapshot() -> None:
    lm = LineageMonitor(CFG)
    feed_all(lm, stream(1, 27, {24: 9.0}), 1)  # crashed after step 27, checkpoint at 20
    redo = feed_all(lm, stream(21, 40, {24: 9.0}), 2)
    # The redone spike fires again (the step ran again); the state is that of one clean pass.
    assert ("grad_spike", 24) in redo
    clean = LineageMonitor(CFG)
    feed_all(clean, stream(1, 40, {24: 9.0}), 1)
    assert lm.monitor.state_dict() == clean.monitor.state_dict()
    assert lm.lineage_gaps == 0


def test_a_rollback_lineage_forgets_the_abandoned_branch() -> None:
    lm = LineageMonitor(CFG)
    feed_all(lm, stream(1, 29, {25: 500.0, 26: 400.0}), 1)
    # Generation 2 restored step 20 and skips 5 batches after batch 23.
    new = stream(21, 24) + stream(25, 40, batch_shift=5)
    feed_all(lm, new, 2)
    reference = LineageMonitor(CFG)  # a run that skipped the window from the start
    feed_all(reference, stream(1, 24) + stream(25, 40, batch_shift=5), 1)
    assert lm.monitor.state_dict() == reference.monitor.state_dict()
    assert lm.summary()["spikes_total"] == 0 and lm.batch_of(25) == 29


def test_without_a_snapshot_redone_steps_are_ignored_not_counted_twice() -> None:
    lm = LineageMonitor(CFG)  # no checkpoint markers and no interval: no snapshots
    plain = [{k: v for k, v in r.items() if k != "ckpt_block_s"} for r in stream(1, 27)]
    feed_all(lm, plain, 1)
    before = lm.monitor.state_dict()
    assert feed_all(lm, plain[20:27], 2) == []  # steps 21..27 again: already consumed
    assert lm.monitor.state_dict() == before and lm.lineage_gaps == 1
    events = feed_all(lm, [rec(28, 9.0)], 2)
    assert events == [("grad_spike", 28), ("growth", 28)]


def test_checkpoint_every_takes_snapshots_without_markers() -> None:
    lm = LineageMonitor(CFG, checkpoint_every=10)
    feed_all(lm, [{k: v for k, v in r.items() if k != "ckpt_block_s"} for r in stream(1, 25)],
             1)
    assert lm.snapshot_steps == [10, 20]


def test_duplicates_within_a_generation_are_ignored() -> None:
    lm = LineageMonitor(CFG)
    feed_all(lm, stream(1, 10), 1)
    state = lm.state_dict()
    assert feed_all(lm, stream(8, 10, {9: 50.0}), 1) == []
    assert lm.state_dict() == state


def test_a_generation_starting_from_scratch_is_a_fresh_monitor() -> None:
    lm = LineageMonitor(CFG)
    feed_all(lm, stream(1, 15, {12: 9.0}), 1)
    feed_all(lm, stream(1, 8), 2)
    fresh = LineageMonitor(CFG)
    feed_all(fresh, stream(1, 8), 2)
    assert lm.state_dict() == fresh.state_dict()


def test_a_generation_carrying_on_keeps_everything() -> None:
    lm = LineageMonitor(CFG)
    feed_all(lm, stream(1, 12), 1)
    feed_all(lm, stream(13, 20), 2)  # a supervisor that lost no step, new generation number
    one = LineageMonitor(CFG)
    feed_all(one, stream(1, 20), 1)
    assert lm.monitor.state_dict() == one.monitor.state_dict()


def test_state_round_trips_through_json_and_continues_identically() -> None:
    a = LineageMonitor(CFG, max_snapshots=2)
    feed_all(a, stream(1, 34, {33: math.nan}), 1)
    b = LineageMonitor(CFG, max_snapshots=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    tail = stream(21, 45, {30: 9.0})  # a restart from step 20 after the reload
    assert feed_all(a, tail, 2) == feed_all(b, tail, 2)
    assert a.state_dict() == b.state_dict()


def test_snapshots_and_batches_are_bounded() -> None:
    lm = LineageMonitor(CFG, max_snapshots=3, batch_memory=16)
    feed_all(lm, stream(1, 100), 1)
    assert lm.snapshot_steps == [80, 90, 100]
    assert lm.batch_of(100) == 99 and lm.batch_of(84) is None and lm.batch_of(85) == 84


def test_onset_of_a_persistent_spike_is_its_first_step() -> None:
    cfg = StabilityConfig(warmup_steps=5, grad_spike={"window": 5},
                          persistent_spike={"length": 3})
    lm = LineageMonitor(cfg)
    events = []
    for r in stream(1, 20, {14: 9.0, 15: 9.0, 16: 9.0}):
        events += lm.feed(r, 1)
    persistent = next(e for e in events if e.kind == "persistent_spike")
    assert persistent.step == 16 and LineageMonitor.onset_of(persistent) == 14
    assert lm.batch_of(14) == 13


def test_bad_records_raise_and_consume_nothing() -> None:
    lm = LineageMonitor(CFG)
    feed_all(lm, stream(1, 5), 1)
    with pytest.raises(ValueError, match="loss"):
        lm.feed({"step": 6}, 1)
    assert lm.last_step == 5
    with pytest.raises(ValueError, match="version"):
        lm.load_state_dict({"version": 99})
