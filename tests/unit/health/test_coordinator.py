"""A health round on the supervisor's side, with scripted agents (no processes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fakes import make_context
from orchestrator.clock import SYSTEM_CLOCK
from orchestrator.config import load_config
from orchestrator.journal.store import read_events
from orchestrator.health.base import Level
from orchestrator.health.catalog import node_checks
from orchestrator.supervisor.health_rounds import HealthCoordinator
from orchestrator.logs import get_logger
from orchestrator.contracts.protocol import HealthReport, RegisterRequest
from orchestrator.contracts.state import NodeState
from orchestrator.supervisor.nodes import NodeRegistry


class FakeSupervisor:
    """What the coordinator uses of a Supervisor: nodes, the journal, config, a clock."""

    def __init__(self, tmp: Path, n: int, **health: Any) -> None:
        overrides = [f"health.{k}={v!r}" if not isinstance(v, str) else f"health.{k}={v}"
                     for k, v in health.items()]
        # Short check timeouts: a silent node is given up on within a second or two.
        short = {c.name: 0.1 for c in node_checks(Level.FULL)}
        self.cfg = load_config(None, ["cluster.spares=1", f"health.timeouts={short!r}",
                                      *overrides])
        self.clock = SYSTEM_CLOCK
        self.log = get_logger("test")
        self.ctx = make_context(tmp, self.cfg, SYSTEM_CLOCK, self.log,
                                checkpoint_root=str(tmp / "ckpt"))
        self.checkpoint_root = self.ctx.checkpoint_root
        self.stop_requested = asyncio.Event()
        nodes = NodeRegistry(SYSTEM_CLOCK, self.ctx.record)
        for i in range(n):
            nodes.register(RegisterRequest(node_id=f"local-{i}", host="h", addr="127.0.0.1",
                                           procs=1, agent_pid=1, free_port=20000 + i))
        self.intake = SimpleNamespace(nodes=nodes)
        self.health = HealthCoordinator(self.ctx, nodes, self.stop_requested)

    @property
    def events(self) -> list[dict[str, Any]]:
        self.ctx.recorder.journal.flush()
        return list(read_events(self.ctx.rundir.journal))


async def agents(sup: FakeSupervisor, answer: dict[str, Any]) -> None:
    """Answer each node's health order: ``answer[node]`` is a clock offset, or None (silent)."""
    done: set[tuple[str, str]] = set()
    while True:
        for node in sup.intake.nodes.nodes.values():
            h = node.assignment.health
            if node.assignment.action != "health" or h is None or \
                    (node.node_id, h.nonce + h.stage) in done:
                continue
            done.add((node.node_id, h.nonce + h.stage))
            offset = answer.get(node.node_id)
            if offset is None:
                continue
            ctx = h.context or {}
            probe = ctx.get("shared_fs")
            results = []
            if probe:  # the node's half of host.shared_fs: read the head's file, write ours
                assert Path(probe["path"]).read_text() == probe["content"]
                if node.node_id != "local-2":  # local-2 "mounts" another filesystem
                    Path(probe["write_path"]).write_text(f"{probe['content']} {node.node_id}")
                results.append({"node_id": node.node_id, "check": "host.shared_fs", "ok": True,
                                "severity": "fatal", "message": "sees the head's file",
                                "duration_s": 0.01, "level": ctx["level"]})
            sup.health.on_report(node.node_id, HealthReport(
                nonce=h.nonce, stage="node", results=results, sent_ts=time.time() + offset),
                time.time())
        await asyncio.sleep(0.01)


def run_round(sup: FakeSupervisor, answer: dict[str, Any]) -> dict:
    async def main() -> dict:
        task = asyncio.create_task(agents(sup, answer))
        try:
            nodes = list(sup.intake.nodes.nodes.values())
            return await sup.health.admit(nodes, Level.QUICK)
        finally:
            task.cancel()
    return asyncio.run(main())


def test_clock_skew_silence_and_a_private_filesystem_are_judged_by_the_head(
        tmp_path: Path) -> None:
    sup = FakeSupervisor(tmp_path, 4, report_grace_s=1.0, floors={"clock_skew_s": 2.0})
    results = run_round(sup, {"local-0": 0.0, "local-1": 30.0, "local-2": 0.0, "local-3": None})
    verdict = {n: {r.check: r for r in rs} for n, rs in results.items()}
    assert verdict["local-0"]["host.clock_skew"].ok
    assert verdict["local-0"]["host.shared_fs"].message.endswith("the head reads its file")
    skew = verdict["local-1"]["host.clock_skew"]
    assert not skew.ok and skew.message.startswith("30.0") and "ahead of the head, more than 2 s" \
        in skew.message
    private = verdict["local-2"]["host.shared_fs"]
    assert not private.ok and "the head does not see the file this node wrote" in private.message
    silent = verdict["local-3"]["agent.report"]
    assert not silent.ok and silent.message.startswith("no report within")
    # Every result journaled, the bad nodes excluded with their reasons, the probes removed.
    health = [e for e in sup.events if e["kind"] == "health"]
    assert len(health) == sum(len(rs) for rs in results.values())
    excluded = {e["node_id"]: e["reason"] for e in sup.events
                if e["kind"] == "node_state" and e["state"] == "excluded"}
    assert sorted(excluded) == ["local-1", "local-2", "local-3"]
    assert excluded["local-3"].startswith("health: agent.report: no report within")
    assert list((tmp_path / "ckpt" / ".health").iterdir()) == []
    message = sup.health.insufficient(2)
    assert message.startswith("health checks left 1 healthy node(s) of the 2 the job needs")
    assert "local-1 (host.clock_skew: 30.0" in message and "local-0" not in message
    (round_,) = [e for e in sup.events if e["kind"] == "health_round"]
    assert round_["failed"] == {"local-1": ["host.clock_skew"], "local-2": ["host.shared_fs"],
                                "local-3": ["agent.report"]}


def test_a_node_that_passes_again_is_readmitted(tmp_path: Path) -> None:
    sup = FakeSupervisor(tmp_path, 2, report_grace_s=1.0)
    run_round(sup, {"local-0": 0.0, "local-1": None})
    node = sup.intake.nodes.nodes["local-1"]
    assert node.state is NodeState.EXCLUDED and "local-1" in sup.health.excluded
    run_round(sup, {"local-0": 0.0, "local-1": 0.0})
    assert node.state is NodeState.REGISTERED and sup.health.excluded == {}
