"""The books of scripted journals with known timelines: exact seconds per category."""

from __future__ import annotations

import pytest
from _accounting_script import Script

from orchestrator.journal.books import CATEGORIES, Books, compute_books


def book(script: Script, now: float = 1e9) -> dict[str, float]:
    ledger = compute_books(script.events, script.records, now)
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.total_s, abs=1e-9)
    assert all(v >= -1e-9 for v in ledger.seconds.values()), ledger.seconds
    return ledger.seconds


def expect(got: dict[str, float], **want: float) -> None:
    full = dict.fromkeys(CATEGORIES, 0.0) | want
    assert got == pytest.approx(full, abs=1e-9)


def test_clean_run() -> None:
    s = Script(steps=10).start()
    s.steps(1, 10.0, 10, s5={"ckpt_block_s": 0.5}, s6={"data_s": 0.25})
    s.to(21.0, "COMPLETED", "completed")
    # PENDING 0-1 and HEALTH_CHECK until the 2nd node registers (3): provisioning;
    # placement 3-4: health_check; launch at 4 to the end of step 1 at 10: startup; steps
    # 2..10 end 11..19; after the last step, shutdown until COMPLETED: other.
    expect(book(s), provisioning=3, health_check=1, startup=6, productive=8.25,
           checkpoint_save=0.5, data_loading=0.25, other=2)
    ledger = compute_books(s.events, s.records, 0)
    assert ledger.total_s == 21 and ledger.goodput == pytest.approx(8.25 / 21)


def test_crash_restart_books_redone_steps_as_wasted() -> None:
    s = Script(steps=20).start()
    s.steps(1, 10.0, 15).checkpoint(19.5, 10)
    s.crash(24.5, exit_ts=24.3, newest_ckpt=10)  # failure + RECOVERING at 24.7
    s.to(26.7, "HEALTH_CHECK").launch(27.0, resume_step=10, after="worker_exit")
    s.event(30.0, "resumed", generation=2, step=10, load_s=1.5)
    s.steps(11, 33.0, 10).to(43.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3, health_check=1.3,
           startup=6 + 4.5, checkpoint_restore=1.5,
           productive=9 + 9,
           wasted_progress=5 + 0.3,   # steps 11..15 of gen 1, then the step in flight
           failure_detection=0.2,     # the rank's exit (24.3) to the decision (24.5)
           recovery=2.2,              # stop and backoff, 24.5 to 26.7
           other=1)


def test_rollback_to_an_older_checkpoint_wastes_everything_after_it() -> None:
    s = Script(steps=30).start()
    s.steps(1, 10.0, 25).checkpoint(19.5, 10).checkpoint(29.5, 20)
    s.crash(35.0, exit_ts=0, newest_ckpt=20, cause="divergence")  # no rank died
    s.to(36.0, "HEALTH_CHECK").launch(36.5, resume_step=20, after="divergence")
    # While nothing is relaunched, the newest checkpoint (20) is the guess...
    mid = compute_books(s.events, s.records, 36.4).seconds
    assert mid["wasted_progress"] == pytest.approx(5)
    # ... until the workers resume from step 10, before the spike.
    s.event(38.0, "resumed", generation=2, step=10, load_s=0.5)
    assert compute_books(s.events, s.records, 38.1).seconds["wasted_progress"] == \
        pytest.approx(15)
    s.steps(11, 40.0, 20).to(60.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3, health_check=1.5, startup=6 + 3, checkpoint_restore=0.5,
           productive=9 + 19, wasted_progress=15, failure_detection=1, recovery=1, other=1)


def test_in_process_rollback_within_one_generation() -> None:
    s = Script(steps=20).start()
    s.steps(1, 10.0, 12).steps(6, 22.0, 15).to(37.0, "COMPLETED", "completed")
    # Steps 6..12 of the first run were trained again by the second (from step 5).
    expect(book(s), provisioning=3, health_check=1, startup=6, productive=4 + 15,
           wasted_progress=7, other=1)


def test_slow_checkpoint_and_data_are_capped_by_their_interval() -> None:
    s = Script(steps=6).start()
    s.steps(1, 10.0, 3)
    s.records += [
        {"generation": 1, "step": 4, "ts": 18.0, "ckpt_block_s": 5.2, "data_s": 0.3},
        {"generation": 1, "step": 5, "ts": 19.0, "ckpt_block_s": 3.0},  # more than 1 s
        {"generation": 1, "step": 6, "ts": 20.0},
    ]
    s.to(21.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3, health_check=1, startup=6, productive=1 + 1 + 0.5 + 1,
           checkpoint_save=5.2 + 1, data_loading=0.3, other=1)


def test_supervisor_gap_while_workers_train_stays_productive() -> None:
    s = Script(steps=20).start()
    s.steps(1, 10.0, 20).checkpoint(19.5, 10)
    s.event(26.0, "supervisor_started", resumed=True, gap_s=6.5)  # dead 19.5 .. 26
    s.nodes_up(26.5, 26.6)
    s.to(30.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3, health_check=1, startup=6, productive=19, other=1)


