"""State machine, journal and the journal's fold (JobView)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.contracts import events as ev
from orchestrator.journal.store import Journal, SkipReport, read_events, read_journal
from orchestrator.journal.view import JobView
from orchestrator.contracts.state import ALLOWED, IllegalTransition, JobState, check_transition


def test_lifecycle_of_design_is_allowed() -> None:
    path = ["PENDING", "HEALTH_CHECK", "LAUNCHING", "RUNNING", "STOPPING", "RECOVERING",
            "HEALTH_CHECK", "LAUNCHING", "RUNNING", "COMPLETED"]
    for a, b in zip(path, path[1:]):
        check_transition(JobState(a), JobState(b))


@pytest.mark.parametrize("a,b", [("PENDING", "RUNNING"), ("RUNNING", "LAUNCHING"),
                                 ("COMPLETED", "RUNNING"), ("FAILED", "RECOVERING"),
                                 ("RUNNING", "FAILED"), ("STOPPING", "RUNNING")])
def test_illegal_moves_raise(a: str, b: str) -> None:
    with pytest.raises(IllegalTransition):
        check_transition(JobState(a), JobState(b))


def test_terminal_states_have_no_way_out_but_a_stopped_job_continued() -> None:
    for s in JobState:
        if s is JobState.STOPPED:
            assert ALLOWED[s] == {JobState.PENDING}  # up --resume: a new segment
        else:
            assert (not ALLOWED[s]) == s.terminal


def test_journal_appends_durably_and_survives_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with Journal(path, clock=lambda: 100.0) as j:
        j.append(ev.Progress(generation=1, step=1, tokens=2))
        j.append(ev.CheckpointPruned(steps=[1, 2]))
    with open(path, "a") as f:
        f.write('{"seq": 3, "kind": "tor')  # writer killed mid-line
    with Journal(path, clock=lambda: 200.0) as j:
        e = j.append(ev.Progress(generation=1, step=3), durable=True)
        on_disk = list(read_events(path))  # durable: on disk before append returned
    assert e.seq == 3  # the torn line never counted
    assert [x["kind"] for x in on_disk] == ["progress", "checkpoint_pruned", "progress"]
    skipped = SkipReport()
    events = list(read_journal(path, skipped))
    assert [x.kind for x in events] == ["progress", "checkpoint_pruned", "progress"]
    assert events[0].ts == 100.0 and events[1].event.steps == [1, 2]
    assert skipped.lines == 1 and "not JSON" in skipped.reasons[0]
    for line in path.read_text().splitlines():
        if "tor" not in line:
            json.loads(line)


def test_data_cannot_set_the_envelope_or_write_non_standard_json() -> None:
    with pytest.raises(ValueError):
        ev.WorkerNote(kind="resumed", seq=99)
    with pytest.raises(ValueError):
        ev.WorkerNote(kind="startup", ts=1.0)
    with pytest.raises(ValueError):
        ev.CheckpointCommitted(step=1, blocking_s=float("nan"))
    with pytest.raises(ValueError):
        ev.WorkerNote(kind="startup", load=float("inf"))
    with pytest.raises(ValueError):
        ev.CheckpointCommitted(step="abc")
    with pytest.raises(ValueError):
        ev.NodeRegistered(node_id="x" * 300)


def test_readers_skip_and_report_what_they_cannot_parse(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines = [
        {"seq": 1, "ts": 1.0, "kind": "job_created", "job": "j", "steps": 10},
        {"seq": 2, "ts": 2.0, "kind": "checkpoint_committed"},  # no step
        {"seq": 3, "ts": 3.0, "kind": "checkpoint_committed", "step": "abc"},
        {"seq": 4, "ts": 4.0, "kind": "from_the_future", "x": 1},
        {"seq": 5, "ts": 5.0, "kind": "checkpoint_committed", "step": 7, "new_field": 1},
        [1, 2, 3],
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nNaN\n"
                    + '{"seq": 6, "ts": NaN, "kind": "progress", "generation": 1, "step": 1}\n')
    skipped = SkipReport()
    view = JobView.from_events(read_journal(path, skipped))
    assert view.job == "j" and view.newest_checkpoint_step == 7
    assert skipped.lines == 6
    assert any("unknown kind 'from_the_future'" in r for r in skipped.reasons)


def test_group_commit_writes_many_events_in_few_fsyncs(tmp_path: Path) -> None:
    with Journal(tmp_path / "events.jsonl") as j:
        for i in range(2000):
            j.append(ev.RanksStopped(node_id=f"n{i}", generation=1))
        j.flush()
        batches = j.batches
    assert len(list(read_events(tmp_path / "events.jsonl"))) == 2000
    assert batches < 2000  # one fsync per round, not per event


def _fail(gen: int, newest: int | None) -> dict:
    return {"kind": "failure", "generation": gen, "cause": "worker_exit",
            "newest_checkpoint_step": newest}


def test_restarts_without_progress_counts_back_from_the_newest() -> None:
    view = JobView.from_events([_fail(1, None), _fail(2, None)])
    assert view.restarts_without_progress() == 2
    view = JobView.from_events([_fail(1, 10), _fail(2, 10), _fail(3, 10)])
    assert view.restarts_without_progress() == 2  # generation 1 made progress (to 10)
    view = JobView.from_events([_fail(1, 10), _fail(2, 20)])
    assert view.restarts_without_progress() == 0


def test_view_folds_checkpoints_pruning_and_state() -> None:
    events = [
        {"kind": "job_created", "job": "j", "ts": 1.0, "steps": 9, "world_size": 2},
        {"kind": "transition", "from": "PENDING", "to": "HEALTH_CHECK", "ts": 2.0},
        {"kind": "checkpoint_committed", "step": 10, "ts": 3.0},
        {"kind": "checkpoint_committed", "step": 20, "ts": 4.0},
        {"kind": "checkpoint_pruned", "steps": [10], "ts": 5.0},
        {"kind": "generation_launched", "generation": 1, "ts": 6.0},
        {"kind": "generation_launched", "generation": 2, "after_cause": "hang", "ts": 7.0,
         "resume_step": 20},
    ]
    view = JobView.from_events(events)
    assert view.state is JobState.HEALTH_CHECK
    assert [c["step"] for c in view.committed_checkpoints] == [20]
    assert view.newest_checkpoint_step == 20
    assert view.restarts == [{"generation": 2, "ts": 7.0, "cause": "hang", "resume_step": 20}]


def test_a_script_of_its_own_makes_progress_by_optimizer_steps() -> None:
    # Four kills, each after the script advanced (its own snapshots, which we do not see):
    # no run of restarts without progress. The same failures of our trainer, with no new
    # checkpoint between them, are four in a row.
    def events(own: bool) -> list[dict]:
        out: list[dict] = [{"kind": "job_created", "job": "j", "own_script": own}]
        for gen in range(1, 5):
            out.append({"kind": "first_step", "generation": gen, "step": 1})
            out.append({**_fail(gen, None), "last_step": 40})
        return out

    assert JobView.from_events(events(own=True)).restarts_without_progress() == 0
    assert JobView.from_events(events(own=False)).restarts_without_progress() == 4
    stalled = JobView.from_events([*events(own=True),
                                   {"kind": "first_step", "generation": 5, "step": 1},
                                   {**_fail(5, None), "last_step": None}])
    assert stalled.restarts_without_progress() == 1  # a generation that never stepped
