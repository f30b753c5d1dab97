"""The supervisor's parts on the fake clock: the node state machine, judging a generation,
its root cause, and the stop deadline. No processes, no sockets: time moves only when the
test (or an awaited wait of the parts) moves it, so every timeout is asserted exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeLog, make_context

from orchestrator.contracts import events as ev
from orchestrator.config import Config
from orchestrator.journal.store import read_events
from orchestrator.contracts.protocol import RankExit, RanksStarted, RanksStopped, RankInfo, \
    RegisterRequest, WorkerEvent
from orchestrator.contracts.state import Cause, JobState, NodeState
from orchestrator.supervisor.chaos import ChaosDesk
from orchestrator.supervisor.generation.parts import TICK_S, GenerationParts
from orchestrator.supervisor.generation.judge import Observation
from orchestrator.supervisor.intake import Intake
from orchestrator.supervisor.nodes import NODE_MOVES, IllegalNodeMove, NodeRegistry
from orchestrator.supervisor.stability import StabilityHook
from orchestrator.supervisor.superseded import SupersededNodes


class Parts:
    """A supervisor's collaborators around a real journal, on a fake clock."""

    def __init__(self, root: Path, nodes: int = 2, ppn: int = 1,
                 chaos: dict[str, Any] | None = None) -> None:
        self.cfg = Config.model_validate({
            "job": {"name": "t"}, "cluster": {"nodes": nodes, "procs_per_node": ppn},
            "timeouts": {"node_lost_s": 10.0, "stop_grace_s": 3.0}, "chaos": chaos or {}})
        self.clock = FakeClock()
        self.log = FakeLog()
        self.ctx = make_context(root, self.cfg, self.clock, self.log)
        self.nodes = NodeRegistry(self.clock, self.ctx.record)
        self.stability = StabilityHook(self.ctx)
        self.chaos = ChaosDesk(self.ctx, self.nodes)
        self.superseded = SupersededNodes(self.ctx, self.nodes)
        self.intake = Intake(self.ctx, self.nodes, self.stability, lambda *a: None,
                             note_superseded=self.superseded.note,
                             chaos_fired=self.chaos.mark_fired)
        self.stop = asyncio.Event()
        self.moves: list[JobState] = []
        self.parts = GenerationParts(self.ctx, self.nodes, self.intake.feed(), self.stability,
                                     self.stop, self.moves.append, chaos=self.chaos,
                                     superseded=self.superseded)
        for i in range(nodes):
            node, _ = self.nodes.register(RegisterRequest(
                node_id=f"n{i}", host="h", addr="127.0.0.1", procs=ppn, agent_pid=100 + i,
                free_port=20000 + i))
            self.nodes.move(node, NodeState.ACTIVE, node_rank=i)

    def events(self, kind: str) -> list[dict[str, Any]]:
        self.ctx.recorder.journal.flush()
        return [e for e in read_events(self.ctx.rundir.journal) if e["kind"] == kind]


@pytest.fixture
def p(tmp_path: Path) -> Parts:
    return Parts(tmp_path)


# -- the node state machine ----------------------------------------------------------------
def test_every_node_move_is_checked_and_journaled(p: Parts) -> None:
    node = p.nodes.nodes["n0"]
    p.nodes.move(node, NodeState.LOST, reason="test")
    with pytest.raises(IllegalNodeMove):
        p.nodes.move(node, NodeState.SPARE)  # a lost node must come back first
    assert node.state is NodeState.LOST
    moves = [(e["node_id"], e["previous"], e["state"]) for e in p.events("node_state")]
    assert moves[-1] == ("n0", "active", "lost")
    assert ("n0", "registered", "active") in moves


def test_the_table_lets_every_state_leave_and_exited_only_come_back() -> None:
    for state, targets in NODE_MOVES.items():
        assert targets, state
    assert NODE_MOVES[NodeState.EXITED] == {NodeState.REGISTERED}
    assert NodeState.ACTIVE not in NODE_MOVES[NodeState.LOST]


def test_silence_makes_a_node_lost_exactly_past_its_limit(p: Parts) -> None:
    p.clock.advance(10.0)
    assert p.nodes.mark_silent_lost(10.0) == []  # at the limit: not yet
    p.clock.advance(0.01)
    lost = p.nodes.mark_silent_lost(10.0)
    assert sorted(n.node_id for n in lost) == ["n0", "n1"]


def test_a_lost_node_that_beats_again_is_registered_again(p: Parts) -> None:
    node = p.nodes.nodes["n1"]
    p.nodes.move(node, NodeState.LOST, reason="silent")
    p.nodes.heartbeat("n1", None, None, [])
    assert node.state is NodeState.REGISTERED
    assert p.events("node_state")[-1]["reason"] == "heartbeat after being lost"


# -- judging a generation ------------------------------------------------------------------
def started(node: str, rank: int) -> Observation:
    return Observation("started", node, RanksStarted(
        generation=1, ranks=[RankInfo(rank=rank, local_rank=0, pid=10 + rank)], ts=1.0))


