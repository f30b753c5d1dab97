"""Node loss and hangs judged on the supervisor's service clock (``deadlines.LoopLag``):
time the supervisor's own loop was late does not count against a node's silence or a rank's
progress; every other second does; a lost node that beats again is taken back. The fuzz test plays random scripts of
beats, quiet time and supervisor stalls against a plain model of the rule."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fakes import FakeClock, FakeLog, begin_generation, make_context, make_intake
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.clock import SYSTEM_CLOCK
from orchestrator.config import Config
from orchestrator.contracts.events import NodeStateChanged
from orchestrator.contracts.protocol import RankInfo, RegisterRequest
from orchestrator.contracts.state import Cause, JobState, NodeState
from orchestrator.supervisor.deadlines import LoopLag, ServiceClock
from orchestrator.supervisor.generation.hangs import TrainingTimeout, find_hangs
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.generation.progress import ProgressTracker

LIMIT = 10.0
CASES = {"script": 0}


def _register(reg: NodeRegistry, node: str) -> None:
    reg.register(RegisterRequest(node_id=node, host="h", addr="10.0.0.1", procs=8,
                                 agent_pid=7, free_port=20000))


def test_lateness_beyond_the_tolerance_is_summed_and_left_out_of_service_time() -> None:
    clock = FakeClock()
    heard: list[float] = []
    lag = LoopLag(clock, tolerance_s=0.02, on_late=heard.append)
    lag.note(0.01)  # within the tolerance: no lateness
    assert lag.late_s == 0.0 and lag.service_time() == clock.monotonic()
    clock.advance(3.0)
    lag.note(3.0)
    clock.advance(1.0)
    lag.note(0.5)
    assert heard == [3.0, 0.5] and lag.late_s == 3.5 and lag.worst_s == 3.0
    assert lag.service_time() == clock.monotonic() - 3.5


def test_a_node_silent_while_the_supervisor_stalled_is_not_lost_and_the_reason_says_so(
) -> None:
    clock = FakeClock()
    lag = LoopLag(clock)
    events: list[object] = []
    reg = NodeRegistry(clock, events.append, lag=lag)
    for n in ("a", "b"):
        _register(reg, n)
    clock.advance(6.0)
    reg.heartbeat("b", None, None, [])
    clock.advance(6.0)  # the supervisor stalled 6 s: nobody's beat was read
    lag.note(6.0)
    assert reg.mark_silent_lost(LIMIT) == []  # a: 12 s silent, 6 of them ours
    clock.advance(4.5)
    (lost,) = reg.mark_silent_lost(LIMIT)  # a: 10.5 s of our attention; b: 4.5 s
    assert lost.node_id == "a" and lost.state is NodeState.LOST
    moved = [e for e in events if isinstance(e, NodeStateChanged)][-1]
    assert "silent for 16.5 s" in (moved.reason or "")
    assert "extended by 6.0 s" in (moved.reason or "")
    reg.heartbeat("a", None, None, [])  # it was slow, not dead
    assert reg.nodes["a"].state is NodeState.REGISTERED
    back = [e for e in events if isinstance(e, NodeStateChanged)][-1]
    assert back.previous is NodeState.LOST and back.state is NodeState.REGISTERED


steps = st.lists(st.tuples(st.sampled_from(["quiet", "stall", "beat", "check"]),
                           st.integers(0, 5), st.floats(0.05, 6.0)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_loss_follows_the_silence_the_supervisor_attended(
        script: list[tuple[str, int, float]]) -> None:
    """A node is lost at a check exactly when, since its last beat, more than ``LIMIT``
    seconds passed while the supervisor kept up (six nodes: never a mass silence)."""
    CASES["script"] += 1
    clock = FakeClock()
    lag = LoopLag(clock)
    reg = NodeRegistry(clock, lambda e: None, lag=lag)
    attended: dict[str, float] = {}
    for i in range(6):
        _register(reg, f"n{i}")
        attended[f"n{i}"] = 0.0
    for op, who, dt in script:
        node = f"n{who}"
        if op == "quiet":
            clock.advance(dt)
            for k in attended:
                attended[k] += dt
        elif op == "stall":
            clock.advance(dt)
            lag.note(dt)  # as the lag task would on waking dt late
        elif op == "beat":
            reg.heartbeat(node, None, None, [])
            attended[node] = 0.0
            assert reg.nodes[node].state is NodeState.REGISTERED  # back if it was lost
        else:
            was_live = {k for k, n in reg.nodes.items() if n.state is NodeState.REGISTERED}
            lost = {n.node_id for n in reg.mark_silent_lost(LIMIT)}
            expected = {k for k in was_live if attended[k] > LIMIT + 1e-6}
            either = {k for k in was_live if abs(attended[k] - LIMIT) <= 1e-6}  # float ties
            assert expected <= lost <= expected | either, (lost, expected, attended)


def test_fuzz_case_count() -> None:
    assert CASES["script"] >= 100, CASES


def test_the_lag_task_measures_a_loop_blocked_by_a_handler() -> None:
    """On the real clock: a callback that holds the loop makes the task wake late by at
    least about as long (never less: a slow machine only adds lateness)."""

    async def main() -> LoopLag:
        lag = LoopLag(SYSTEM_CLOCK, period_s=0.05)
        task = asyncio.create_task(lag.run())
        await asyncio.sleep(0.1)
        time.sleep(0.5)  # noqa: ASYNC251 (a long handler holding the loop, on purpose)
        await asyncio.sleep(0.2)
        task.cancel()
        return lag

    lag = asyncio.run(main())
    assert lag.late_s >= 0.4 and lag.worst_s >= 0.4 and lag.wakeups >= 2



def test_a_rank_is_not_called_hung_for_the_seconds_the_supervisor_was_late() -> None:
    clock = FakeClock()
    lag = LoopLag(clock)
    judge = ServiceClock(clock, lag)
    cfg = Config.model_validate({"timeouts": {"training_floor_s": 10.0}})
    tracker = ProgressTracker(Path("/dev/null"), judge, lambda e: None)  # type: ignore
    tracker.start_generation(1, 1)
    tracker.on_ranks(1, [RankInfo(rank=0, local_rank=0, step=3, phase="training",
                                  beat_ts=clock.time(), step_interval_max=0.5)])
    training = TrainingTimeout(cfg.timeouts, None)
    gen = tracker.current
    assert gen is not None
    clock.advance(15.0)
    lag.note(15.0)  # the supervisor's loop was held the whole time
    assert not find_hangs(gen, cfg.timeouts, training, judge.monotonic())
    clock.advance(10.5)  # ten and a half seconds it kept up, and no step
    (suspect,) = find_hangs(gen, cfg.timeouts, training, judge.monotonic())
    assert suspect.rank == 0 and 10.0 < suspect.idle_s < 11.0


def test_ranks_of_a_silent_node_are_left_to_the_node_loss_check(tmp_path: Path) -> None:
    """A rank quiet because its whole node is quiet is no hang (node loss judges it, with
    its grace for many silent nodes); a rank quiet while its node beats on is."""
    cfg = Config.model_validate({"job": {"name": "t"},
                                 "cluster": {"nodes": 2, "procs_per_node": 2},
                                 "timeouts": {"training_floor_s": 10.0, "node_lost_s": 60.0,
                                              "heartbeat_interval_s": 1.0}})
    clock = FakeClock()
    ctx = make_context(tmp_path, cfg, clock, FakeLog())
    lag = LoopLag(clock)
    nodes = NodeRegistry(clock, ctx.record, lag=lag)
    intake = make_intake(ctx, nodes)
    for i, n in enumerate(("n0", "n1")):
        _register(nodes, n)
        nodes.move(nodes.nodes[n], NodeState.ACTIVE, node_rank=i)
    ctx.recorder.view.launches.append({"generation": 1, "nodes": {"n0": 0, "n1": 1}})
    ctx.recorder.view.state = JobState.RUNNING
    gen = begin_generation(intake, 1, 4)

    def beat(node: str, ranks: range, step: int) -> None:
        infos = [RankInfo(rank=r, local_rank=r % 2, step=step, phase="training",
                          beat_ts=clock.time(), step_interval_max=0.5) for r in ranks]
        nodes.heartbeat(node, 1, None, infos)
        intake.progress.on_ranks(1, infos)

    beat("n0", range(2), 1)
    beat("n1", range(2, 4), 1)
    for t in range(12):  # n0 beats on, its ranks advancing; n1 falls silent
        clock.advance(1.0)
        beat("n0", range(2), 2 + t)
    assert gen.judge([]) is None  # n1's ranks: its node's silence, not a hang
    clock.advance(1.0)
    infos = [RankInfo(rank=r, local_rank=r % 2, step=3, phase="training",
                      beat_ts=clock.time(), step_interval_max=0.5) for r in range(2, 4)]
    nodes.heartbeat("n1", 1, None, infos)  # n1 beats again, its ranks stuck at step 3 ...
    intake.progress.on_ranks(1, infos)
    for _ in range(11):
        clock.advance(1.0)
        beat("n0", range(2), 20)
        beat("n1", range(2, 4), 3)
    outcome = gen.judge([])  # ... for 11 s while beating: a hang
    assert outcome is not None and outcome.cause is Cause.HANG
    assert outcome.detail["rank"] in (2, 3) and outcome.detail["node_id"] == "n1"


def test_no_peer_is_named_while_the_stopped_ranks_node_is_late_to_beat(tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP) and its agent's beats are late on a loaded host; rank 0
    waits for it in a collective, its node beating on. Nothing is named while rank 1's node
    is quiet (a CI run named rank 0, the blocked peer); once that node beats, rank 1 is."""
    cfg = Config.model_validate({"job": {"name": "t"},
                                 "cluster": {"nodes": 2, "procs_per_node": 1},
                                 "timeouts": {"training_floor_s": 2.0, "node_lost_s": 60.0,
                                              "heartbeat_interval_s": 1.0}})
    clock = FakeClock()
    ctx = make_context(tmp_path, cfg, clock, FakeLog())
    nodes = NodeRegistry(clock, ctx.record, lag=LoopLag(clock))
    intake = make_intake(ctx, nodes)
    for i, n in enumerate(("n0", "n1")):
        _register(nodes, n)
        nodes.move(nodes.nodes[n], NodeState.ACTIVE, node_rank=i)
    ctx.recorder.view.launches.append({"generation": 1, "nodes": {"n0": 0, "n1": 1}})
    ctx.recorder.view.state = JobState.RUNNING
    gen = begin_generation(intake, 1, 2)

    def beat(node: str, rank: int, beat_ts: float) -> None:
        infos = [RankInfo(rank=rank, local_rank=0, step=5, phase="training", beat_ts=beat_ts,
                          step_interval_max=0.5)]
        nodes.heartbeat(node, 1, None, infos)
        intake.progress.on_ranks(1, infos)

    stopped_at = clock.time()
    beat("n0", 0, clock.time())
    beat("n1", 1, stopped_at)
    for _ in range(4):  # rank 0 blocked at step 5, beating; n1's agent silent for 4 s
        clock.advance(1.0)
        beat("n0", 0, clock.time())
    assert gen.judge([]) is None
    clock.advance(0.5)
    beat("n1", 1, stopped_at)  # the agent's late beat: rank 1 has not beaten since its stop
    outcome = gen.judge([])
    assert outcome is not None and outcome.cause is Cause.HANG
    assert outcome.detail["rank"] == 1 and outcome.detail["node_id"] == "n1"
