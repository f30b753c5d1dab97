"""The supervisor's side of fault injection: the plan each launch carries, which injections
fired, and the interval kills sent through the agents.

What a fault is and when one is due is decided in ``contracts.chaos`` (its ``ChaosDriver``);
this desk holds the job's driver and does the supervisor's I/O around it. Message intake
gets only ``mark_fired`` (a rank said it signalled itself); the generation's loop gets the
launch's ``plan``, ``begin_generation`` and ``tick``.
"""

from __future__ import annotations

from orchestrator.contracts import events as ev
from orchestrator.contracts.chaos import ChaosDriver, ChaosPlan
from orchestrator.contracts.state import JobState
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.nodes import NodeRegistry


class ChaosDesk:
    """The job's ``ChaosDriver`` (injections fired so far come from the journal, so each
    fires once per job across supervisor restarts) and the interval kills it makes due."""

    def __init__(self, ctx: JobContext, nodes: NodeRegistry) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.driver = ChaosDriver(ctx.cfg.chaos, ctx.cfg.cluster.world_size,
                                  ctx.view.chaos_fired)
        # When the running launch was first seen RUNNING: interval kills count from there.
        self.running_since: float | None = None

    def plan(self) -> ChaosPlan:
        """What the next launch's ranks inject (``ORCH_CHAOS``)."""
        return self.driver.plan()

    def mark_fired(self, key: str) -> None:
        """A rank said it fired injection ``key``: no later launch plans it again."""
        self.driver.mark_fired(key)

    def begin_generation(self) -> None:
        """A launch (or adoption) begins: its interval kills count from when it runs."""
        self.running_since = None

    async def tick(self, generation: int) -> None:
        """While ``generation`` runs: each interval kill now due is journaled (``chaos``),
        then sent to its rank's node."""
        if self.ctx.view.state is JobState.RUNNING and self.running_since is None:
            self.running_since = self.ctx.clock.monotonic()
        procs_per_node = self.ctx.cfg.cluster.procs_per_node
        for inj in self.driver.due_interval(self.running_since, self.ctx.clock.monotonic()):
            node = self.nodes.node_of_rank(inj.rank, procs_per_node)
            if node is None:
                continue
            self.ctx.record(ev.Chaos(id=str(inj.id), rank=inj.rank, signal=inj.signal,
                                     step=inj.step, node_id=node.node_id,
                                     generation=generation))
            self.ctx.log.warning("chaos: signalling rank", rank=inj.rank, signal=inj.signal,
                                 at_step=inj.step)
            await self.nodes.send_signal(node.node_id, inj.rank, inj.signal)
