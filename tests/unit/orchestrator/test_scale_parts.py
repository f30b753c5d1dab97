"""The parts that let one supervisor carry 2,048 nodes x 8 ranks, on the fake clock: the
oldest-first index against a plain scan (hypothesis), the hang pre-check against
``find_hangs``, idempotent registration, a node's exits as one event (and the books' fold
of it), and one assignment change per node for a stack dump."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fakes import FakeClock, FakeLog, begin_generation, make_context, make_intake
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts import events as ev
from orchestrator.journal.books import Books
from orchestrator.config import Config
from orchestrator.journal.store import read_events, read_journal
from orchestrator.contracts.protocol import EventBatch, RankExit, RankInfo, RegisterRequest
from orchestrator.contracts.state import Cause, NodeState
from orchestrator.supervisor.deadlines import OldestFirst
from orchestrator.supervisor.generation.hangs import TrainingTimeout, any_overdue, find_hangs
from orchestrator.supervisor.intake import Intake
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.generation.progress import ProgressTracker

CASES = {"oldest": 0, "hangs": 0}

ops = st.lists(st.tuples(st.sampled_from(["set", "discard", "oldest"]),
                         st.integers(0, 20), st.floats(0, 100, allow_nan=False)),
               max_size=300)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_oldest_first_agrees_with_a_scan(script: list[tuple[str, int, float]]) -> None:
    CASES["oldest"] += 1
    index: OldestFirst[int] = OldestFirst()
    truth: dict[int, float] = {}
    for op, key, at in script:
        if op == "set":
            index.set(key, at)
            truth[key] = at
        elif op == "discard":
            index.discard(key)
            truth.pop(key, None)
        got = index.oldest()
        if not truth:
            assert got is None
        else:
            assert got is not None and got[1] == min(truth.values())
            assert truth[got[0]] == got[1]
        assert len(index) == len(truth)


phases = st.sampled_from([None, "init", "training", "checkpointing"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 5), phases,
                          st.floats(0, 30, allow_nan=False)), max_size=120),
       st.floats(0, 60, allow_nan=False))
def test_the_hang_precheck_agrees_with_the_full_scan(
        beats: list[tuple[int, int, str | None, float]], wait: float) -> None:
    """``any_overdue`` (oldest rank per phase) says yes whenever ``find_hangs`` (every
    rank) finds a suspect: it never hides a hang. It may say yes for a rank that the scan
    then spares (a rank in its warm-up steps has a longer limit than its phase's)."""
    CASES["hangs"] += 1
    cfg = Config.model_validate({"timeouts": {"training_floor_s": 10.0,
                                              "phases": {"init": 20.0, "checkpointing": 40.0}}})
    clock = FakeClock()
    tracker = ProgressTracker(Path("/dev/null"), clock, lambda e: None)  # type: ignore
    tracker.start_generation(1, 16)
    for rank, step, phase, dt in beats:
        clock.advance(dt / 10)
        tracker.on_ranks(1, [RankInfo(rank=rank, local_rank=0, step=step, phase=phase,
                                      beat_ts=clock.time(), step_interval_max=0.5)])
    clock.advance(wait)
    gen = tracker.current
    assert gen is not None
    training = TrainingTimeout(cfg.timeouts, None)
    now = clock.monotonic()
    suspects = find_hangs(gen, cfg.timeouts, training, now)
    assert any_overdue(gen, cfg.timeouts, training, now) or not suspects, suspects


def test_fuzz_case_counts() -> None:
    """Runs after the two above (file order): they tried what they claim."""
    assert CASES["oldest"] >= 100 and CASES["hangs"] >= 100, CASES


def _intake(root: Path, nodes: int = 2, ppn: int = 8) -> tuple[Intake, NodeRegistry, object]:
    cfg = Config.model_validate({"job": {"name": "t"},
                                 "cluster": {"nodes": nodes, "procs_per_node": ppn}})
    ctx = make_context(root, cfg, FakeClock(), FakeLog())
    registry = NodeRegistry(ctx.clock, ctx.record)
    return make_intake(ctx, registry), registry, ctx


def _request(node: str, pid: int = 7) -> RegisterRequest:
    return RegisterRequest(node_id=node, host="h", addr="10.0.0.1", procs=8, agent_pid=pid,
                           free_port=20000)


def _kinds(ctx: object, kind: str) -> list[dict]:
    ctx.recorder.journal.flush()  # type: ignore[attr-defined]
    return [e for e in read_events(ctx.rundir.journal) if e["kind"] == kind]  # type: ignore


def test_a_registration_retry_is_no_new_event(tmp_path: Path) -> None:
    intake, registry, ctx = _intake(tmp_path)
    for _ in range(3):
        intake.on_register(_request("n0"))
    assert len(_kinds(ctx, "node_registered")) == 1
    intake.on_register(_request("n0", pid=8))  # a new agent process: news
    assert len(_kinds(ctx, "node_registered")) == 2
    registry.move(registry.nodes["n0"], NodeState.LOST, reason="t")
    intake.on_register(_request("n0", pid=8))  # back from LOST: news
    assert len(_kinds(ctx, "node_registered")) == 3
    assert registry.counts()["registered"] == 1 and registry.counts()["lost"] == 0


def test_a_nodes_exits_are_one_event_and_the_books_fold_it(tmp_path: Path) -> None:
    intake, _, ctx = _intake(tmp_path)
    intake.on_register(_request("n0"))
    gen = begin_generation(intake, 1, 16)
    exits = [RankExit(generation=1, rank=r, exit_code=None, signal="SIGTERM", ts=5.0 + r)
             for r in range(8)]
    exits[3] = RankExit(generation=1, rank=3, exit_code=1, ts=4.0, log_tail=["boom"])
    intake.on_events(EventBatch(node_id="n0", events=exits))
    assert intake.queue.qsize() == 1
    outcome = gen.judge([intake.queue.get_nowait()])
    assert outcome is not None and outcome.cause is Cause.WORKER_EXIT
    (event,) = _kinds(ctx, "ranks_exited")
    assert [x["rank"] for x in event["exits"]] == list(range(8))
    failure = gen.root_cause(Cause.WORKER_EXIT, outcome.detail)
    assert failure["rank"] == 3 and len(failure["other_exits"]) == 7
    envs = list(read_journal(ctx.rundir.journal))  # type: ignore[attr-defined]
    assert any(isinstance(e.event, ev.RanksExited) for e in envs)


def test_the_books_fold_a_nodes_exits_as_they_fold_one_ranks() -> None:
    def failed_at(exit_event: dict) -> float | None:
        books = Books()
        for i, e in enumerate([{"kind": "generation_launched", "generation": 1},
                               exit_event]):
            books.apply({"seq": i + 1, "ts": 100.0 + i, **e})
        return books.gens[1].exit_ts

    single = failed_at({"kind": "rank_exited", "generation": 1, "rank": 3, "exit_code": 1,
                        "exit_ts": 50.0})
    grouped = failed_at({"kind": "ranks_exited", "generation": 1, "node_id": "n0", "exits": [
        {"rank": 4, "exit_code": 0, "exit_ts": 40.0},  # a clean exit is no failure
        {"rank": 3, "exit_code": 1, "exit_ts": 50.0},
        {"rank": 5, "signal": "SIGKILL", "exit_ts": 55.0}]})
    assert single == grouped == 50.0


def test_a_stack_dump_is_one_assignment_change_per_node(tmp_path: Path) -> None:
    _, registry, _ = _intake(tmp_path)

    async def scenario() -> tuple[int, int]:
        registry.register(_request("n0"))
        before = registry.nodes["n0"].assignment.version
        await registry.send_signals("n0", [(r, "SIGUSR1") for r in range(8)]
                                    + [(r, "SIGCONT") for r in range(8)])
        a = registry.nodes["n0"].assignment
        return a.version - before, len(a.signals)

    changes, orders = asyncio.run(scenario())
    assert (changes, orders) == (1, 16)


def test_a_mass_silence_waits_longer_before_nodes_are_lost(tmp_path: Path) -> None:
    """Many nodes silent together (the supervisor's own backlog, most likely) get three
    times the limit; one or a few silent nodes are lost at the limit as before."""
    _, registry, ctx = _intake(tmp_path)
    clock = ctx.clock  # type: ignore[attr-defined]
    for i in range(40):
        registry.register(_request(f"n{i}"))
    clock.advance(10.5)
    for i in range(38):  # two stay silent: lost at the limit
        registry.heartbeat(f"n{i}", None, None, [])
    clock.advance(0.1)
    assert sorted(n.node_id for n in registry.mark_silent_lost(10.0)) == ["n38", "n39"]
    clock.advance(11.0)  # now the other 38 have been silent 11.1 s together
    assert registry.mark_silent_lost(10.0) == [] and registry.held_back == 1
    clock.advance(19.0)  # 30.1 s: past three times the limit
    assert len(registry.mark_silent_lost(10.0)) == 38


def test_a_stop_goes_out_in_bursts_each_once_the_last_ones_answers_are_in() -> None:
    """Each assignment brings its node's answers back: the long-poll's response in the
    loop's next turn, the node's events a few milliseconds later; the loop takes every
    answer that is in, 1 ms of work each (a busy turn ends late). A stop of 200 nodes must
    not issue its next burst while the last one's answers are still coming in: a beat
    waits behind one burst's answers at most. (Before: 64 assignments per turn with only
    ``sleep(0)`` between, so every turn also carried the previous bursts' events.)"""
    from orchestrator.supervisor import nodes as nodes_mod

    clock = FakeClock()
    reg = NodeRegistry(clock)
    for i in range(200):
        reg.register(_request(f"n{i:03d}"))
    pending: list[tuple[float, str]] = []  # (arrival, node) of answers not yet taken
    turns: list[int] = []  # answers taken per busy turn
    at_burst: list[int] = []  # answers due from earlier bursts when a burst starts

    async def loop_work() -> None:
        while True:
            ready = [a for a in pending if a[0] <= clock.monotonic()]
            for a in ready:
                pending.remove(a)
            if ready:
                turns.append(len(ready))
                clock.advance(0.001 * len(ready))
            await asyncio.sleep(0)

    async def stop() -> None:
        for i in range(200):
            if i % nodes_mod._ASSIGN_BURST == 0:
                at_burst.append(len(pending))
            now = clock.monotonic()  # the change wakes the poll before assign returns
            pending.extend([(now, "poll"), (now + 0.005, "events")])
            await reg.assign(f"n{i:03d}", action="stop", generation=1)

    async def main() -> None:
        work = asyncio.create_task(loop_work())
        await stop()
        work.cancel()

    asyncio.run(main())
    assert at_burst and all(n == 0 for n in at_burst), at_burst
    assert max(turns) <= 2 * nodes_mod._ASSIGN_BURST, turns


def test_a_beat_builds_no_phase_heap_for_a_phase_that_has_one(monkeypatch) -> None:
    """``GenerationProgress.progressed`` runs for every rank that steps, 16k times a second
    at 2,048 x 8: a phase's oldest-first heap is made once, when the phase first appears,
    not built and thrown away on every call (``dict.setdefault`` evaluates its default)."""
    from orchestrator.supervisor.generation import progress as progress_mod

    made: list[int] = []

    class Counted(OldestFirst[int]):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(progress_mod, "OldestFirst", Counted)
    gen = progress_mod.GenerationProgress(1)
    ranks = [progress_mod.RankProgress(r) for r in range(8)]
    for step in range(50):
        for rp in ranks:
            gen.progressed(rp, "train" if step else None, float(step))
    assert len(made) == 2  # the phases None and "train"
    assert gen.idle["train"].oldest() == (0, 49.0) and len(gen.idle[None]) == 0
