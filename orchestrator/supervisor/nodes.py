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

At 2,048 nodes nothing here scans every node per message: a changed assignment wakes only
that node's long-polls, silences are found oldest-first (``deadlines.OldestFirst``), the
per-state counts are kept as nodes move, and a node's signal orders go out in one change.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from orchestrator.clock import Clock
from orchestrator.contracts.events import Envelope, Event, NodeStateChanged
from orchestrator.contracts.protocol import Assignment, RankInfo, RegisterRequest, SignalOrder
from orchestrator.contracts.state import NodeState
from orchestrator.supervisor.deadlines import LoopLag, OldestFirst, ServiceClock

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
_LIVE = frozenset({_R, _A, _S})  # states whose silence is watched
# Silences this widespread are suspected to be ours (see ``mark_silent_lost``).
MASS_SILENCE_MIN = 16
MASS_SILENCE_GRACE = 3.0
# Assignment changes made in one go before other work on the loop gets a turn, and how
# long that turn is at least (``NodeRegistry._pace``).
_ASSIGN_BURST = 32
_PACE_S = 0.01
_PACE_MAX_TURNS = 20


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
    seen_at: float = 0.0  # the same moment on the registry's service clock (LoopLag)
    state: NodeState = NodeState.REGISTERED
    node_rank: int | None = None
    generation: int | None = None  # generation the agent last said it runs
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    assignment: Assignment = field(default_factory=Assignment)
    stopped_generation: int | None = None  # last generation the agent reported stopped

    @property
    def usable(self) -> bool:
        return self.state in (NodeState.REGISTERED, NodeState.ACTIVE, NodeState.SPARE)

    def confirm_stop(self, generation: int | None, free_port: int | None) -> None:
        """The agent said the ranks of ``generation`` stopped (and which port is free)."""
        self.stopped_generation = generation
        if free_port:
            self.free_port = free_port


