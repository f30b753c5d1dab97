"""The supervisor's live view of its nodes: registrations, liveness, ranks, assignments.

Assignments are versioned per node; an agent long-polls for a version newer than the one it
holds, so a new command reaches it within one round trip rather than one heartbeat interval.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from orchestrator.clock import Clock
from orchestrator.protocol import Assignment, RankInfo, RegisterRequest, SignalOrder
from orchestrator.state import NodeState


@dataclass
class NodeRecord:
    node_id: str
    host: str
    addr: str
    procs: int
    agent_pid: int
    free_port: int | None
    last_seen: float  # monotonic
    state: NodeState = NodeState.REGISTERED
    node_rank: int | None = None
    generation: int | None = None  # generation the agent last said it runs
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    assignment: Assignment = field(default_factory=Assignment)
    failure_times: list[float] = field(default_factory=list)  # wall times of failures blamed
    stopped_generation: int | None = None  # last generation the agent reported stopped

    @property
    def usable(self) -> bool:
        return self.state in (NodeState.REGISTERED, NodeState.ACTIVE, NodeState.SPARE)


class NodeRegistry:
    """Nodes by id. All methods run on the supervisor's event loop."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.nodes: dict[str, NodeRecord] = {}
        self._changed = asyncio.Condition()
        self._signal_ids = 0

    # -- agents talking to us --------------------------------------------------------------
    def register(self, req: RegisterRequest) -> tuple[NodeRecord, bool]:
        """Add or refresh a node; returns (record, known_before)."""
        now = self._clock.monotonic()
        node = self.nodes.get(req.node_id)
        known = node is not None
        if node is None:
            node = NodeRecord(req.node_id, req.host, req.addr, req.procs, req.agent_pid,
                              req.free_port, now)
            self.nodes[req.node_id] = node
        else:
            node.host, node.addr, node.procs = req.host, req.addr, req.procs
            node.agent_pid, node.last_seen = req.agent_pid, now
            if req.free_port:
                node.free_port = req.free_port
            if node.state in (NodeState.LOST, NodeState.EXITED):
                node.state = NodeState.REGISTERED
        node.generation = req.generation
        node.ranks = {r.rank: r for r in req.ranks}
        return node, known

    def heartbeat(self, node_id: str, generation: int | None, free_port: int | None,
                  ranks: list[RankInfo]) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        if node is None:
            return None
        node.last_seen = self._clock.monotonic()
        node.generation = generation
        if free_port:
            node.free_port = free_port
        for info in ranks:
            node.ranks[info.rank] = info
        return node

    def silent_for(self, node: NodeRecord) -> float:
        return self._clock.monotonic() - node.last_seen

    # -- commands to agents ----------------------------------------------------------------
    async def assign(self, node_id: str, **fields: object) -> Assignment:
        """Replace the node's assignment (keeping pending signal orders) and wake its poll."""
        node = self.nodes[node_id]
        data = node.assignment.model_dump()
        data.update(fields)
        data["version"] = node.assignment.version + 1
        node.assignment = Assignment.model_validate(data)
        await self._notify()
        return node.assignment

    async def send_signal(self, node_id: str, rank: int, signal: str) -> None:
        """Ask the node's agent to send ``signal`` to ``rank`` once."""
        node = self.nodes[node_id]
        self._signal_ids += 1
        orders = [*node.assignment.signals, SignalOrder(id=self._signal_ids, rank=rank,
                                                        signal=signal)]
        await self.assign(node_id, signals=[o.model_dump() for o in orders[-32:]])

    async def wait_assignment(self, node_id: str, after_version: int,
                              timeout: float) -> Assignment | None:
        """The node's assignment once its version exceeds ``after_version`` (or at timeout)."""
        async def newer() -> None:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: node_id in self.nodes
                    and self.nodes[node_id].assignment.version > after_version)
        try:
            await asyncio.wait_for(newer(), timeout)
        except TimeoutError:
            pass
        node = self.nodes.get(node_id)
        return node.assignment if node else None

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- queries ---------------------------------------------------------------------------
    def with_state(self, *states: NodeState) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state in states]

    def active(self) -> list[NodeRecord]:
        nodes = self.with_state(NodeState.ACTIVE)
        return sorted(nodes, key=lambda n: n.node_rank if n.node_rank is not None else 1 << 30)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in NodeState}
        for n in self.nodes.values():
            out[n.state.value] += 1
        return out
