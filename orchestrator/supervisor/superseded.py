"""Nodes back with a superseded generation: lost in one generation, they come back with its
ranks still running (a network cut shorter than the agent's lease) and never rejoin it,
since their peers have moved on.

Message intake notes such a node as its registration or heartbeat arrives (``note``); the
generation's loop tells each one, once a turn, to stop those ranks (``stop``), and a node
back from being lost becomes a spare, through the registry's state machine. A node placed
in the newest generation whose agent has not got there yet is left alone.
"""

from __future__ import annotations

from orchestrator.contracts.state import NodeState
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.nodes import NodeRecord, NodeRegistry


class SupersededNodes:
    """The nodes noted running a generation older than the newest launched, until told."""

    def __init__(self, ctx: JobContext, nodes: NodeRegistry) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.pending: set[str] = set()  # told to stop their ranks at the loop's next turn

    def note(self, node: NodeRecord, generation: int | None) -> None:
        """``node`` says its ranks run ``generation``: noted when that is older than the
        newest launched and the node was not told otherwise yet."""
        if generation is not None and generation < self.ctx.view.generation \
                and self._told_to_run_old(node):
            self.pending.add(node.node_id)

    def _told_to_run_old(self, node: NodeRecord) -> bool:
        """Its assignment still runs (or stops) an old generation: not yet told otherwise
        (an active node told to run the newest one is on its way there)."""
        a = node.assignment
        return a.action in ("run", "stop") and a.generation != self.ctx.view.generation

    async def stop(self, generation: int) -> None:
        """Tell every node noted (and still not told otherwise) to stop its ranks; one back
        after being lost is a spare now. ``generation`` is the one running."""
        while self.pending:
            node_id = self.pending.pop()
            node = self.nodes.nodes.get(node_id)
            if node is None or not self._told_to_run_old(node):
                continue
            self.ctx.log.warning("node runs a superseded generation: told to stop its ranks",
                                 node=node_id, runs=node.generation, current=generation)
            await self.nodes.assign(node_id, action="idle", generation=None)
            if node.state is NodeState.REGISTERED:  # back after being lost: a spare now
                self.nodes.move(node, NodeState.SPARE, node_rank=None,
                                reason="back after its generation was superseded")