def exited(node: str, rank: int, code: int | None = 0, signal: str | None = None,
           ts: float = 1.0) -> Observation:
    return Observation("exits", node, [RankExit(generation=1, rank=rank, exit_code=code,
                                                signal=signal, ts=ts, log_tail=["last"])])


def test_clean_exits_of_every_rank_complete_the_generation(p: Parts) -> None:
    gen = p.parts.begin(1, 2)
    for obs in (started("n0", 0), started("n1", 1), exited("n0", 0)):
        assert gen.judge([obs]) is None
    outcome = gen.judge([exited("n1", 1)])
    assert outcome is not None and outcome.cause is Cause.COMPLETED


def test_exits_of_ranks_outside_the_world_change_nothing(p: Parts) -> None:
    gen = p.parts.begin(1, 2)
    for rank in (1000, 1001):
        assert gen.judge([exited("n0", rank)]) is None
    assert gen.exits == {}


def test_the_earliest_failing_rank_is_the_root_cause(p: Parts) -> None:
    gen = p.parts.begin(1, 2)
    first = gen.judge([exited("n1", 1, code=None, signal="SIGKILL", ts=5.0)])
    assert first is not None and first.cause is Cause.WORKER_EXIT
    gen.judge([exited("n0", 0, code=1, ts=5.5)])  # its peer, a moment later
    failure = gen.root_cause(Cause.WORKER_EXIT, first.detail)
    assert (failure["rank"], failure["node_id"], failure["signal"]) == (1, "n1", "SIGKILL")
    assert failure["other_exits"] == [{"rank": 0, "exit_code": 1, "signal": None}]
    ev.Failure(**failure)  # and it is a valid journal event


@pytest.mark.parametrize("data", [{}, {"step": "abc"}, {"step": -1},
                                  {"step": 3, "blocking_s": float("nan")},
                                  {"step": 3, "path": "x" * 10_000}])
def test_a_worker_event_that_does_not_fit_its_type_is_rejected_not_journaled(
        p: Parts, data: dict[str, Any]) -> None:
    gen = p.parts.begin(1, 2)
    # model_construct: the API refuses these data at parse time (tests/unit/orchestrator/
    # test_protocol.py); here they reach intake anyway, to test its own second line.
    gen.judge([Observation("worker", "n0", WorkerEvent.model_construct(
        type="worker", generation=1, rank=0, name="checkpoint_committed", data=data,
        ts=1.0))])
    assert p.events("checkpoint_committed") == []
    assert p.events("message_rejected")[-1]["node_id"] == "n0"
    assert p.ctx.view.newest_checkpoint_step is None


def test_worker_event_data_cannot_speak_for_another_rank_or_the_envelope(p: Parts) -> None:
    gen = p.parts.begin(1, 2)
    gen.judge([Observation("worker", "n0", WorkerEvent.model_construct(
        type="worker", generation=1, rank=0, name="checkpoint_committed", ts=1.0,
        data={"step": 7, "generation": 99, "rank": 5, "seq": 1, "kind": "transition",
              "node_id": "n1"}))])
    (committed,) = p.events("checkpoint_committed")
    assert (committed["generation"], committed["rank"], committed["step"]) == (1, 0, 7)
    assert committed["seq"] > 1


# -- the stop deadline ---------------------------------------------------------------------
def test_a_node_that_never_confirms_the_stop_is_lost_at_the_deadline(p: Parts) -> None:
    async def scenario() -> float:
        start = p.clock.monotonic()
        # n0 confirms at once; n1 never does.
        p.intake.queue.put_nowait(Observation("stopped", "n0", RanksStopped(
            generation=1, ts=1.0)))
        await p.parts.stop(1)
        return p.clock.monotonic() - start

    waited = asyncio.run(scenario())
    deadline = p.cfg.timeouts.stop_grace_s + 5.0 + 0.005 * 2  # 5 ms per node waited on
    assert deadline <= waited <= deadline + TICK_S
    assert p.nodes.nodes["n0"].state is NodeState.ACTIVE
    assert p.nodes.nodes["n1"].state is NodeState.LOST
    assert p.events("node_state")[-1]["reason"].startswith("did not confirm the stop in time")


def test_launch_waits_for_every_rank_then_moves_to_running(p: Parts) -> None:
    async def scenario() -> Any:
        p.parts.begin(1, 2)
        p.ctx.recorder.view.state = JobState.LAUNCHING
        for obs in (started("n0", 0), started("n1", 1), exited("n0", 0, code=3)):
            p.intake.queue.put_nowait(obs)
        return await p.parts.observe(1)

    outcome = asyncio.run(scenario())
    assert p.moves == [JobState.RUNNING]
    assert outcome.cause is Cause.WORKER_EXIT and outcome.detail["exit_code"] == 3


