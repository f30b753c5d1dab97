"""HEALTH_CHECK's work: wait for enough live nodes, check them, place ranks and spares.

Bad nodes are excluded through the node state machine (the health coordinator does that),
lost ones have their agents restarted by the launcher, and the job fails only when nodes
cannot come: every deadline reads the one clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from orchestrator.health.base import Level
from orchestrator.supervisor.health_rounds import HealthCoordinator
from orchestrator.launchers import AgentSpec, Launcher
from orchestrator.contracts.state import Cause, NodeState
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.generation.parts import TICK_S
from orchestrator.supervisor.intake import Intake
from orchestrator.supervisor.generation.outcome import JobFailed
from orchestrator.supervisor.placement import Placement, id_key, place
from orchestrator.supervisor.policy import OperatorStop


class NodeSelection:
    def __init__(self, ctx: JobContext, intake: Intake, health: HealthCoordinator,
                 launcher: Launcher, agent_spec: Callable[[], AgentSpec],
                 stop_requested: asyncio.Event) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.intake = intake
        self.nodes = intake.nodes
        self.health = health
        self.launcher = launcher
        self.agent_spec = agent_spec
        self.stop_requested = stop_requested

    async def select(self) -> Placement:
        """Wait for enough live nodes, check them (excluding the bad ones), place node
        ranks and spares. Raises JobFailed when they cannot come, OperatorStop on a stop."""
        needed, ppn = self.cfg.cluster.nodes, self.cfg.cluster.procs_per_node
        clock = self.ctx.clock
        deadline = clock.monotonic() + self.cfg.timeouts.register_s
        replaced: set[str] = set()
        level, checked = self.health.level_now(), set[str]()
        while True:
            self.intake.mark_silent_nodes_lost()
            placement = place(list(self.nodes.nodes.values()), needed, ppn)
            # Check once enough nodes are here; newcomers (spares, replacements) on arrival.
            if level is not None and (placement.complete or self.health.excluded) and \
                    await self.health.check_new(level, checked):
                continue
            if placement.complete:
                break
            for node in self.nodes.with_state(NodeState.LOST):
                if node.node_id not in replaced and len(replaced) < placement.missing:
                    replaced.add(node.node_id)
                    if await self.launcher.replace(self.agent_spec(), node.node_id):
                        self.ctx.log.info("restarting lost node's agent", node=node.node_id)
            # Before giving up on health grounds, let nodes still starting or being replaced
            # arrive (until the registration deadline): they may be the spares needed.
            more_coming = clock.monotonic() <= deadline and (
                len(self.nodes.nodes) < self.launcher.wanted_nodes
                or bool(self.nodes.with_state(NodeState.LOST)))
            if level is not None and self.health.excluded and not more_coming:
                if self.cfg.health.on_insufficient == "fail":
                    raise JobFailed(self.health.insufficient(needed), Cause.HEALTH_CHECK)
                await self.health.recheck_excluded(level, checked)
            elif clock.monotonic() > deadline:
                have = needed - placement.missing
                raise JobFailed(f"only {have} of {needed} nodes are available after "
                                f"{self.cfg.timeouts.register_s:.0f} s")
            if self.stop_requested.is_set():
                raise OperatorStop()
            await clock.sleep(TICK_S)
        await self.intake.apply_placement(placement)
        return placement

    async def check_only(self, level: Level) -> str:
        """``orchestrator health``: one round over every node that registers; returns the
        summary the STOPPED transition carries."""
        clock = self.ctx.clock
        deadline = clock.monotonic() + self.cfg.timeouts.register_s
        nodes = self.nodes.nodes
        while len(nodes) < self.launcher.wanted_nodes and clock.monotonic() < deadline:
            if self.stop_requested.is_set():
                raise OperatorStop()
            await clock.sleep(TICK_S)
        usable = sorted((n for n in nodes.values() if n.usable),
                        key=lambda n: id_key(n.node_id))
        results = await self.health.run_round(usable, level) if usable else {}
        fatal = sorted({n for n, rs in results.items() if any(r.fatal_failure for r in rs)})
        return (f"health check only: {len(usable)} of {self.launcher.wanted_nodes} node(s) "
                f"checked, {len(fatal)} with a fatal failure"
                + (f" ({', '.join(fatal)})" if fatal else ""))
