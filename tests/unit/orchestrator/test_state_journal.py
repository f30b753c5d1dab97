"""State machine, journal and the journal's fold (JobView)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.journal import Journal, read_events
from orchestrator.jobview import JobView
from orchestrator.state import ALLOWED, IllegalTransition, JobState, check_transition


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


def test_terminal_states_have_no_way_out() -> None:
    for s in JobState:
        assert (not ALLOWED[s]) == s.terminal


def test_journal_appends_durably_and_survives_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with Journal(path, clock=lambda: 100.0) as j:
        j.append("a", x=1)
        j.append("b", y=[1, 2])
    with open(path, "a") as f:
        f.write('{"seq": 3, "kind": "tor')  # writer killed mid-line
    with Journal(path, clock=lambda: 200.0) as j:
        e = j.append("c")
    assert e["seq"] == 3  # the torn line never counted
    events = list(read_events(path))
    assert [ev["kind"] for ev in events] == ["a", "b", "c"]
    assert events[0]["ts"] == 100.0 and events[1]["y"] == [1, 2]
    for line in path.read_text().splitlines():
        if "tor" not in line:
            json.loads(line)


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
