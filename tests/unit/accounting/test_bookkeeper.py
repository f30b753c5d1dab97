"""The supervisor's bookkeeper: follows the run directory, rebuilds after a restart, exports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _accounting_script import Script
from prometheus_client import CollectorRegistry

from orchestrator.journal.books import BADPUT_CATEGORIES, compute_books
from orchestrator.contracts.rundir import RunDir
from orchestrator.journal.status import load_books
from orchestrator.supervisor.bookkeeper import BookKeeper
from orchestrator.supervisor.metrics import SupervisorMetrics


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t


def restart_script() -> Script:
    s = Script(steps=20).start()
    s.steps(1, 10.0, 15).checkpoint(19.5, 10)
    s.crash(24.5, exit_ts=24.3, newest_ckpt=10)
    s.to(26.7, "HEALTH_CHECK").launch(27.0, resume_step=10, after="worker_exit")
    s.event(30.0, "resumed", generation=2, step=10, load_s=1.5)
    s.steps(11, 33.0, 10).to(43.0, "COMPLETED", "completed")
    return s


def write(path: Path, objs: list[dict], torn: str = "") -> None:
    with open(path, "a") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
        f.write(torn)


def value(metrics: SupervisorMetrics, name: str, **labels: str) -> float:
    v = metrics.registry.get_sample_value(name, {"job": "t", **labels})
    assert v is not None, (name, labels)
    return v


def test_keeper_follows_files_and_a_restarted_one_rebuilds_the_same_books(
        tmp_path: Path) -> None:
    s = restart_script()
    run = RunDir(tmp_path)
    half = len(s.events) // 2
    cut_ts = s.events[half - 1]["ts"]
    write(run.journal, s.events[:half], torn='{"seq": 999, "ts": 1')
    write(run.steps, [r for r in s.records if r["ts"] <= cut_ts])
    clock = FakeClock(cut_ts)
    metrics = SupervisorMetrics(CollectorRegistry(), "t")
    keeper = BookKeeper(run, metrics, clock)
    assert keeper.ledger.seconds == pytest.approx(
        compute_books(s.events[:half], [r for r in s.records if r["ts"] <= cut_ts],
                      cut_ts).seconds)
    # The rest arrives (the torn line is completed by the writer's next bytes).
    run.journal.write_text(run.journal.read_text().rsplit("\n", 1)[0] + "\n")
    write(run.journal, s.events[half:])
    write(run.steps, [r for r in s.records if r["ts"] > cut_ts])
    clock.t = 100.0
    ledger = keeper.refresh()
    want = compute_books(s.events, s.records, 100.0)
    assert ledger.seconds == pytest.approx(want.seconds)
    assert value(metrics, "orchestrator_productive_seconds_total") == pytest.approx(18)
    for cat in BADPUT_CATEGORIES:
        assert value(metrics, "orchestrator_badput_seconds_total", category=cat) == \
            pytest.approx(want.seconds[cat])
    assert value(metrics, "orchestrator_goodput_ratio") == pytest.approx(18 / 43)

    # A new supervisor on the same run dir: same books, and counters and gauges replayed
    # from the journal and the records before its first scrape.
    again = SupervisorMetrics(CollectorRegistry(), "t")
    rebuilt = BookKeeper(run, again, FakeClock(100.0))
    assert rebuilt.ledger.seconds == pytest.approx(want.seconds)
    assert load_books(run, now=100.0).seconds == pytest.approx(want.seconds)
    assert value(again, "orchestrator_restarts_total", cause="worker_exit") == 1
    assert value(again, "orchestrator_failures_total", cause="worker_exit") == 1
    assert value(again, "orchestrator_job_state", state="COMPLETED") == 1
    assert value(again, "orchestrator_job_state", state="PENDING") == 0
    assert value(again, "orchestrator_training_step") == 20
    assert value(again, "orchestrator_last_checkpoint_step") == 10
    assert value(again, "orchestrator_steps_processed_total") == 25
    assert value(again, "orchestrator_step_duration_seconds_count") == 25


def test_counters_never_go_down_when_time_is_rebooked() -> None:
    metrics = SupervisorMetrics(CollectorRegistry(), "t")
    metrics.set_books({"productive": 10.0, "wasted_progress": 0.0}, 0.5)
    # A failure turns 4 s of provisional progress into wasted progress.
    metrics.set_books({"productive": 6.0, "wasted_progress": 4.0}, 0.3)
    assert value(metrics, "orchestrator_productive_seconds_total") == 10
    assert value(metrics, "orchestrator_badput_seconds_total", category="wasted_progress") == 4
    assert value(metrics, "orchestrator_goodput_ratio") == 0.3
    # The productive counter waits for the books to pass it, then follows them again.
    metrics.set_books({"productive": 9.0, "wasted_progress": 4.0}, 0.4)
    assert value(metrics, "orchestrator_productive_seconds_total") == 10
    metrics.set_books({"productive": 12.5, "wasted_progress": 4.0}, 0.5)
    assert value(metrics, "orchestrator_productive_seconds_total") == 12.5


def test_a_restarted_keeper_books_up_to_the_journal_not_into_the_gap(tmp_path: Path) -> None:
    """The dead supervisor's last event is where the journal's knowledge ends; the gap after
    it is booked only once the new supervisor_started event (and the agents' buffered
    records) say what happened, so no counter is pushed past its final value meanwhile."""
    s = Script(steps=100).start()
    s.steps(1, 10.0, 10).checkpoint(19.2, 10)
    run = RunDir(tmp_path)
    write(run.journal, s.events)
    write(run.steps, s.records)
    metrics = SupervisorMetrics(CollectorRegistry(), "t")
    keeper = BookKeeper(run, metrics, FakeClock(60.0))  # 40 s after the last event
    assert keeper.ledger.total_s == pytest.approx(19.2)
    assert keeper.ledger.seconds["failure_detection"] == 0
    # The new supervisor says it is back; the agents' records show training went on.
    write(run.journal, [{"seq": 99, "ts": 60.0, "kind": "supervisor_started",
                         "resumed": True}])
    write(run.steps, [{"generation": 1, "step": n, "ts": 10.0 + n - 1}
                      for n in range(11, 51)])
    ledger = keeper.refresh()
    assert ledger.total_s == 60
    assert ledger.seconds["productive"] == pytest.approx(49 + 1)  # + the step in flight
    assert value(metrics, "orchestrator_badput_seconds_total",
                 category="failure_detection") == 0


def test_the_periodic_refresh_lets_the_loop_serve_between_chunks_and_folds_each_line_once(
        tmp_path: Path) -> None:
    """A stop of 2,048 nodes appends ~4,000 journal lines: folded in one go they held the
    supervisor's loop with every heartbeat waiting. The periodic refresh folds a chunk,
    then lets other tasks run (a beat, here a task that counts what was folded when it
    ran); a plain ``refresh`` that comes meanwhile (a status request) folds the rest, in
    order, and the books come out as if read in one go."""
    import asyncio

    s = restart_script()
    run = RunDir(tmp_path)
    write(run.journal, s.events[:2])
    clock = FakeClock(s.events[1]["ts"])
    keeper = BookKeeper(run, SupervisorMetrics(CollectorRegistry(), "t"), clock)
    write(run.journal, s.events[2:])
    write(run.steps, s.records)
    clock.t = 100.0
    total = len(s.events) - 2 + len(s.records)
    seen: list[int] = []

    async def beats() -> None:
        while len(seen) < 3:
            seen.append(len(keeper._backlog))  # what was still unfolded when "a beat" ran
            await asyncio.sleep(0)

    async def main() -> None:
        beat = asyncio.create_task(beats())
        await asyncio.sleep(0)  # the beat runs first: nothing read yet
        refresh = asyncio.create_task(keeper.refresh_in_chunks(chunk=5))
        await beat
        mid = keeper.refresh()  # a status request in the middle folds what is left
        assert mid.seconds == pytest.approx(compute_books(s.events, s.records,
                                                          100.0).seconds)
        await refresh

    asyncio.run(main())
    # The beat ran between chunks: with lines read and only some folded.
    assert any(0 < left < total for left in seen), (seen, total)
    assert keeper.ledger.seconds == pytest.approx(
        compute_books(s.events, s.records, 100.0).seconds)
    assert not keeper._backlog


def test_a_resumed_supervisor_books_no_failure_detection_in_a_run_with_no_failure(
        tmp_path: Path) -> None:
    """A supervisor killed with kill -9 and resumed: until its agents' records catch up, the
    books provisionally call the time since the last step failure_detection (no step for
    longer than any took). That guess is the goodput gauge's to show; the counter, which
    cannot give it back when the records arrive, holds it until a failure confirms it."""
    s = Script(steps=100).start()
    s.steps(1, 5.0, 20)  # steps 1-20 at 5-24 s, 1 s each
    s.event(40.0, "supervisor_started", resumed=True)  # the gap: 24-40 s
    run = RunDir(tmp_path)
    write(run.journal, s.events)
    write(run.steps, s.records)
    clock = FakeClock(40.0)
    metrics = SupervisorMetrics(CollectorRegistry(), "t")
    keeper = BookKeeper(run, metrics, clock)
    clock.t = 43.0  # the agents re-register; their records have not come in yet
    ledger = keeper.refresh()
    assert ledger.seconds["failure_detection"] > 1.0  # the live guess, in the books
    assert value(metrics, "orchestrator_badput_seconds_total",
                 category="failure_detection") == 0.0
    # The records the agents kept meanwhile arrive: it was training all along.
    s.steps(21, 25.0, 19)
    write(run.steps, s.records[20:])
    ledger = keeper.refresh()
    assert ledger.seconds["failure_detection"] == pytest.approx(0.0, abs=1e-9)
    assert value(metrics, "orchestrator_badput_seconds_total",
                 category="failure_detection") == 0.0
    # A real failure: its detection is booked and counted once the stop is journaled.
    clock.t = 50.0
    s.crash(48.0, exit_ts=44.5, newest_ckpt=None)
    write(run.journal, s.events[-5:])
    ledger = keeper.refresh()
    counted = value(metrics, "orchestrator_badput_seconds_total", category="failure_detection")
    assert counted == pytest.approx(ledger.seconds["failure_detection"]) and counted > 3.0
