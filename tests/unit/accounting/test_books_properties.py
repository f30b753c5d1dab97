"""Invariants of the books over random timelines (hypothesis)."""

from __future__ import annotations

import pytest
from _accounting_script import Script
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.journal.books import Books, compute_books

generation = st.fixed_dictionaries({
    "startup": st.floats(0.0, 20.0),
    "steps": st.integers(0, 30),
    "every": st.floats(0.01, 3.0),
    "ckpt_every": st.integers(1, 12),
    "block": st.floats(0.0, 4.0),          # may exceed the step interval
    "data": st.floats(0.0, 4.0),
    "skew": st.floats(-5.0, 5.0),          # worker clock vs supervisor clock
    "exit_after": st.floats(-1.0, 2.0),    # crash time after the last step (agent clock)
    "detect": st.floats(0.0, 10.0),
    "backoff": st.floats(0.0, 10.0),
    "rollback": st.booleans(),             # resume before the newest checkpoint
    "gap": st.floats(0.0, 30.0),           # supervisor down before this generation's end
})


def run_script(gens: list[dict], ending: str) -> tuple[Script, float]:
    s = Script(steps=10_000).start()
    t, step, ckpts = 4.0, 0, [0]
    for i, g in enumerate(gens):
        if i:
            resume = ckpts[-2] if g["rollback"] and len(ckpts) > 1 else ckpts[-1]
            s.to(t, "HEALTH_CHECK").launch(t + 0.5, resume_step=resume, after="worker_exit")
            t += 0.5
            s.event(t + g["startup"] / 2, "resumed", generation=s.generation, step=resume,
                    load_s=g["startup"] / 3)
            step = resume
        t += g["startup"]
        for k in range(g["steps"]):
            step += 1
            t += g["every"]
            s.records.append({"generation": s.generation, "step": step, "ts": t + g["skew"],
                              "ckpt_block_s": g["block"] if k % 3 == 0 else 0.0,
                              "data_s": g["data"] if k % 4 == 0 else 0.0})
            if step % g["ckpt_every"] == 0:
                s.checkpoint(t + 0.001, step)
                ckpts.append(step)
        if g["gap"]:
            s.event(t + g["gap"], "supervisor_started", resumed=True)
            t += g["gap"]
        if i < len(gens) - 1:
            s.crash(t + g["detect"], exit_ts=t + g["exit_after"], newest_ckpt=ckpts[-1])
            t += g["detect"] + 0.2 + g["backoff"]
    if ending != "live":
        s.to(t + 1.0, ending, "completed" if ending == "COMPLETED" else None)
    return s, t + 2.0


@settings(max_examples=300, deadline=None)
@given(gens=st.lists(generation, min_size=1, max_size=4),
       ending=st.sampled_from(["COMPLETED", "FAILED", "live"]),
       late=st.floats(0.0, 50.0))
def test_every_second_booked_once(gens: list[dict], ending: str, late: float) -> None:
    s, now = run_script(gens, ending)
    ledger = compute_books(s.events, s.records, now + late)
    assert all(v >= -1e-9 for v in ledger.seconds.values()), ledger.seconds
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total_s, rel=1e-9, abs=1e-6)
    assert 0.0 <= ledger.goodput <= 1.0 + 1e-12
    end = s.events[-1]["ts"] if ending != "live" else now + late
    assert ledger.total_s == pytest.approx(end)


@settings(max_examples=150, deadline=None)
@given(gens=st.lists(generation, min_size=1, max_size=3), ending=st.sampled_from(
    ["COMPLETED", "FAILED", "live"]), late=st.floats(0.0, 20.0))
def test_live_folding_ends_where_a_rebuild_does(gens: list[dict], ending: str,
                                                late: float) -> None:
    """The supervisor folds events and records as they come, snapshotting between; a
    restarted supervisor or ``status`` reads the journal first, then the records. Both get
    the same books."""
    s, now = run_script(gens, ending)
    books = Books()
    pending = sorted(s.records, key=lambda r: r["ts"])
    launched: set[int] = set()
    for e in s.events:
        while pending and pending[0]["generation"] in launched and pending[0]["ts"] <= e["ts"]:
            books.add_record(pending.pop(0))
        books.apply(e)
        if e["kind"] == "generation_launched":
            launched.add(e["generation"])
        books.snapshot(e["ts"])
    for r in pending:
        books.add_record(r)
    assert books.snapshot(now + late).seconds == pytest.approx(
        compute_books(s.events, s.records, now + late).seconds, abs=1e-9)
