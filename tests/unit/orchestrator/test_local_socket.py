"""The agent's local socket: a rank's beat line is parsed into the protocol's types before
any of it reaches the node's heartbeat; the worker SDK refuses a step that is not one."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.agent.local_socket import LocalHub
from orchestrator.contracts.protocol import Heartbeat, RankInfo
from orchestrator.worker.sdk import Worker

GOOD = {"t": "beat", "rank": 3, "pid": 1234, "generation": 2, "step": 7, "phase": "training",
        "last_step_ts": 1.7e9, "interval_max": 0.4, "step_time": 0.3, "data_wait": 0.01,
        "ts": 1.7e9 + 1, "records": [{"step": 7, "loss": 2.5}], "progress": "sdk",
        "finished": False}


def _heartbeat_of(hub: LocalHub, rank: int) -> Heartbeat:
    """What the agent's heartbeat carries for ``rank`` (``Agent._rank_infos``), parsed
    as the supervisor parses it: strictly, from its JSON."""
    beat = hub.beats[rank]
    info = RankInfo(rank=rank, local_rank=0, pid=beat.pid, alive=True)
    info.step, info.phase = beat.step, beat.phase
    info.last_step_ts, info.beat_ts = beat.last_step_ts, beat.ts
    info.step_interval_max = beat.interval_max
    info.progress, info.finished = beat.progress, beat.finished
    info.step_time, info.data_wait = beat.step_time, beat.data_wait
    hb = Heartbeat(node_id="n0", generation=beat.generation, free_port=None, ranks=[info],
                   records=[])
    return Heartbeat.model_validate_json(hb.model_dump_json())


@pytest.mark.parametrize("field, value", [
    ("step", 5.0), ("step", -1), ("step", "7"), ("phase", "warming"), ("rank", "3"),
    ("interval_max", 8 * 86400.0), ("ts", -5.0), ("pid", True), ("progress", "mine"),
    ("finished", "yes"), ("records", {"step": 1}), ("generation", 2.5)])
def test_a_beat_that_is_not_the_protocols_is_dropped_and_the_last_good_one_stands(
        field: str, value: Any) -> None:
    """Before: the fields went into the node's heartbeat unchecked, the supervisor refused
    every heartbeat of the node (422) and declared it LOST."""
    hub = LocalHub(on_event=lambda msg: None)
    assert hub.handle(dict(GOOD)) == 3
    assert hub.handle({**GOOD, "step": 8, field: value}) is None
    assert hub.dropped == 1 and hub.beats[3].step == 7
    assert _heartbeat_of(hub, 3).ranks[0].step == 7


def test_a_summary_figure_that_is_not_a_measurement_is_left_out_not_the_beat() -> None:
    hub = LocalHub(on_event=lambda msg: None)
    assert hub.handle({**GOOD, "step_time": -1.0, "data_wait": "slow"}) == 3
    beat = hub.beats[3]
    assert beat.step == 7 and beat.step_time is None and beat.data_wait is None


def test_a_beat_without_pid_or_generation_keeps_the_earlier_ones_and_records_wait_apart(
) -> None:
    hub = LocalHub(on_event=lambda msg: None)
    assert hub.handle(GOOD) == 3
    later = {k: v for k, v in GOOD.items() if k not in ("pid", "generation")}
    assert hub.handle({**later, "step": 8, "records": [{"step": 8, "loss": 2.4}]}) == 3
    beat = hub.beats[3]
    assert (beat.pid, beat.generation, beat.step) == (1234, 2, 8)
    assert beat.records == []  # relayed from ``records``, once, not from the kept beat
    assert hub.take_records(1000) == (2, [{"step": 7, "loss": 2.5}, {"step": 8, "loss": 2.4}])
    assert hub.handle({**GOOD, "pid": 99, "generation": 3, "records": []}) == 3
    assert (hub.beats[3].pid, hub.beats[3].generation) == (99, 3)


def test_each_problem_is_said_once_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[dict[str, Any]] = []

    class Log:
        def warning(self, msg: str, **kw: Any) -> None:
            lines.append(kw)

    monkeypatch.setattr("orchestrator.agent.local_socket.get_logger", lambda name: Log())
    hub = LocalHub(on_event=lambda msg: None)
    for _ in range(5):
        hub.handle({**GOOD, "step": 1.5})
    hub.handle({**GOOD, "rank": 4, "step": 1.5})
    assert hub.dropped == 6
    assert [(x["rank"], x["problem"].split(":")[0]) for x in lines] == [(3, "step"), (4, "step")]


beat_values = st.one_of(st.none(), st.booleans(), st.integers(-2**60, 2**60),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                        st.sampled_from(["training", "init", "finishing", "sdk", "hook"]),
                        st.lists(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                                 max_size=2))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(GOOD)), beat_values, max_size=len(GOOD)))
def test_whatever_a_beat_line_holds_the_heartbeat_stays_valid(mutation: dict[str, Any]) -> None:
    """A good beat, then one with any of its fields replaced by anything JSON can hold:
    handling never raises, and the heartbeat the agent builds from what it kept always
    passes the supervisor's strict parse."""
    hub = LocalHub(on_event=lambda msg: None)
    hub.handle(dict(GOOD))
    line = json.loads(json.dumps({**GOOD, **mutation}, allow_nan=True))
    kept = hub.handle(line)
    for rank in hub.beats:
        _heartbeat_of(hub, rank)
    assert kept is None or kept == line["rank"]


class _Clock:
    def __call__(self) -> float:
        return 100.0


def test_the_sdk_refuses_a_step_that_is_not_an_integer_in_range() -> None:
    w = Worker(env={"RANK": "0"}, clock=_Clock())
    with pytest.raises(TypeError, match="step must be an int, not float"):
        w.step_done(5.0)
    with pytest.raises(TypeError, match="not bool"):
        w.step_done(True)
    with pytest.raises(ValueError, match="outside 0..2"):
        w.step_done(-1)
    w.step_done(np.int64(3))  # a numpy integer is one
    assert w._step == 3 and type(w._step) is int
