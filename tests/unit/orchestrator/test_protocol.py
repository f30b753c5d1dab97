"""The agent->supervisor messages: what real agents send parses; what the known attacks sent
is refused at parse time with a reason (strict types, finite numbers, bounds, closed sets)."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import ValidationError

from orchestrator.contracts.protocol import (
    EventBatch,
    HealthReport,
    Heartbeat,
    RankExit,
    RankInfo,
    RanksStarted,
    RanksStopped,
    RegisterRequest,
    WorkerEvent,
    keep_valid_records,
)


def _hb(**over: object) -> dict:
    hb = {"node_id": "local-0", "generation": 3, "free_port": 29500,
          "ranks": [{"rank": 0, "local_rank": 0, "pid": 123, "step": 7, "phase": "training",
                     "last_step_ts": time.time(), "beat_ts": time.time(),
                     "step_interval_max": 0.25}],
          "records": [{"step": 7, "ts": time.time(), "loss": 2.5, "grad_norm": 1.0,
                       "lr": 3e-4, "tokens": 4096, "batch": 7, "skipped": False}]}
    hb.update(over)
    return hb


def _worker(name: str, data: dict, rank: int = 0) -> dict:
    return {"node_id": "local-0", "events": [
        {"type": "worker", "generation": 1, "rank": rank, "name": name, "data": data,
         "ts": time.time()}]}


def test_what_real_agents_send_round_trips_through_json() -> None:
    now = time.time()
    info = RankInfo(rank=1, local_rank=0, pid=99, alive=False, exit_code=None,
                    signal="SIGKILL")
    messages = [
        RegisterRequest(node_id="gpu-node.7", host="gpu-node.example", addr="10.0.0.7",
                        procs=8, agent_pid=4242, free_port=29500, generation=2,
                        assignment_version=5, ranks=[info]),
        Heartbeat.model_validate(_hb()),
        EventBatch(node_id="local-0", events=[
            RankExit(generation=1, rank=1, pid=99, exit_code=1, ts=now, log_tail=["boom"]),
            RanksStarted(generation=1, ranks=[info], ts=now),
            RanksStopped(generation=1, ts=now, free_port=29501),
            # The trainer's own events, with the fields it sends today.
            WorkerEvent(generation=1, rank=0, name="checkpoint_committed", ts=now,
                        data={"tier": "local", "step": 10, "path": "/r/step-00000010",
                              "tokens": 40960, "blocking_s": 0.01, "save_s": 0.2,
                              "bytes": 123456}),
            WorkerEvent(generation=1, rank=0, name="checkpoint_pruned", ts=now,
                        data={"tier": "local", "steps": [10, 20], "failing": [30]}),
            WorkerEvent(generation=1, rank=0, name="checkpoint_skipped", ts=now,
                        data={"step": 30, "path": "/r/step-00000030", "tier": "local",
                              "reason": "bad digest", "problems": ["bad digest"],
                              "signature": None}),
            WorkerEvent(generation=1, rank=0, name="startup", ts=now,
                        data={"first_step_done": now, "process_start": now - 3,
                              "imports_done": now - 2, "dist_ready": None}),
            WorkerEvent(generation=1, rank=2, name="chaos", ts=now,
                        data={"id": "kill-0", "rank": 2, "step": 5, "signal": "SIGKILL"}),
            WorkerEvent(generation=1, rank=0, name="params_digest", ts=now,
                        data={"step": 40, "crc32": "0badf00d", "numel": 1000}),
            WorkerEvent(generation=1, rank=0, name="my_metric", ts=now,
                        data={"value": 1.5, "label": "x", "ok": True}),
            HealthReport(nonce="n1", stage="node", sent_ts=now, results=[
                {"node_id": "local-0", "check": "disk", "ok": True, "severity": "fatal",
                 "message": "ok", "duration_s": 0.01, "level": "quick",
                 "details": {"free_gb": 10}}]),
        ]),
    ]
    for msg in messages:
        wire = json.dumps(msg.model_dump(mode="json"))
        assert type(msg).model_validate_json(wire) == msg


def test_a_non_finite_loss_in_a_step_record_is_data_not_an_error() -> None:
    hb = Heartbeat.model_validate_json(
        '{"node_id": "local-0", "records": [{"step": 3, "loss": NaN, "grad_norm": Infinity}]}')
    rec = hb.records[0]
    assert rec["step"] == 3 and rec["loss"] != rec["loss"]


@pytest.mark.parametrize(("name", "data", "why"), [
    ("checkpoint_committed", {}, "step"),
    ("checkpoint_committed", {"step": "abc"}, "step"),
    ("checkpoint_committed", {"step": -1}, "step"),
    ("checkpoint_committed", {"step": 1.5}, "step"),
    ("checkpoint_committed", {"step": True}, "step"),
    ("checkpoint_committed", {"step": 3, "blocking_s": float("nan")}, "blocking_s"),
    ("checkpoint_committed", {"step": 3, "path": "x" * 10_000}, "path"),
    ("checkpoint_committed", {"step": 1, "generation": 9}, "generation"),
    ("resumed", {"step": 1, "rank": 3}, "rank"),
    ("my_event", {"kind": "transition"}, "kind"),
    ("my_event", {"node_id": "other"}, "node_id"),
    ("my_event", {"seq": 1}, "seq"),
    ("my_event", {"ts": 1.0}, "ts"),
    ("my_event", {"nested": {"a": 1}}, "nested"),
    ("my_event", {"x" * 65: 1}, "keys"),
    ("my_event", {"\x1b[2J": 1}, "keys"),
    ("startup", {"first_step_done": float("inf")}, "first_step_done"),
    ("chaos", {"id": "kill-0", "rank": 1, "step": 5, "signal": "SIGKILL"}, "rank"),
    ("chaos", {"id": "kill-0", "rank": 0, "signal": "SIGNOPE"}, "signal"),
    ("checkpoint_pruned", {"steps": ["a"]}, "steps"),
])
def test_worker_event_data_is_typed_per_name(name: str, data: dict, why: str) -> None:
    with pytest.raises(ValidationError) as err:
        EventBatch.model_validate(_worker(name, data))
    assert why in str(err.value)


@pytest.mark.parametrize("name", ["Checkpoint", "", "x" * 65, "a b", "évènement", "a\x1bb"])
def test_worker_event_names_are_identifiers(name: str) -> None:
    with pytest.raises(ValidationError):
        EventBatch.model_validate(_worker(name, {}))


@pytest.mark.parametrize("node_id", ["evil-²", "", "a" * 129, "\x1b[31mred", "a/b", "-lead",
                                     "n\n1", "ｆｕｌｌ"])
def test_node_ids_are_printable_ascii(node_id: str) -> None:
    with pytest.raises(ValidationError):
        Heartbeat.model_validate(_hb(node_id=node_id))
    with pytest.raises(ValidationError):
        RegisterRequest(node_id=node_id, host="h", addr="a", procs=1, agent_pid=1)


@pytest.mark.parametrize(("rank_over", "why"), [
    ({"phase": "model_config"}, "phase"),
    ({"phase": "__class__"}, "phase"),
    ({"step_interval_max": 1e15}, "step_interval_max"),
    ({"step_interval_max": -1.0}, "step_interval_max"),
    ({"beat_ts": float("nan")}, "beat_ts"),
    ({"last_step_ts": float("inf")}, "last_step_ts"),
    ({"rank": 1 << 40}, "rank"),
    ({"rank": "0"}, "rank"),
    ({"step": 2.0}, "step"),
    ({"signal": "SIGEVIL"}, "signal"),
    ({"alive": "yes"}, "alive"),
])
def test_rank_fields_are_strict_finite_and_closed(rank_over: dict, why: str) -> None:
    hb = _hb()
    hb["ranks"][0].update(rank_over)
    with pytest.raises(ValidationError) as err:
        Heartbeat.model_validate_json(json.dumps(hb, allow_nan=True))
    assert why in str(err.value)


def test_nan_and_infinity_literals_are_refused_outside_step_records() -> None:
    for bad in ('{"node_id": "n", "events": [{"type": "rank_exit", "generation": 1, '
                '"rank": 0, "ts": NaN}]}',
                '{"node_id": "n", "events": [{"type": "ranks_stopped", "generation": 1, '
                '"ts": Infinity}]}'):
        with pytest.raises(ValidationError):
            EventBatch.model_validate_json(bad)


def test_bounded_strings_lists_and_depth() -> None:
    with pytest.raises(ValidationError):
        RegisterRequest(node_id="n", host="h" * 65536, addr="a", procs=1, agent_pid=1)
    with pytest.raises(ValidationError):
        RegisterRequest(node_id="n", host="h\x1b[2J", addr="a", procs=1, agent_pid=1)
    with pytest.raises(ValidationError):
        RankExit(generation=1, rank=0, ts=1.0, log_tail=["x"] * 201)
    with pytest.raises(ValidationError):
        RankExit(generation=1, rank=0, ts=1.0, log_tail=["x" * 5000])
    deep: dict = {}
    cur = deep
    for _ in range(40):
        cur["d"] = {}
        cur = cur["d"]
    report = {"type": "health", "nonce": "n", "stage": "network", "sent_ts": 1.0,
              "measured": deep}
    with pytest.raises(ValidationError, match="deeper than 32"):
        EventBatch.model_validate({"node_id": "n", "events": [report]})
    # The configured depth comes in through the validation context.
    EventBatch.model_validate({"node_id": "n", "events": [report]},
                              context={"max_json_depth": 64})


def test_a_100k_deep_body_is_refused_by_the_parser_at_once() -> None:
    body = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValidationError, match="recursion limit") as err:
        Heartbeat.model_validate_json(body)
    # The parser stopped a couple of hundred bytes in, not after reading 100k levels.
    column = int(str(err.value).split("column ")[1].split()[0].rstrip("]"))
    assert column <= 256


def test_a_health_result_must_be_a_check_result() -> None:
    with pytest.raises(ValidationError):
        HealthReport(nonce="n", stage="node", sent_ts=1.0, results=[{"node_id": "local-0"}])


def test_an_agent_drops_a_bad_step_record_not_the_beat() -> None:
    good = {"step": 3, "ts": 1.7e9, "loss": float("nan"), "note": "ok"}
    kept, dropped = keep_valid_records([good, {"step": "4"}, {"step": 5, "tokens": "12"},
                                        {"step": 6, "loss": 1.0, "s": "x" * 300}])
    # A record whose own fields do not fit goes; a script's metric that does not fit is
    # left out of a record that is kept.
    assert kept == [good, {"step": 6, "loss": 1.0}] and dropped == 2
    Heartbeat(node_id="local-0", records=kept)


def test_the_operators_stop_request() -> None:
    from orchestrator.contracts.protocol import StopRequest

    stop = StopRequest.model_validate_json(b'{"reason": "orchestrator down", "checkpoint": false}')
    assert (stop.reason, stop.checkpoint) == ("orchestrator down", False)
    for bad in (b'{"reason": "\\u001b[2Jgone"}', b'{"reason": "x", "checkpoint": "no"}',
                b'{"why": "x"}', b'{"reason": "' + b"x" * 201 + b'"}'):
        with pytest.raises(ValidationError):
            StopRequest.model_validate_json(bad)