def test_supervisor_gap_while_recovering_is_other() -> None:
    s = Script(steps=20).start()
    s.steps(1, 10.0, 15).checkpoint(19.5, 10)
    s.crash(24.5, exit_ts=24.3, newest_ckpt=10)
    s.event(40.0, "supervisor_started", resumed=True, gap_s=15.3)  # dead 24.7 .. 40
    s.to(40.2, "HEALTH_CHECK").launch(41.0, resume_step=10, after="worker_exit")
    s.event(44.0, "resumed", generation=2, step=10, load_s=1.0)
    s.steps(11, 47.0, 10).to(57.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3, health_check=1 + 0.8, startup=6 + 5, checkpoint_restore=1,
           productive=18, wasted_progress=5.3, failure_detection=0.2,
           recovery=0.2 + 0.2, other=15.3 + 1)


def test_live_books_book_the_step_in_flight_provisionally() -> None:
    s = Script(steps=100).start()
    expect(book(s, now=7.0), provisioning=3, health_check=1, startup=3)
    s.steps(1, 10.0, 10).checkpoint(19.2, 10)
    # Half a step since the last one: expected, so productive for now.
    expect(book(s, now=19.5), provisioning=3, health_check=1, startup=6, productive=9.5)
    # Nothing finished for 6 s when steps take 1 s: the excess is failure detection.
    expect(book(s, now=25.0), provisioning=3, health_check=1, startup=6, productive=10,
           failure_detection=5)
    # The hang detector stops it at 30: the whole silence was failure detection.
    s.to(30.0, "STOPPING", "hang")
    expect(book(s, now=30.0), provisioning=3, health_check=1, startup=6, productive=9,
           failure_detection=11)
    # Without that checkpoint, the restart would begin at step 0: all of it was wasted.
    s.events = [e for e in s.events if e["kind"] != "checkpoint_committed"]
    expect(book(s, now=30.0), provisioning=3, health_check=1, startup=6, wasted_progress=9,
           failure_detection=11)


def test_rank_failing_at_start_books_startup_then_detection() -> None:
    s = Script(steps=100).start()
    s.crash(6.2, exit_ts=6.0, newest_ckpt=None)
    s.to(8.0, "FAILED")
    expect(book(s), provisioning=3, health_check=1, startup=2, failure_detection=0.2,
           recovery=1.8)


def test_operator_stop_loses_the_steps_after_the_last_checkpoint() -> None:
    s = Script(steps=100).start()
    s.steps(1, 10.0, 15).checkpoint(19.5, 10)
    s.to(24.5, "STOPPING", "operator").to(25.0, "STOPPED", "operator")
    expect(book(s), provisioning=3, health_check=1, startup=6, productive=9,
           wasted_progress=5, other=0.5 + 0.5)


def test_waiting_for_a_replacement_node_is_provisioning() -> None:
    s = Script(steps=20).start()
    s.steps(1, 10.0, 10).checkpoint(19.5, 10)
    s.event(20.0, "node_state", node_id="n1", state="lost")
    s.crash(20.0, exit_ts=0, newest_ckpt=10, cause="node_lost")
    s.to(21.0, "HEALTH_CHECK")
    s.event(25.0, "node_registered", node_id="n1")  # its agent restarted
    s.event(25.5, "node_state", node_id="n1", state="active")
    s.launch(26.0, resume_step=10, after="node_lost")
    s.steps(11, 30.0, 10).to(40.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3 + 4, health_check=1 + 1, startup=6 + 4, productive=18,
           failure_detection=1, recovery=0.2 + 0.8, other=1)


def test_record_clock_skew_is_clamped_into_its_window() -> None:
    s = Script(steps=3).start()
    # Worker clock 2 s behind: the first record claims to end before the launch.
    s.records += [{"generation": 1, "step": 1, "ts": 3.0},
                  {"generation": 1, "step": 2, "ts": 5.0},
                  {"generation": 1, "step": 3, "ts": 4.5}]   # and one goes backwards
    s.to(7.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3, health_check=1, startup=0, productive=1, other=2)


def test_a_record_delivered_twice_counts_once() -> None:
    s = Script(steps=10).start()
    s.steps(1, 10.0, 10)
    s.records.insert(5, dict(s.records[4]))
    s.to(21.0, "COMPLETED", "completed")
    expect(book(s), provisioning=3, health_check=1, startup=6, productive=9, other=2)


def test_incremental_snapshots_match_a_rebuild() -> None:
    s = Script(steps=20).start()
    s.steps(1, 10.0, 15).checkpoint(19.5, 10)
    s.crash(24.5, exit_ts=24.3, newest_ckpt=10)
    s.to(26.7, "HEALTH_CHECK").launch(27.0, resume_step=10, after="worker_exit")
    s.steps(11, 33.0, 10).to(43.0, "COMPLETED", "completed")
    books = Books()
    records = sorted(s.records, key=lambda r: r["ts"])
    for e in s.events:  # the supervisor's order: each record after the events before it
        while records and records[0]["ts"] <= e["ts"]:
            books.add_record(records.pop(0))
        books.apply(e)
        books.snapshot(e["ts"])
    for r in records:
        books.add_record(r)
    assert books.snapshot(99.0).seconds == pytest.approx(book(s))
