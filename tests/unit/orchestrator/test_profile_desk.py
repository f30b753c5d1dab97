"""The supervisor's side of profiling on demand, on the fake clock: the start step it picks,
the per-node orders it assigns, what it refuses and why, and the request body fuzzed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeLog, begin_generation, make_context, make_intake
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator.contracts import events as ev
from orchestrator.config import Config
from orchestrator.journal.store import read_events
from orchestrator.contracts.protocol import (
    MAX_PROFILE_STEPS,
    ProfileRequest,
    RankInfo,
    RegisterRequest,
)
from orchestrator.contracts.state import JobState, NodeState
from orchestrator.journal.status import build_status
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.profiles import ProfileDesk, ProfileRefused, choose_start


class Desk:
    def __init__(self, root: Path, nodes: int = 2, ppn: int = 2) -> None:
        self.cfg = Config.model_validate({
            "job": {"name": "t"}, "cluster": {"nodes": nodes, "procs_per_node": ppn},
            "timeouts": {"heartbeat_interval_s": 0.5}})
        self.clock = FakeClock()
        self.ctx = make_context(root, self.cfg, self.clock, FakeLog())
        self.nodes = NodeRegistry(self.clock, self.ctx.record)
        self.intake = make_intake(self.ctx, self.nodes)
        self.desk = ProfileDesk(self.ctx, self.nodes, self.intake)
        for i in range(nodes):
            node, _ = self.nodes.register(RegisterRequest(
                node_id=f"n{i}", host="h", addr="127.0.0.1", procs=ppn, agent_pid=100 + i))
            self.nodes.move(node, NodeState.ACTIVE, node_rank=i)
        self.ppn = ppn

    def run(self, steps: dict[int, int], step_time: float = 0.1) -> None:
        for to in (JobState.HEALTH_CHECK, JobState.LAUNCHING, JobState.RUNNING):
            self.ctx.record(ev.Transition(to=to, generation=1))
        self.ctx.record(ev.GenerationLaunched(generation=1,
                                              world_size=self.cfg.cluster.world_size))
        begin_generation(self.intake, 1, self.cfg.cluster.world_size)
        for node in self.nodes.active():
            base = node.node_rank * self.ppn
            infos = [RankInfo(rank=r, local_rank=r - base, step=steps.get(r),
                              phase="training", step_time=step_time)
                     for r in range(base, base + self.ppn)]
            self.nodes.heartbeat(node.node_id, 1, None, infos)
            self.intake.progress.on_ranks(1, infos)

    def order(self, **body: Any) -> ev.ProfileRequested:
        return asyncio.run(self.desk.order(ProfileRequest.model_validate(body)))


def test_the_start_step_leaves_two_beats_and_a_margin_at_the_fastest_step() -> None:
    assert choose_start(100, 0.1, 3.0) == 100 + 30 + 1
    assert choose_start(100, 10.0, 3.0) == 100 + 2 + 1  # slow steps: still two ahead
    assert choose_start(100, None, 3.0) == 103
    assert choose_start(0, 1e-9, 3.0) == (1 << 20) + 1  # bounded however fast


def test_an_order_goes_to_each_node_with_its_ranks_and_is_journaled_first(
        tmp_path: Path) -> None:
    d = Desk(tmp_path)
    d.run({0: 50, 1: 50, 2: 49, 3: 51}, step_time=0.1)
    event = d.order(steps=4, ranks=[3, 1, 2])
    # Newest step 51; lead 2 x 0.5 + 2 = 3 s at 0.1 s a step: 30 steps ahead.
    assert (event.id, event.start_step, event.steps, event.ranks) == (1, 82, 4, [1, 2, 3])
    assert event.dir == str(tmp_path / "profiles" / "82")
    orders = {n: [o.model_dump() for o in d.nodes.nodes[n].assignment.profiles]
              for n in ("n0", "n1")}
    assert orders == {
        "n0": [{"id": 1, "generation": 1, "start_step": 82, "steps": 4, "ranks": [1]}],
        "n1": [{"id": 1, "generation": 1, "start_step": 82, "steps": 4, "ranks": [2, 3]}]}
    d.ctx.recorder.journal.flush()
    asked = [e for e in read_events(d.ctx.rundir.journal) if e["kind"] == "profile_requested"]
    assert [e["start_step"] for e in asked] == [82]
    st = build_status(d.ctx.view, d.ctx.rundir)["profiles"]
    assert [(p["id"], p["state"], p["ranks"], p["written"]) for p in st] == \
        [(1, "pending", 3, 0)]


def test_refusals_say_why(tmp_path: Path) -> None:
    d = Desk(tmp_path)
    with pytest.raises(ProfileRefused, match="no running job to profile: the job is PENDING") \
            as refused:
        d.order(steps=2)
    assert refused.value.status == 409
    d.run({})
    with pytest.raises(ProfileRefused, match="no rank has finished a step yet"):
        d.order(steps=2)
    d.run({0: 5})
    with pytest.raises(ProfileRefused, match=r"unknown ranks 4, 9: the job has ranks 0\.\.3") \
            as refused:
        d.order(steps=2, ranks=[4, 9, 1])
    assert refused.value.status == 400
    d.order(steps=2)
    with pytest.raises(ProfileRefused, match="profile 1 .* is still being written"):
        d.order(steps=2)
    for rank in range(4):  # every rank reported: the next one may go
        d.ctx.record(ev.ProfileWritten(id=1, rank=rank, start_step=1, path="x", bytes=1))
    assert d.order(steps=1).id == 2
    d.ctx.recorder.journal.flush()
    assert [e["id"] for e in read_events(d.ctx.rundir.journal)
            if e["kind"] == "profile_requested"] == [1, 2]


def test_a_restart_abandons_a_pending_profile(tmp_path: Path) -> None:
    d = Desk(tmp_path)
    d.run({0: 5})
    d.order(steps=2)
    d.ctx.record(ev.ProfileFailed(id=1, rank=2, error="the rank finished"))
    d.ctx.record(ev.GenerationLaunched(generation=2, world_size=4))
    begin_generation(d.intake, 2, 4)
    listed = build_status(d.ctx.view, d.ctx.rundir)["profiles"][0]
    assert listed["state"] == "abandoned" and listed["failed"] == {"2": "the rank finished"}


CASES = 400
bodies = st.dictionaries(
    st.sampled_from(["steps", "ranks", "extra"]),
    st.none() | st.booleans() | st.integers(min_value=-5, max_value=1 << 40) | st.floats()
    | st.text(max_size=4) | st.lists(st.integers(min_value=-3, max_value=1 << 21) | st.text(
        max_size=2), max_size=5))


@settings(max_examples=CASES, deadline=None)
@given(body=bodies)
def test_any_request_body_is_a_bounded_request_or_refused(body: dict[str, Any]) -> None:
    raw = json.dumps(body)
    try:
        req = ProfileRequest.model_validate_json(raw)
    except ValidationError:
        return
    assert 1 <= req.steps <= MAX_PROFILE_STEPS and isinstance(req.steps, int)
    assert req.ranks is None or (req.ranks and all(0 <= r < 1 << 20 for r in req.ranks))
