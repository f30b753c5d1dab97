"""Profiling on demand in the rank: the order's parsing (fuzzed), the session around a real
torch.profiler, and the order's way from the agent's socket into a training loop."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent.local_socket import LocalHub, LocalSocketServer
from orchestrator.contracts.protocol import MAX_PROFILE_STEPS
from orchestrator.worker.profiling import MAX_STEPS, BadOrder, ProfileOrder, ProfileSession
from orchestrator.worker.sdk import Worker


def test_the_worker_and_the_protocol_agree_on_the_step_limit() -> None:
    assert MAX_STEPS == MAX_PROFILE_STEPS


def test_an_order_parses_and_round_trips() -> None:
    order = ProfileOrder.parse({"t": "profile", "id": 3, "start_step": 120, "steps": 5})
    assert order == ProfileOrder(3, 120, 5)
    assert ProfileOrder.parse(json.loads(json.dumps(order.line()))) == order


@pytest.mark.parametrize("line, field", [
    ({"t": "profile", "id": 0, "start_step": 1, "steps": 1}, "id"),
    ({"t": "profile", "id": 1, "start_step": -1, "steps": 1}, "start_step"),
    ({"t": "profile", "id": 1, "start_step": 1, "steps": 0}, "steps"),
    ({"t": "profile", "id": 1, "start_step": 1, "steps": MAX_STEPS + 1}, "steps"),
    ({"t": "profile", "id": 1, "start_step": 1.5, "steps": 1}, "start_step"),
    ({"t": "profile", "id": True, "start_step": 1, "steps": 1}, "id"),
    ({"t": "profile", "id": 1, "start_step": "7", "steps": 1}, "start_step"),
])
def test_a_bad_order_names_its_field(line: dict[str, Any], field: str) -> None:
    with pytest.raises(BadOrder, match=field):
        ProfileOrder.parse(line)


CASES = 500
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4), max_leaves=12)
orders = st.fixed_dictionaries({"t": st.sampled_from(["profile", "beat", 1])}, optional={
    "id": json_values | st.integers(), "start_step": json_values | st.integers(),
    "steps": json_values | st.integers(min_value=-5, max_value=300)})


@settings(max_examples=CASES, deadline=None)
@given(obj=orders | json_values)
def test_any_line_is_an_order_within_bounds_or_bad_order(obj: Any) -> None:
    try:
        order = ProfileOrder.parse(obj)
    except BadOrder:
        return
    assert 1 <= order.id <= 1 << 31 and 0 <= order.start_step <= 1 << 53
    assert 1 <= order.steps <= MAX_STEPS
    assert ProfileOrder.parse(order.line()) == order


# -- the session around a real profiler ---------------------------------------------------------
def _train_steps(session: ProfileSession | None, steps: range, model: torch.nn.Module,
                 on_done: Any = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in steps:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if session is not None:
            session.on_step(step)


def test_a_session_profiles_exactly_its_steps_and_writes_a_chrome_trace(tmp_path: Path) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    session = ProfileSession(ProfileOrder(1, start_step=4, steps=2), rank=3,
                             run_dir=tmp_path, send=lambda name, **d: sent.append((name, d)))
    _train_steps(session, range(1, 9), torch.nn.Linear(8, 8))
    assert session.done and session.first_step == 4
    assert [name for name, _ in sent] == ["profile_written"]
    data = sent[0][1]
    assert (data["id"], data["start_step"], data["first_step"], data["last_step"]) == \
        (1, 4, 4, 5)
    trace = tmp_path / "profiles" / "4" / "rank-3" / "trace.json"
    assert data["path"] == str(trace) and data["bytes"] == trace.stat().st_size > 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::addmm" in names  # the Linear's forward ran inside the profile
    # One marker per step profiled, named with the training step's number.
    assert {n for n in names if str(n).startswith("ProfilerStep#")} == \
        {"ProfilerStep#4", "ProfilerStep#5"}


def test_a_late_order_starts_at_the_next_step_and_says_so(tmp_path: Path) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    session = ProfileSession(ProfileOrder(2, start_step=3, steps=1), rank=0, run_dir=tmp_path,
                             send=lambda name, **d: sent.append((name, d)))
    _train_steps(session, range(10, 13), torch.nn.Linear(8, 8))
    assert sent[0][0] == "profile_written"
    assert (sent[0][1]["first_step"], sent[0][1]["last_step"]) == (11, 11)
    assert (tmp_path / "profiles" / "3" / "rank-0" / "trace.json").exists()


def test_a_profiler_that_fails_is_reported_and_training_goes_on(tmp_path: Path) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def broken() -> Any:
        raise RuntimeError("no profiler here")

    session = ProfileSession(ProfileOrder(5, start_step=2, steps=2), rank=1, run_dir=tmp_path,
                             send=lambda name, **d: sent.append((name, d)), make_profiler=broken)
    _train_steps(session, range(1, 6), torch.nn.Linear(8, 8))
    assert session.done
    assert sent == [("profile_failed", {"id": 5, "start_step": 2,
                                        "error": "RuntimeError: no profiler here"})]


# -- from the agent's socket into the training loop ------------------------------------------
def test_an_order_on_the_agent_socket_profiles_the_sdk_loop(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []

    async def scenario() -> tuple[Worker, LocalHub]:
        hub = LocalHub(on_event=events.append)
        server = LocalSocketServer(hub)
        await server.start()
        # The order comes before the rank has connected: it waits for its first beat.
        hub.send_order(1, ProfileOrder(7, start_step=6, steps=2).line())
        w = Worker(env={"RANK": "1", "ORCH_AGENT_SOCKET": server.path,
                        "ORCH_HEARTBEAT_INTERVAL": "0.05", "ORCH_RUN_DIR": str(tmp_path)})
        await asyncio.to_thread(w.start)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = 0
        deadline = time.monotonic() + 60
        while not any(e["name"] == "profile_written" for e in events):
            assert time.monotonic() < deadline, events
            if step >= 4 and not w._profiles_seen:
                # The order is not read yet: hold before step 5, whose end starts step 6's
                # profile (the supervisor's lead does this in a job).
                await asyncio.sleep(0.02)
                continue
            step += 1
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            w.step_done(step, loss=loss.item(), data_s=0.001)
            await asyncio.sleep(0.01)
        await asyncio.to_thread(w.close)
        await server.close()
        return w, hub

    w, hub = asyncio.run(scenario())
    written = [e for e in events if e["name"] == "profile_written"]
    assert len(written) == 1 and written[0]["rank"] == 1
    assert (written[0]["data"]["first_step"], written[0]["data"]["last_step"]) == (6, 7)
    assert (tmp_path / "profiles" / "6" / "rank-1" / "trace.json").exists()
    assert w._profile is None  # back to the one attribute test per step
    assert hub.beats[1].data_wait == 0.001 and hub.beats[1].step_time is not None


def test_an_order_id_is_taken_once() -> None:
    w = Worker(env={"RANK": "0", "ORCH_RUN_DIR": "/nonexistent"})
    line = json.dumps(ProfileOrder(9, 100, 1).line()).encode()
    w._take_order(line)
    first = w._profile
    assert first is not None
    w._take_order(line)  # the agent re-sent it (a reconnect): the same session stays
    assert w._profile is first
