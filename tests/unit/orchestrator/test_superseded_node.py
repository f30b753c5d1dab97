"""A node lost in one generation that comes back with its ranks (a network cut shorter than
its agent's lease) is told to stop them and becomes a spare: never a member of the
generation it left. A node placed in the newest generation is left alone while its agent
gets there. The generation's environment carries the lineage that fences checkpoints."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fakes import FakeClock, FakeLog, begin_generation, make_context

from orchestrator.contracts import env as ec
from orchestrator.contracts import events as ev
from orchestrator.config import Config
from orchestrator.journal.view import JobView
from orchestrator.journal.store import read_journal
from orchestrator.contracts.protocol import Heartbeat, RegisterRequest
from orchestrator.contracts.state import NodeState
from orchestrator.supervisor.chaos import ChaosDesk
from orchestrator.supervisor.generation.parts import GenerationParts
from orchestrator.supervisor.intake import Intake
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.stability import StabilityHook
from orchestrator.supervisor.superseded import SupersededNodes


def _setup(tmp_path: Path) -> tuple:
    cfg = Config.model_validate({"job": {"name": "t"}, "cluster": {"nodes": 2, "spares": 1}})
    ctx = make_context(tmp_path, cfg, FakeClock(), FakeLog())
    nodes = NodeRegistry(ctx.clock, ctx.record)
    superseded = SupersededNodes(ctx, nodes)
    intake = Intake(ctx, nodes, StabilityHook(ctx), lambda *a: None,
                    note_superseded=superseded.note,
                    chaos_fired=ChaosDesk(ctx, nodes).mark_fired)
    for i in range(3):
        nodes.register(RegisterRequest(node_id=f"n{i}", host="h", addr=f"10.0.0.{i}",
                                       procs=1, agent_pid=100 + i, free_port=20000 + i))
    return ctx, nodes, intake, superseded


def _launch(ctx, nodes: NodeRegistry, generation: int, members: dict[str, int],
            resume_step: int | None) -> None:
    ctx.record(ev.GenerationLaunched(generation=generation, world_size=2, nodes=members,
                                     resume_step=resume_step))
    for node_id, rank in members.items():
        asyncio.run(nodes.assign(node_id, action="run", generation=generation,
                                 node_rank=rank))


def test_a_node_back_with_a_superseded_generation_stops_it_and_is_a_spare(
        tmp_path: Path) -> None:
    ctx, nodes, intake, superseded = _setup(tmp_path)
    n0, n1, n2 = (nodes.nodes[f"n{i}"] for i in range(3))
    for node, rank in ((n0, 0), (n1, 1)):
        nodes.move(node, NodeState.ACTIVE, node_rank=rank)
    nodes.move(n2, NodeState.SPARE, node_rank=None)
    _launch(ctx, nodes, 1, {"n0": 0, "n1": 1}, None)
    nodes.move(n1, NodeState.LOST, reason="silent for 10.0 s")
    nodes.move(n2, NodeState.ACTIVE, node_rank=1)
    _launch(ctx, nodes, 2, {"n0": 0, "n2": 1}, 20)
    begin_generation(intake, 2, 2)
    # n2's agent has not started generation 2 yet: its beat still says 1. Not touched.
    intake.on_heartbeat(Heartbeat(node_id="n2", generation=1))
    # n1 is back, its ranks still in generation 1.
    intake.on_register(RegisterRequest(node_id="n1", host="h", addr="10.0.0.1", procs=1,
                                       agent_pid=101, generation=1, assignment_version=1))
    assert n1.state is NodeState.REGISTERED and superseded.pending == {"n1"}
    before = n2.assignment.version
    asyncio.run(superseded.stop(2))
    assert n1.assignment.action == "idle" and n1.assignment.generation is None
    assert n1.state is NodeState.SPARE
    assert n2.assignment.version == before and n2.assignment.action == "run"
    # Its next beats (ranks stopped, generation 1 still its last) change nothing more.
    version = n1.assignment.version
    intake.on_heartbeat(Heartbeat(node_id="n1", generation=1))
    asyncio.run(superseded.stop(2))
    assert n1.assignment.version == version and superseded.pending == set()


def test_the_generation_env_carries_the_runs_lineage(tmp_path: Path) -> None:
    ctx, nodes, intake, superseded = _setup(tmp_path)
    _launch(ctx, nodes, 1, {"n0": 0, "n1": 1}, None)
    ctx.record(ev.CheckpointCommitted(step=30, tier="local", path="/c/step-00000030",
                                      generation=1, rank=0))
    parts = GenerationParts(ctx, nodes, intake.feed(), StabilityHook(ctx), asyncio.Event(),
                            lambda s: None, chaos=ChaosDesk(ctx, nodes), superseded=superseded)
    env = ec.GenerationEnv.from_env(parts.generation_env(2, resume_max_step=None))
    assert env.generation == 2 and env.lineage == [(1, -1), (2, 30)]
    assert env.resume_max_step is None  # no rollback's limit: any committed step
    limited = ec.GenerationEnv.from_env(parts.generation_env(2, resume_max_step=0))
    assert limited.resume_max_step == 0  # a rollback to before the first checkpoint
    assert env.run_id == ctx.view.run_id and env.run_id.startswith("run-")
    ctx.recorder.journal.flush()  # the same from any reader of the journal (a standby's)
    again = JobView.from_events(read_journal(ctx.rundir.journal))
    assert again.run_id == ctx.view.run_id and again.lineage() == [(1, -1)]
