"""One launch judged by its ``Generation``: starts counted until every rank has started,
an exit's outcome and its journal event, completion once every rank exited cleanly, news of
another generation ignored, a silent node of the launch lost. A real journal, a real node
registry and intake, on the shared fake clock; the observations are the ones the intake
queues."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeLog, begin_generation, make_context, make_intake

from orchestrator.config import Config
from orchestrator.contracts.protocol import (
    EventBatch,
    Heartbeat,
    RankExit,
    RankInfo,
    RanksStarted,
    RanksStopped,
    RegisterRequest,
)
from orchestrator.contracts.state import Cause, JobState, NodeState
from orchestrator.journal.store import read_events
from orchestrator.supervisor.chaos import ChaosDesk
from orchestrator.supervisor.generation.judge import Generation, Observation
from orchestrator.supervisor.generation.parts import GenerationParts
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.superseded import SupersededNodes

PPN = 2


class Launch:
    """Two nodes of two ranks, registered and active, and generation 2 launched on them."""

    def __init__(self, root: Path) -> None:
        self.cfg = Config.model_validate({
            "job": {"name": "t"}, "cluster": {"nodes": 2, "procs_per_node": PPN},
            "timeouts": {"node_lost_s": 10.0}})
        self.clock = FakeClock()
        self.ctx = make_context(root, self.cfg, self.clock, FakeLog())
        self.nodes = NodeRegistry(self.clock, self.ctx.record)
        self.intake = make_intake(self.ctx, self.nodes)
        for i in range(2):
            node, _ = self.nodes.register(RegisterRequest(
                node_id=f"n{i}", host="h", addr="127.0.0.1", procs=PPN, agent_pid=100 + i,
                free_port=20000 + i))
            self.nodes.move(node, NodeState.ACTIVE, node_rank=i)
        self.ctx.recorder.view.launches.append({"generation": 2, "nodes": {"n0": 0, "n1": 1}})
        self.ctx.recorder.view.state = JobState.RUNNING
        self.gen: Generation = begin_generation(self.intake, 2, 4)

    def send(self, node_id: str, *events: Any) -> list[Observation]:
        """What the intake queues for ``events`` of ``node_id``, taken off its queue."""
        self.intake.on_events(EventBatch(node_id=node_id, events=list(events)))
        queue = self.intake.queue
        return [queue.get_nowait() for _ in range(queue.qsize())]

    def events(self, kind: str) -> list[dict[str, Any]]:
        self.ctx.recorder.journal.flush()
        return [e for e in read_events(self.ctx.rundir.journal) if e["kind"] == kind]


@pytest.fixture
def launch(tmp_path: Path) -> Launch:
    return Launch(tmp_path)


def started(generation: int, node_rank: int) -> RanksStarted:
    base = node_rank * PPN
    return RanksStarted(generation=generation, ts=1.0, ranks=[
        RankInfo(rank=r, local_rank=r - base, pid=1000 + r) for r in range(base, base + PPN)])


def exit_of(generation: int, rank: int, code: int | None = 0, signal: str | None = None,
            **more: Any) -> RankExit:
    return RankExit(generation=generation, rank=rank, pid=1000 + rank, exit_code=code,
                    signal=signal, ts=5.0 + rank, log_tail=["step 7", "boom"], **more)


def test_the_generation_has_started_once_every_rank_has(launch: Launch) -> None:
    gen = launch.gen
    assert launch.intake.generation == 2
    assert gen.judge(launch.send("n0", started(2, 0))) is None
    assert not gen.all_started()  # two of four
    assert gen.judge(launch.send("n0", started(2, 0))) is None  # the same node again
    assert not gen.all_started()
    assert gen.judge(launch.send("n1", started(2, 1))) is None
    assert gen.all_started()
    assert gen.started == {"n0": [0, 1], "n1": [2, 3]}
    journaled = launch.events("ranks_started")
    assert [(e["node_id"], e["generation"]) for e in journaled] == \
        [("n0", 2), ("n0", 2), ("n1", 2)]
    assert journaled[-1]["ranks"] == [{"rank": 2, "pid": 1002}, {"rank": 3, "pid": 1003}]


def test_a_node_registering_again_mid_generation_counts_its_live_ranks(
        launch: Launch) -> None:
    for i, live in ((0, 2), (1, 1)):  # one of n1's ranks is gone already
        launch.intake.on_register(RegisterRequest(
            node_id=f"n{i}", host="h", addr="127.0.0.1", procs=PPN, agent_pid=100 + i,
            generation=2, ranks=started(2, i).ranks[:live]))
    assert launch.gen.started == {"n0": [0, 1], "n1": [2]}
    assert not launch.gen.all_started()  # three of four
    assert launch.gen.judge(launch.send("n1", started(2, 1))) is None
    assert launch.gen.all_started()


def test_a_supervisor_adopting_a_launch_counts_the_ranks_started_before_it(
        launch: Launch) -> None:
    """A supervisor restarted while LAUNCHING adopts ranks that started before it listened
    (their agents registered again with them): they count, or the launch would never be
    seen running and its deadline would end it."""
    for i in range(2):
        launch.intake.on_register(RegisterRequest(
            node_id=f"n{i}", host="h", addr="127.0.0.1", procs=PPN, agent_pid=100 + i,
            generation=2, ranks=started(2, i).ranks))
    launch.ctx.recorder.view.state = JobState.LAUNCHING
    launch.ctx.recorder.view.launches[-1].update(
        world_size=4, assignments={f"n{i}": {"generation": 2} for i in range(2)})
    parts = GenerationParts(launch.ctx, launch.nodes, launch.intake.feed(), launch.intake.stability,
                            asyncio.Event(), lambda state: None,
                            chaos=ChaosDesk(launch.ctx, launch.nodes),
                            superseded=SupersededNodes(launch.ctx, launch.nodes))
    assert asyncio.run(parts.adopt(2)) is None
    adopted = parts.judging(2)
    assert adopted.started == {"n0": [0, 1], "n1": [2, 3]}
    assert adopted.all_started()


def test_a_failing_exit_is_a_worker_exit_with_the_ranks_facts(launch: Launch) -> None:
    obs = launch.send("n1", exit_of(2, 3, code=None, signal="SIGKILL", error="OOM"))
    assert [o.kind for o in obs] == ["exits"]
    outcome = launch.gen.judge(obs)
    assert outcome is not None and outcome.cause is Cause.WORKER_EXIT
    assert outcome.detail == {"rank": 3, "node_id": "n1", "pid": 1003, "exit_code": None,
                              "signal": "SIGKILL", "ts": 8.0,
                              "log_tail": ["step 7", "boom"], "error": "OOM"}
    (event,) = launch.events("ranks_exited")
    assert (event["generation"], event["node_id"]) == (2, "n1")
    assert event["exits"] == [{"rank": 3, "pid": 1003, "exit_code": None, "signal": "SIGKILL",
                               "exit_ts": 8.0, "log_tail": ["step 7", "boom"],
                               "error": "OOM"}]
    # A repeat of the same exit is not news: no outcome, no second event.
    assert launch.gen.judge(launch.send("n1", exit_of(2, 3, code=None,
                                                      signal="SIGKILL"))) is None
    assert len(launch.events("ranks_exited")) == 1
    failure = launch.gen.root_cause(Cause.WORKER_EXIT, outcome.detail)
    assert (failure["generation"], failure["rank"], failure["node_id"]) == (2, 3, "n1")
    assert failure["message"] == "rank 3 on node n1 was killed by SIGKILL: OOM"


def test_a_nodes_single_exit_is_one_ranks_exited_event(launch: Launch) -> None:
    outcome = launch.gen.judge([Observation("exits", "n0", [exit_of(2, 1, code=3)])])
    assert outcome is not None and outcome.cause is Cause.WORKER_EXIT
    assert outcome.detail["exit_code"] == 3 and outcome.detail["rank"] == 1
    (event,) = launch.events("ranks_exited")
    (one,) = event["exits"]
    assert (event["generation"], one["rank"], one["exit_code"], one["exit_ts"]) == \
        (2, 1, 3, 6.0)
    assert launch.events("rank_exited") == []


def test_every_rank_exiting_cleanly_completes_the_generation(launch: Launch) -> None:
    gen = launch.gen
    assert gen.judge(launch.send("n0", exit_of(2, 0), exit_of(2, 1))) is None
    assert gen.judge(launch.send("n1", exit_of(2, 2))) is None  # three of four
    outcome = gen.judge(launch.send("n1", exit_of(2, 3)))
    assert outcome is not None and outcome.cause is Cause.COMPLETED and outcome.detail == {}
    assert sorted(gen.exits) == [0, 1, 2, 3]


def test_news_of_another_generation_is_ignored(launch: Launch) -> None:
    gen = launch.gen
    stale = [*launch.send("n0", started(1, 0)),
             *launch.send("n1", exit_of(1, 2, code=1), exit_of(1, 3, code=1)),
             Observation("exits", "n0", [exit_of(1, 0, code=1)])]
    assert gen.judge(stale) is None
    assert gen.started == {} and gen.exits == {} and not gen.all_started()
    assert launch.events("ranks_started") == [] and launch.events("ranks_exited") == []
    assert launch.events("rank_exited") == []
    # A rank outside the world is not this generation's either.
    assert gen.judge([Observation("exits", "n1", [exit_of(2, 4, code=1)])]) is None
    assert gen.exits == {}


def test_a_stop_of_any_generation_is_journaled_and_marks_its_node(launch: Launch) -> None:
    obs = launch.send("n0", RanksStopped(generation=1, ts=1.0, free_port=30000))
    assert launch.nodes.nodes["n0"].stopped_generation == 1  # marked on arrival
    launch.nodes.nodes["n0"].stopped_generation = None
    assert launch.gen.judge(obs) is None
    node = launch.nodes.nodes["n0"]
    assert (node.stopped_generation, node.free_port) == (1, 30000)
    assert [(e["node_id"], e["generation"]) for e in launch.events("ranks_stopped")] == \
        [("n0", 1)]


def test_a_silent_node_of_the_launch_is_lost(launch: Launch) -> None:
    launch.clock.advance(10.01)
    launch.nodes.heartbeat("n0", 2, None, [])  # n0 beats on; n1 is silent past node_lost_s
    outcome = launch.gen.judge([])
    assert outcome is not None and outcome.cause is Cause.NODE_LOST
    assert outcome.detail == {"node_id": "n1", "message": "node n1 went silent"}
    assert launch.nodes.nodes["n1"].state is NodeState.LOST


def test_a_turn_journals_the_calibration_once_the_ranks_pace_moved_it(launch: Launch) -> None:
    """``Generation.tick``: the training timeout the hang checks calibrated from the ranks'
    pace is journaled (a restarted supervisor starts from it), and not again while it holds."""
    launch.gen.tick()
    assert launch.events("calibration") == []  # no pace reported yet: nothing to carry
    for step in range(1, 31):
        launch.clock.advance(0.5)
        for i in range(2):
            launch.intake.on_heartbeat(Heartbeat(node_id=f"n{i}", generation=2, ranks=[
                RankInfo(rank=r, local_rank=r % PPN, step=step, phase="training",
                         beat_ts=launch.clock.time(), step_interval_max=0.5)
                for r in range(i * PPN, (i + 1) * PPN)]))
    assert launch.gen.judge([]) is None  # the hang check reads the pace
    launch.gen.tick()
    launch.gen.tick()
    [calibration] = launch.events("calibration")
    assert calibration["max_interval_s"] == 0.5
    assert calibration["training_timeout_s"] == round(launch.gen.training_timeout.value(), 3)
