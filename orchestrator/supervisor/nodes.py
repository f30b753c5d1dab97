"""The supervisor's live view of its nodes, and the node state machine beside the job's.

Lifecycle of one node (``NODE_MOVES`` is the table; ``NodeRegistry.move`` the one function
that changes a node's state, journaling each move as a ``node_state`` event)::

    REGISTERED -> ACTIVE | SPARE       placed (or held back) for a generation
    ACTIVE <-> SPARE                   placement changed
    any live state -> LOST             agent silent past node_lost_s, or no stop confirmed
    any live state -> EXCLUDED         failed a health check, or failed too often
    any state -> EXITED                agent finished cleanly
    LOST | EXITED -> REGISTERED        the agent registered or beat again
    EXCLUDED -> REGISTERED             passed a re-check

Assignments are versioned per node; an agent long-polls for a version newer than the one it
holds, so a new command reaches it within one round trip rather than one heartbeat interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.clock import Clock
from orchestrator.events import Envelope, Event, NodeStateChanged
from orchestrator.protocol import Assignment, RankInfo, RegisterRequest, SignalOrder
from orchestrator.state import NodeState

_R, _A, _S, _L, _X, _E = (NodeState.REGISTERED, NodeState.ACTIVE, NodeState.SPARE,
                          NodeState.LOST, NodeState.EXCLUDED, NodeState.EXITED)
NODE_MOVES: dict[NodeState, frozenset[NodeState]] = {
    _R: frozenset({_A, _S, _L, _X, _E}),
    _A: frozenset({_A, _S, _L, _X, _E}),  # ACTIVE -> ACTIVE: its node rank changed
    _S: frozenset({_A, _L, _X, _E}),
    _L: frozenset({_R, _X, _E}),
    _X: frozenset({_R, _E}),
    _E: frozenset({_R}),
}


class IllegalNodeMove(RuntimeError):
    """A node move the table does not allow (a bug in the caller, never swallowed)."""


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
    """Nodes by id, and the owner of every node state change. All methods run on the
    supervisor's event loop. ``record`` journals an event; ``on_counts`` receives the
    number of nodes per state after every move (the metrics' gauge)."""

    def __init__(self, clock: Clock, record: Callable[[Event], Envelope] | None = None,
                 on_counts: Callable[[dict[str, int]], None] | None = None) -> None:
        self._clock = clock
        self._record = record
        self._on_counts = on_counts
        self.nodes: dict[str, NodeRecord] = {}
        self._changed = asyncio.Condition()
        self._signal_ids = 0

    # -- the node state machine ------------------------------------------------------------
    def move(self, node: NodeRecord, state: NodeState, reason: str | None = None, *,
             node_rank: int | None | object = ...) -> None:
        """The one way a node changes state: checked against ``NODE_MOVES``, journaled.

        ``node_rank`` (when given, ``None`` included) is set with the move and journaled."""
        if state not in NODE_MOVES[node.state] and state is not node.state:
            raise IllegalNodeMove(f"node {node.node_id}: {node.state.value} -> {state.value}")
        previous, node.state = node.state, state
        fields: dict[str, object] = {}
        if node_rank is not ...:
            node.node_rank = node_rank  # type: ignore[assignment]
            fields["node_rank"] = node_rank
        if self._record is not None:
            self._record(NodeStateChanged(node_id=node.node_id, state=state,
                                          previous=previous, reason=reason, **fields))
        self.sync_counts()

    def sync_counts(self) -> None:
        if self._on_counts is not None:
            self._on_counts(self.counts())

    def mark_silent_lost(self, limit_s: float) -> list[NodeRecord]:
        """Every live node silent for more than ``limit_s`` becomes LOST (journaled)."""
        lost = []
        for node in self.nodes.values():
            if node.state in (_A, _S, _R) and self.silent_for(node) > limit_s:
                self.move(node, _L, reason=f"silent for {self.silent_for(node):.1f} s")
                lost.append(node)
        return lost

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
                self.move(node, NodeState.REGISTERED, reason="registered again")
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
        if node.state is NodeState.LOST:  # it was slow, not dead: usable again
            self.move(node, NodeState.REGISTERED, reason="heartbeat after being lost")
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
