"""In-job recovery's pure parts: the recover order, the rank's wait for it, the supervisor's
choice of path. The processes: tests/integration/test_in_job.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeLog, make_context
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts import events as ev
from orchestrator.config import Config
from orchestrator.contracts.protocol import RankInfo, RegisterRequest
from orchestrator.contracts.state import Cause, NodeState
from orchestrator.supervisor import recovery
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.generation.progress import ProgressTracker
from orchestrator.worker.injob import BadRecoverOrder, InJob, RecoverOrder

ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511",
       "ORCH_GENERATION": "4"}


# -- the order ------------------------------------------------------------------------------
def test_an_order_round_trips_and_its_bounds_are_named() -> None:
    order = RecoverOrder(4, dict(ENV))
    assert RecoverOrder.parse(json.loads(json.dumps(order.line()))) == order
    bad = [({"t": "profile"}, "not a recover order"),
           ({**order.line(), "generation": 0}, "generation"),
           ({**order.line(), "generation": True}, "generation"),
           ({**order.line(), "env": ["RANK=1"]}, "env must be an object"),
           ({**order.line(), "env": {**ENV, "1BAD": "x"}}, "not a variable name"),
           ({**order.line(), "env": {**ENV, "X": 5}}, "X is not a string"),
           ({**order.line(), "env": {**ENV, "X": "a\x00b"}}, "without NUL"),
           ({**order.line(), "env": {k: v for k, v in ENV.items() if k != "MASTER_PORT"}},
            "no MASTER_PORT"),
           ({**order.line(), "env": {**ENV, **{f"V{i}": "x" * 60_000 for i in range(40)}}},
            "more than")]
    for obj, words in bad:
        with pytest.raises(BadRecoverOrder, match=words):
            RecoverOrder.parse(obj)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["t", "generation", "env", "x"]), _json, max_size=4),
       st.dictionaries(st.text(max_size=12), st.text(max_size=40) | _json, max_size=6))
def test_a_fuzzed_line_is_an_order_or_a_bad_order(obj: dict[str, Any], env: dict) -> None:
    for candidate in (obj, {**obj, "t": "recover"},
                      {"t": "recover", "generation": 3, "env": {**ENV, **env}}):
        try:
            order = RecoverOrder.parse(candidate)
        except BadRecoverOrder:
            continue
        # What parses is bounded and re-encodes to itself.
        assert 1 <= order.generation <= 1 << 31
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in order.env.items())
        assert RecoverOrder.parse(json.loads(json.dumps(order.line()))) == order


# -- the rank's side ------------------------------------------------------------------------
def test_the_order_runs_the_aborts_and_wakes_the_waiting_training_thread() -> None:
    injob = InJob()
    aborted: list[str] = []

    def failing_abort() -> None:
        raise RuntimeError("backend has no abort")

    injob.enable(lambda: aborted.append("groups"))
    injob.enable(failing_abort)
    got: list[RecoverOrder | None] = []
    waiter = threading.Thread(target=lambda: got.append(injob.wait(10.0)))
    waiter.start()
    time.sleep(0.05)
    assert injob.deliver(RecoverOrder(4, dict(ENV)), current_generation=3)
    waiter.join(5)
    assert got and got[0] is not None and got[0].generation == 4
    assert aborted == ["groups"] and "backend has no abort" in injob.errors[0]
    # An order for the generation the rank is in, or an older one, is not news.
    assert not injob.deliver(RecoverOrder(4, dict(ENV)), current_generation=3)
    assert not injob.deliver(RecoverOrder(3, dict(ENV)), current_generation=3)
    assert injob.take() is not None and injob.take() is None
    assert injob.wait(0.01) is None


def test_the_worker_sdk_takes_a_recover_order_only_when_enabled(tmp_path: Path) -> None:
    from orchestrator.worker.sdk import Worker

    sent: list[dict[str, Any]] = []
    w = Worker(env={"ORCH_GENERATION": "3"})
    w._send = lambda msg: sent.append(msg) or True  # type: ignore[method-assign]
    line = json.dumps(RecoverOrder(4, dict(ENV)).line()).encode()
    w._take_order(line)
    assert w.injob.pending() is None
    assert sent[-1]["name"] == "recovery_failed"
    w.injob.enable(lambda: None)
    w._take_order(line)
    assert w.injob.pending() is not None
    w.join_generation(w.injob.take())  # type: ignore[arg-type]
    assert w.ctx.generation == 4 and w.ctx.rank == 1
    w._beat()
    assert sent[-1]["generation"] == 4 and sent[-1]["recoverable"] is True


# -- the supervisor's choice ----------------------------------------------------------------
class World:
    """A job's view after a launch (``size`` nodes of one rank, two by default), on a fake
    clock."""

    def __init__(self, root: Path, size: int = 2, **restart: Any) -> None:
        self.cfg = Config.model_validate({
            "job": {"name": "t"}, "cluster": {"nodes": size, "procs_per_node": 1},
            "restart": restart})
        self.clock = FakeClock()
        self.ctx = make_context(root, self.cfg, self.clock, FakeLog())
        self.nodes = NodeRegistry(self.clock, self.ctx.record)
        for i in range(size):
            node, _ = self.nodes.register(RegisterRequest(
                node_id=f"n{i}", host="h", addr="127.0.0.1", procs=1, agent_pid=100 + i,
                free_port=20000 + i))
            self.nodes.move(node, NodeState.ACTIVE, node_rank=i)
        self.ctx.record(ev.GenerationLaunched(generation=1, world_size=size,
                                              nodes={f"n{i}": i for i in range(size)}))
        self.progress = ProgressTracker(root / "steps.jsonl", self.clock, self.ctx.record)
        self.progress.start_generation(1, size)

    def beat(self, rank: int, recoverable: bool) -> None:
        self.progress.on_ranks(1, [RankInfo(rank=rank, local_rank=0, step=5,
                                            phase="training", recoverable=recoverable)])

    def path(self, cause: Cause = Cause.WORKER_EXIT, replace: list[int] | None = None,
             generation: int = 1) -> recovery.Path:
        return recovery.choose_path(self.cfg, self.ctx.view, cause, {"generation": generation},
                                    [1] if replace is None else replace,
                                    self.progress.current, self.nodes)


def test_in_job_is_taken_only_when_every_condition_holds(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.beat(0, True)
    w.beat(1, True)
    ok = w.path()
    assert ok.in_job and ok.replace == [1]
    reasons = {
        "off": World(tmp_path / "off", in_job=False).path().reason,
        "cause": w.path(Cause.NODE_LOST).reason,
        "nobody": w.path(replace=[]).reason,
        "all": w.path(replace=[0, 1]).reason,
        "stale": w.path(generation=0).reason,
    }
    assert reasons["off"] == "restart.in_job is off"
    assert "node_lost failure restarts every rank" in reasons["cause"]
    assert "no rank to replace" in reasons["nobody"]
    assert reasons["all"] == "every rank failed"
    assert "not the last one launched" in reasons["stale"]
    w.beat(0, False)  # a survivor that cannot rejoin (a script without the SDK's path)
    assert "rank(s) [0] cannot rejoin in place" in w.path().reason
    w.beat(0, True)
    # An agent that died with its ranks: silent, not yet judged lost.
    w.clock.advance(max(3 * w.cfg.timeouts.heartbeat_interval_s, 1.0) + 0.5)
    w.nodes.heartbeat("n1", 1, None, [])
    assert "node n0 of the generation is silent for" in w.path().reason
    w.nodes.heartbeat("n0", 1, None, [])
    assert w.path().in_job
    w.nodes.move(w.nodes.nodes["n0"], NodeState.LOST, reason="silent")
    assert "node n0 of the generation is lost" in w.path().reason


def test_a_one_rank_jobs_death_is_replaced_in_place(tmp_path: Path) -> None:
    """Its only rank is every rank, but one death, not a job-wide failure: the standby takes
    over. Every rank of a larger job failing still restarts it."""
    one = World(tmp_path / "one", size=1)
    one.beat(0, False)  # a script without the worker SDK's in-job path: restarted
    assert "rank(s) [0] cannot rejoin in place" in one.path(replace=[0]).reason
    one.beat(0, True)
    path = one.path(replace=[0])
    assert path.in_job and path.replace == [0]
    assert "only rank" in path.reason
    assert "no rank to replace" in one.path(replace=[]).reason
    assert "node_lost failure restarts every rank" in one.path(Cause.NODE_LOST,
                                                                replace=[0]).reason
    one.nodes.move(one.nodes.nodes["n0"], NodeState.LOST, reason="silent")
    assert "node n0 of the generation is lost" in one.path(replace=[0]).reason
    three = World(tmp_path / "three", size=3)
    for rank in range(3):
        three.beat(rank, True)
    assert three.path(replace=[0, 1, 2]).reason == "every rank failed"
    assert three.path(replace=[0, 2]).in_job


def test_a_failed_in_place_generation_is_recovered_by_a_restart(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.ctx.record(ev.GenerationLaunched(generation=2, world_size=2, nodes={"n0": 0, "n1": 1},
                                       in_place=True, replaced=[1]))
    w.progress.start_generation(2, 2)
    for rank in (0, 1):
        w.progress.on_ranks(2, [RankInfo(rank=rank, local_rank=0, recoverable=True)])
    assert "failed before its first step" in w.path(generation=2).reason
    w.ctx.record(ev.FirstStep(generation=2, step=11))
    assert w.path(generation=2).in_job


def test_the_ranks_to_replace_are_the_failed_or_silent_ones() -> None:
    exits = {1: {"exit_code": None, "signal": "SIGKILL"}, 0: {"exit_code": 0, "signal": None}}
    assert recovery.failed_ranks(Cause.WORKER_EXIT, {}, exits) == [1]
    hang = {"suspects": [{"rank": 3, "silent": True}, {"rank": 0, "silent": False}]}
    assert recovery.failed_ranks(Cause.HANG, hang, {}) == [3]
    # Judged before the stopped rank's silence reached the threshold: its beats stopped,
    # its blocked peer's go on.
    early = {"suspects": [{"rank": 1, "silent": False, "beat_age_s": 1.2},
                          {"rank": 0, "silent": False, "beat_age_s": 0.3}]}
    assert recovery.failed_ranks(Cause.HANG, early, {}, beat_s=0.5) == [1]
    # Every rank late alike (a late host, not a stopped rank): nobody is named.
    late = {"suspects": [{"rank": 1, "silent": False, "beat_age_s": 1.2},
                         {"rank": 0, "silent": False, "beat_age_s": 1.1}]}
    assert recovery.failed_ranks(Cause.HANG, late, {}, beat_s=0.5) == []
    # ...unless a rank of the world is no suspect at all: it still beats (one that stopped
    # at the suspects' step would be named with them). Steps of milliseconds: the stopped
    # rank is judged at the floor, its blocked peer not yet.
    alone = {"suspects": [{"rank": 0, "silent": False, "beat_age_s": 1.02}]}
    assert recovery.failed_ranks(Cause.HANG, alone, {}, beat_s=0.5, world_size=2) == [0]
    # A one-rank job: its stopped rank is the one to replace; one still beating is not
    # named (a stuck step that beats restarts, as every rank stuck does in a larger job).
    assert recovery.failed_ranks(Cause.HANG, alone, {}, beat_s=0.5, world_size=1) == [0]
    beating = {"suspects": [{"rank": 0, "silent": False, "beat_age_s": 0.4}]}
    assert recovery.failed_ranks(Cause.HANG, beating, {}, beat_s=0.5, world_size=1) == []
    assert recovery.failed_ranks(Cause.HANG, late, {}, beat_s=0.5, world_size=2) == []
    fresh = {"suspects": [{"rank": 1, "silent": False, "beat_age_s": 0.4},
                          {"rank": 0, "silent": False, "beat_age_s": None}]}
    assert recovery.failed_ranks(Cause.HANG, fresh, {}, beat_s=0.5) == []
    assert recovery.failed_ranks(Cause.NODE_LOST, hang, exits) == []


def test_a_fixed_master_port_rules_in_job_out(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.cfg = Config.model_validate({**w.cfg.model_dump(), "job": {"name": "t",
                                                                  "master_port": 29500}})
    w.beat(0, True)
    assert "job.master_port is fixed" in w.path().reason


def test_recover_orders_reach_a_rank_over_the_agents_socket(tmp_path: Path) -> None:
    """The agent's hub writes the order on the rank's connection; the worker SDK's order
    thread reads it within its poll, not a heartbeat later."""
    from orchestrator.agent.local_socket import LocalHub, LocalSocketServer
    from orchestrator.worker.sdk import Worker

    async def scenario() -> float:
        hub = LocalHub(on_event=lambda msg: None)
        server = LocalSocketServer(hub)
        await server.start()
        try:
            w = Worker(env={"ORCH_AGENT_SOCKET": server.path, "ORCH_GENERATION": "3",
                            "ORCH_HEARTBEAT_INTERVAL": "5", "RANK": "1", "WORLD_SIZE": "2"})
            w.injob.enable(lambda: None)
            await asyncio.to_thread(w.start)
            for _ in range(200):
                if 1 in hub.writers:
                    break
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            hub.send_order(1, RecoverOrder(4, dict(ENV)).line())
            order = await asyncio.to_thread(w.injob.wait, 10.0)
            took = time.monotonic() - t0
            await asyncio.to_thread(w.close)
            assert order is not None and order.generation == 4
            return took
        finally:
            await server.close()

    # Well under the 5 s heartbeat interval: the order thread polls every 50 ms.
    assert asyncio.run(scenario()) < 2.0