class NodeRegistry:
    """Nodes by id, and the owner of every node state change. All methods run on the
    supervisor's event loop. ``record`` journals an event; ``on_counts`` receives the
    number of nodes per state after every move (the metrics' gauge). With ``lag``,
    silences are measured on its service clock: time the supervisor was late to read its
    sockets does not count against a node."""

    def __init__(self, clock: Clock, record: Callable[[Event], Envelope] | None = None,
                 on_counts: Callable[[dict[str, int]], None] | None = None,
                 lag: LoopLag | None = None) -> None:
        self._clock = clock
        self._service = lag.service_time if lag is not None else clock.monotonic
        # What rank progress and hangs are judged on: the service clock too.
        self.judge_clock: Clock = ServiceClock(clock, lag) if lag is not None else clock
        self._record = record
        self._on_counts = on_counts
        self.nodes: dict[str, NodeRecord] = {}
        self._wake: dict[str, asyncio.Event] = {}  # per node: set when its assignment changes
        self._silence: OldestFirst[str] = OldestFirst()  # live nodes by last_seen
        self._counts: Counter[NodeState] = Counter()
        self._signal_ids = 0
        self._assigned = 0  # assignment changes, to let other work in between (``assign``)
        self.held_back = 0  # silence checks that waited longer because many nodes were silent
        self.epoch = 0  # this supervisor's leader epoch, stamped on every assignment
        self.guard: Callable[[], None] | None = None  # a deposed leader sends no order

    # -- the node state machine ------------------------------------------------------------
    def move(self, node: NodeRecord, state: NodeState, reason: str | None = None, *,
             node_rank: int | None | object = ...) -> None:
        """The one way a node changes state: checked against ``NODE_MOVES``, journaled.

        ``node_rank`` (when given, ``None`` included) is set with the move and journaled."""
        if state not in NODE_MOVES[node.state] and state is not node.state:
            raise IllegalNodeMove(f"node {node.node_id}: {node.state.value} -> {state.value}")
        previous, node.state = node.state, state
        self._counts[previous] -= 1
        self._counts[state] += 1
        self._watch(node)
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

    def _watch(self, node: NodeRecord) -> None:
        """Keep the silence heap in step with the node's state and last beat."""
        if node.state in _LIVE:
            self._silence.set(node.node_id, node.seen_at)
        else:
            self._silence.discard(node.node_id)

    def mark_silent_lost(self, limit_s: float) -> list[NodeRecord]:
        """Every live node silent for more than ``limit_s`` becomes LOST (journaled),
        found oldest-first: a check with no silent node costs one look at the heap.

        When many nodes fall silent together (more than ``MASS_SILENCE_MIN`` and a quarter
        of the live ones silent for half the limit or more), the likelier culprit is this
        supervisor (its loop behind a burst of messages) or the network, not each node: as
        Kubernetes' node controller stops evicting in a mostly unhealthy zone, they get
        ``MASS_SILENCE_GRACE`` times the limit before they are declared lost, and
        ``held_back`` counts the checks that waited. Half the limit, not the limit: nodes
        that registered over several seconds fall silent over several seconds, and counted
        past the limit they crossed it a few at a time, never a quarter at once."""
        now = self._service()
        oldest = self._silence.oldest()
        if oldest is None or now - oldest[1] <= limit_s:
            return []
        silent = self._silence.count_older_than(now - limit_s / 2)
        if silent > max(MASS_SILENCE_MIN, len(self._silence) // 4):
            limit_s *= MASS_SILENCE_GRACE
            self.held_back += 1
        lost = []
        while (oldest := self._silence.oldest()) is not None and now - oldest[1] > limit_s:
            node = self.nodes[oldest[0]]
            self.move(node, _L, reason=self.silence_reason(node))
            lost.append(node)
        return lost

    def service_time(self) -> float:
        """The clock silences and stop deadlines are judged on (see ``LoopLag``)."""
        return self._service()

    def judged_silence(self, node: NodeRecord) -> float:
        """How long the node has been silent while this supervisor kept up."""
        return self._service() - node.seen_at

    def silence_reason(self, node: NodeRecord) -> str:
        """A silence in words; says how much longer it was given when we were late."""
        wall, judged = self.silent_for(node), self.judged_silence(node)
        text = f"silent for {wall:.1f} s"
        if wall - judged >= 0.05:
            text += (f" (deadline extended by {wall - judged:.1f} s: the supervisor was late "
                     "to read its messages)")
        return text

    # -- agents talking to us --------------------------------------------------------------
    def register(self, req: RegisterRequest) -> tuple[NodeRecord, bool]:
        """Add or refresh a node; returns (record, known_before)."""
        now = self._clock.monotonic()
        node = self.nodes.get(req.node_id)
        known = node is not None
        if node is None:
            node = NodeRecord(req.node_id, req.host, req.addr, req.procs, req.agent_pid,
                              req.free_port, now, self._service())
            node.assignment = Assignment(epoch=self.epoch)
            self.nodes[req.node_id] = node
            self._wake[req.node_id] = asyncio.Event()
            self._counts[node.state] += 1
        else:
            node.host, node.addr, node.procs = req.host, req.addr, req.procs
            node.agent_pid, node.last_seen, node.seen_at = req.agent_pid, now, self._service()
            if req.free_port:
                node.free_port = req.free_port
            if node.state in (NodeState.LOST, NodeState.EXITED):
                self.move(node, NodeState.REGISTERED, reason="registered again")
        self._watch(node)
        node.generation = req.generation
        node.ranks = {r.rank: r for r in req.ranks}
        return node, known

    def heartbeat(self, node_id: str, generation: int | None, free_port: int | None,
                  ranks: list[RankInfo]) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        if node is None:
            return None
        node.last_seen, node.seen_at = self._clock.monotonic(), self._service()
        node.generation = generation
        if node.state is NodeState.LOST:  # it was slow, not dead: usable again
            self.move(node, NodeState.REGISTERED, reason="heartbeat after being lost")
        elif node.state in _LIVE:
            self._silence.set(node_id, node.seen_at)
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
        if self.guard is not None:
            self.guard()
        node = self.nodes[node_id]
        data = node.assignment.model_dump()
        data.update(fields)
        data["version"] = node.assignment.version + 1
        data["epoch"] = self.epoch
        node.assignment = Assignment.model_validate(data)
        # Wake this node's long-polls only (a condition shared by every node woke all
        # 2,048 polls on each of a launch's 2,048 assignments: 4 M wake-ups).
        wake = self._wake.get(node_id)
        if wake is not None:
            wake.set()
            self._wake[node_id] = asyncio.Event()
        self._assigned += 1
        if self._assigned % _ASSIGN_BURST == 0:
            await self._pace()
        return node.assignment

    async def _pace(self) -> None:
        """A launch, a stop or a stack dump assigns to every node in one loop, and each
        assignment brings its node's answers back at once (the long-poll's response, the
        node's events, its next poll): about 1 ms of the loop's work per node. Issued 64
        per turn of the loop with only ``sleep(0)`` between, the answers of hundreds of
        nodes queued ahead of the heartbeats (beats waited 0.3-0.9 s in every stop and
        launch at 1,024 nodes). So after each burst the loop gets a turn of ``_PACE_S``,
        and more while it wakes from it late (it is still busy with the answers), up to
        ``_PACE_MAX_TURNS``: the next burst goes out once the last one's answers are in."""
        for _ in range(_PACE_MAX_TURNS):
            due = self._clock.monotonic() + _PACE_S
            await self._clock.sleep(_PACE_S)
            if self._clock.monotonic() - due < _PACE_S:
                return

    async def send_signal(self, node_id: str, rank: int, signal: str) -> None:
        """Ask the node's agent to send ``signal`` to ``rank`` once."""
        await self.send_signals(node_id, [(rank, signal)])

    async def send_signals(self, node_id: str, orders: Iterable[tuple[int, str]]) -> None:
        """Ask the node's agent to send each ``(rank, signal)`` once, in order: one
        assignment change for all of them (a stack dump of 8 ranks is one round trip)."""
        node = self.nodes[node_id]
        new = []
        for rank, signal in orders:
            self._signal_ids += 1
            new.append(SignalOrder(id=self._signal_ids, rank=rank, signal=signal))
        if not new:
            return
        kept = [*node.assignment.signals, *new][-max(32, len(new)):]
        await self.assign(node_id, signals=[o.model_dump() for o in kept])

    async def wait_assignment(self, node_id: str, after_version: int,
                              timeout: float) -> Assignment | None:
        """The node's assignment once its version exceeds ``after_version`` (or at timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (node := self.nodes.get(node_id)) is not None \
                and node.assignment.version <= after_version:
            left = deadline - loop.time()
            wake = self._wake.get(node_id)
            if left <= 0 or wake is None:
                break
            try:
                await asyncio.wait_for(wake.wait(), left)
            except TimeoutError:
                break
        node = self.nodes.get(node_id)
        return node.assignment if node else None

    # -- queries ---------------------------------------------------------------------------
    def with_state(self, *states: NodeState) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state in states]

    def active(self) -> list[NodeRecord]:
        nodes = self.with_state(NodeState.ACTIVE)
        return sorted(nodes, key=lambda n: n.node_rank if n.node_rank is not None else 1 << 30)

    def node_of_rank(self, rank: int, procs_per_node: int) -> NodeRecord | None:
        """The active node whose node rank holds global ``rank``, if any."""
        for node in self.active():
            if node.node_rank is not None and node.node_rank * procs_per_node <= rank < \
                    (node.node_rank + 1) * procs_per_node:
                return node
        return None

    def counts(self) -> dict[str, int]:
        return {s.value: self._counts[s] for s in NodeState}