def test_ranks_that_never_start_fail_the_launch_at_its_deadline(p: Parts) -> None:
    async def scenario() -> Any:
        p.parts.begin(1, 2)
        p.ctx.recorder.view.state = JobState.LAUNCHING
        p.intake.queue.put_nowait(started("n0", 0))
        start = p.clock.monotonic()
        outcome = await p.parts.observe(1)
        return outcome, p.clock.monotonic() - start

    outcome, waited = asyncio.run(scenario())
    assert outcome.cause is Cause.WORKER_EXIT and "did not start" in outcome.detail["message"]
    assert p.cfg.timeouts.launch_s < waited <= p.cfg.timeouts.launch_s + 2 * TICK_S
    assert p.moves == []


@pytest.mark.parametrize("loop", ["observe", "stop"])
def test_a_launchs_or_stops_backlog_is_judged_a_few_dozen_at_a_time(
        tmp_path: Path, loop: str) -> None:
    """Every node of a launch answers ``ranks_started`` and every node of a stop
    ``ranks_stopped`` while the assignments go out, so hundreds of observations are queued
    when the observe or stop loop next looks. Each is a journal record, a fold and a metric:
    taken in one go, they held the loop while the heartbeats waited. Between two turns of
    the loop (a beat's chance to be read) at most a few dozen are judged, and all are."""
    n = 300
    p = Parts(tmp_path, nodes=n)
    judged: list[int] = []  # observations judged since the watcher's last turn
    since_turn = [0]
    gen = p.parts.begin(1, n)
    judge = gen.judge

    def counting(batch: list[Observation]) -> Any:
        since_turn[0] += len(batch)
        judged.append(len(batch))
        return judge(batch)

    gen.judge = counting  # type: ignore[method-assign]
    per_turn: list[int] = []

    async def watcher() -> None:
        while sum(judged) < n:
            per_turn.append(since_turn[0])
            since_turn[0] = 0
            await asyncio.sleep(0)
        p.stop.set()

    async def scenario() -> None:
        for i in range(n):
            p.intake.queue.put_nowait(
                started(f"n{i}", i) if loop == "observe" else
                Observation("stopped", f"n{i}", RanksStopped(generation=1, ts=1.0)))
        watch = asyncio.create_task(watcher())
        await asyncio.sleep(0)
        if loop == "observe":
            await p.parts.observe(1)
        else:
            await p.parts.stop(1)
        await watch

    asyncio.run(scenario())
    assert sum(judged) == n
    assert max(per_turn + [since_turn[0]]) <= 64, per_turn
    if loop == "observe":
        assert gen.all_started()
        assert len(p.events("ranks_started")) == n
    else:
        assert all(node.state is NodeState.ACTIVE for node in p.nodes.nodes.values())
        assert len(p.events("ranks_stopped")) == n


def test_a_stop_confirmed_on_arrival_still_journals_every_nodes_exits(tmp_path: Path) -> None:
    """Confirmations mark their node as they arrive, so a stop can be over while its
    nodes' ``ranks_stopped`` and exits are still queued: they are journaled (a few dozen
    per turn) before the stop returns, not left to the next generation as stragglers."""
    n = 200
    p = Parts(tmp_path, nodes=n)

    async def scenario() -> None:
        p.parts.begin(1, n)
        for i in range(n):
            p.nodes.nodes[f"n{i}"].stopped_generation = 1  # as Intake.on_events marks it
            p.intake.queue.put_nowait(
                Observation("stopped", f"n{i}", RanksStopped(generation=1, ts=1.0)))
            p.intake.queue.put_nowait(exited(f"n{i}", i, code=None, signal="SIGTERM"))
        await p.parts.stop(1)

    asyncio.run(scenario())
    assert p.intake.queue.empty()
    assert len(p.events("ranks_stopped")) == n
    assert len(p.events("rank_exited")) + sum(
        len(e["exits"]) for e in p.events("ranks_exited")) == n


def test_interval_kills_count_from_running_and_are_journaled_before_they_are_sent(
        tmp_path: Path) -> None:
    """The chaos desk's interval kills: none before the launch is seen RUNNING, the first
    one interval after that, journaled naming the rank's node, then ordered to its agent."""
    p = Parts(tmp_path, nodes=2, ppn=2, chaos={"kill_interval_s": 10.0})
    p.parts.begin(1, 4)
    p.ctx.recorder.view.state = JobState.LAUNCHING
    asyncio.run(p.chaos.tick(1))
    p.clock.t += 30.0  # launching time does not count
    p.ctx.recorder.view.state = JobState.RUNNING
    asyncio.run(p.chaos.tick(1))
    p.clock.t += 9.9
    asyncio.run(p.chaos.tick(1))
    assert p.events("chaos") == []
    p.clock.t += 0.2
    asyncio.run(p.chaos.tick(1))
    [kill] = p.events("chaos")
    assert kill["id"] == "interval-1" and kill["generation"] == 1
    assert kill["node_id"] == f"n{kill['rank'] // 2}"
    orders = p.nodes.nodes[kill["node_id"]].assignment.signals
    assert [(o.rank, o.signal) for o in orders] == [(kill["rank"], "SIGKILL")]
