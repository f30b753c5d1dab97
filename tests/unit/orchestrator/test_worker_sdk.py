"""The worker SDK: progress bookkeeping, phases, and beats over a real unix socket."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.agent.local_socket import LocalHub, LocalSocketServer
from orchestrator.contracts.pace import StepPace
from orchestrator.worker.sdk import Worker, WorkerContext


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _measuring_from_the_start(w: Worker, monkeypatch: pytest.MonkeyPatch) -> Worker:
    """``w`` measuring every interval (no warm-up), so a test sees each one."""
    monkeypatch.setattr(w, "_pace", StepPace(warmup=0))
    return w


def test_checkpoint_time_is_not_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    w = _measuring_from_the_start(Worker(env={"RANK": "0"}, clock=clock), monkeypatch)
    w.step_done(1)
    clock.t = 1.0
    w.step_done(2)
    with w.phase("checkpointing"):
        clock.t = 21.0  # a 20 s blocking save
    clock.t = 22.0
    w.step_done(3)
    assert w._pace.intervals() == [1.0, 1.0]


def test_steps_disturbed_by_background_work_run_in_loading_and_do_not_calibrate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Page-locking buffers beside training (a restarted generation's staging) slowed a
    step to seconds, and that step set the calibrated hang timeout."""
    clock = Clock()
    w = _measuring_from_the_start(Worker(env={"RANK": "0"}, clock=clock), monkeypatch)
    busy = [True]
    w.step_done(1)
    clock.t = 0.2
    w.step_done(2)  # 0.2: measured
    w.disturbed_while(lambda: busy[0])
    for t in (4.2, 4.4):  # a 4 s step, then a fast one, both while the work runs
        clock.t = t
        w.step_done(int(t * 10))
        assert w._phase == "loading"  # the loading timeout judges them
    busy[0] = False
    w._beat()  # the beat thread sees the work done: back to training
    assert w._phase == "training"
    clock.t = 5.0
    w.step_done(50)  # straddles the end of the work: not measured either
    clock.t = 5.2
    w.step_done(52)
    assert w._pace.intervals() == pytest.approx([0.2, 0.2])
    assert w._phase == "training"
    with w.phase("checkpointing"):  # an explicit phase is not undone by the beat thread
        w._beat()
        assert w._phase == "checkpointing"


def test_only_rank_zero_sends_step_records() -> None:
    assert Worker(env={"RANK": "0"})._send_records
    assert not Worker(env={"RANK": "3"})._send_records


def test_context_from_environment() -> None:
    ctx = WorkerContext.from_env({
        "RANK": "1", "WORLD_SIZE": "4", "ORCH_GENERATION": "3", "ORCH_RESUME_MAX_STEP": "0",
        "ORCH_SKIP_WINDOWS": "[[4, 9]]", "ORCH_LR_SCALE": "0.5", "ORCH_AGENT_SOCKET": "/x"})
    assert (ctx.rank, ctx.world_size, ctx.generation) == (1, 4, 3)
    assert ctx.resume_max_step == 0 and ctx.skip_windows == [(4, 9)] and ctx.lr_scale == 0.5
    assert ctx.managed


def test_beats_and_events_reach_the_agent_socket() -> None:
    events: list[dict] = []

    async def scenario() -> LocalHub:
        hub = LocalHub(on_event=events.append)
        server = LocalSocketServer(hub)
        await server.start()
        w = Worker(env={"RANK": "0", "ORCH_AGENT_SOCKET": server.path,
                        "ORCH_HEARTBEAT_INTERVAL": "0.05", "ORCH_GENERATION": "2"})
        await asyncio.to_thread(w.start)
        w.step_done(1, loss=2.5)
        w.step_done(2, loss=2.4)
        w.event("checkpoint_committed", step=2)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (0 not in hub.beats or hub.beats[0].step != 2
                                               or not events):
            await asyncio.sleep(0.05)
        await asyncio.to_thread(w.close)
        await server.close()
        return hub

    hub = asyncio.run(scenario())
    beat = hub.beats[0]
    # close() sent the last beat: past its last step, the rank is finishing, not training.
    assert beat.step == 2 and beat.generation == 2
    assert beat.phase == "finishing" and beat.finished
    generation, records = hub.take_records(1000)
    assert generation == 2 and [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == 2.5
    assert events and events[0]["name"] == "checkpoint_committed"


def test_an_acknowledged_event_is_queued_by_the_agent_before_the_call_returns() -> None:
    """A rank's last words (a chaos kill's ``chaos`` event) must reach the supervisor before
    its exit, which the agent reports as soon as the process is exiting: the call returns
    True only once the agent's handler has the event, behind whatever the rank's beat
    connection still holds unread."""
    events: list[dict] = []
    held_at_return: list[int] = []

    async def scenario() -> None:
        hub = LocalHub(on_event=events.append)
        server = LocalSocketServer(hub)
        await server.start()
        w = Worker(env={"RANK": "1", "ORCH_AGENT_SOCKET": server.path,
                        "ORCH_GENERATION": "3"})

        def last_words() -> bool:
            ok = w.event_acknowledged("chaos", id="kill-1", step=7)
            held_at_return.append(len(events))
            return ok

        assert await asyncio.to_thread(last_words)
        # Unmanaged (no agent socket), and an agent that never answers: False, bounded.
        assert not Worker(env={"RANK": "1"}).event_acknowledged("chaos", id="kill-1")
        await server.close()

    asyncio.run(scenario())
    assert held_at_return == [1]
    assert events[0]["name"] == "chaos" and events[0]["rank"] == 1
    assert events[0]["generation"] == 3 and events[0]["data"] == {"id": "kill-1", "step": 7}


def test_an_agent_that_does_not_answer_acks_costs_a_bounded_wait(tmp_path, monkeypatch) -> None:
    import socket

    from orchestrator.worker import sdk

    monkeypatch.setattr(sdk, "_ACK_TIMEOUT_S", 0.3)
    path = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(path)
        mute.listen(1)  # accepts the connection, never reads, never answers
        start = time.monotonic()
        assert not Worker(env={"RANK": "0", "ORCH_AGENT_SOCKET": path}).event_acknowledged(
            "chaos", id="kill-0")
        assert time.monotonic() - start < 5.0
