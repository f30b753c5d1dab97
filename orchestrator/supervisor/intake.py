"""What agents tell the supervisor: the message half of the control plane.

The API server hands every agent message to ``Intake``: registrations and heartbeats update
the node registry and the progress tracker at once; rank exits, starts, stops and worker
events go onto a queue that the generation's loop drains into the running launch's
``Generation`` (``generation.judge``), which alone decides how that launch ended. Intake
decides nothing about a generation's outcome; it keeps what the messages feed and what
outlives one launch (rank progress, the ranks' step times the straggler watch compares, the
resume check) and turns a rank's worker event into its journal event. What a message says beyond that goes to its owner as a callable: a node
running a superseded generation to ``supervisor.superseded``, a rank's fired injection to
the chaos desk (``supervisor.chaos``).

Sized for 2,048 nodes x 8 ranks: the exits of one node that arrive in one batch are one
observation (one ``ranks_exited`` journal event); a stop confirmation marks its node at
once (the stop does not wait for the queue to reach it); a registration retry that changes
nothing is not journaled again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.contracts import events as ev
from orchestrator.contracts.protocol import (
    Assignment,
    EventBatch,
    HealthReport,
    Heartbeat,
    RankExit,
    RanksStarted,
    RanksStopped,
    RegisterRequest,
    RegisterResponse,
    WorkerEvent,
)
from orchestrator.contracts.state import NodeState
from orchestrator.contracts.worker_events import NOTE_NAMES, OTHER_NOTE
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.generation.judge import Observation
from orchestrator.supervisor.nodes import NodeRecord, NodeRegistry
from orchestrator.supervisor.placement import Placement
from orchestrator.supervisor.generation.progress import ProgressTracker
from orchestrator.supervisor.recordgate import RecordGate
from orchestrator.supervisor.resumes import RESUME_EVENT, ResumeCheck
from orchestrator.supervisor.stability import StabilityHook
from orchestrator.supervisor.generation.stragglers import StragglerWatch


class UnknownNode(LookupError):
    """A heartbeat or event from a node that has not registered (with this supervisor)."""


@dataclass(frozen=True)
class IntakeFeed:
    """What a generation's launch, observation and stop (``generation.parts``) take from
    the intake, and no more: the queue they drain, the progress a launch's ``Generation``
    reads, and the calls that tell the intake which launch its news is for, mark silent
    nodes lost, journal a rank's worker event and judge the stragglers."""

    queue: asyncio.Queue[Observation]
    progress: ProgressTracker
    begin_generation: Callable[..., None]
    mark_silent_nodes_lost: Callable[[], list[NodeRecord]]
    worker_event: Callable[[str, WorkerEvent], None]
    stragglers_tick: Callable[[int], object]


class Intake:
    """Takes what agents say (through the API server) and queues what the running
    generation's ``Generation`` judges.

    ``health_report`` receives health-round reports (the health coordinator waits on them);
    ``note_superseded`` each node and the generation its registration or beat says it runs
    (``superseded.SupersededNodes.note``); ``chaos_fired`` the id of an injection a rank
    fired.
    """

    def __init__(self, ctx: JobContext, nodes: NodeRegistry, stability: StabilityHook,
                 health_report: Callable[[str, HealthReport, float], None], *,
                 note_superseded: Callable[[NodeRecord, int | None], None],
                 chaos_fired: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.nodes = nodes
        self.stability = stability
        self._health_report = health_report
        self._note_superseded = note_superseded
        self._chaos_fired = chaos_fired
        self.queue: asyncio.Queue[Observation] = asyncio.Queue()
        # Beats stamped and hangs judged on the service clock (``deadlines.LoopLag``).
        self.progress = ProgressTracker(ctx.rundir.steps, nodes.judge_clock, ctx.record)
        self.record_gate = RecordGate(ctx.cfg.api.max_step_records_per_s,
                                      nodes.judge_clock.monotonic)
        self.stragglers = StragglerWatch(ctx)
        self.resumes = ResumeCheck()
        self.generation: int | None = None  # the launch the queue's news is for
        # Where the ranks of a node that registers again mid-generation go (that launch's
        # ``Generation``): they count as started.
        self._live_ranks: Callable[[str, list[int]], None] | None = None
        self.rejected = 0  # messages a node sent that were not its to send, or did not parse
        self._config_json: dict[str, Any] | None = None

    # -- messages from agents (called by the API server) ------------------------------------
    def on_register(self, req: RegisterRequest) -> RegisterResponse:
        before = self.nodes.nodes.get(req.node_id)
        same = before is not None and before.usable and \
            (before.host, before.addr, before.procs, before.agent_pid, before.generation) == \
            (req.host, req.addr, req.procs, req.agent_pid, req.generation)
        node, known = self.nodes.register(req)
        if req.assignment_version > node.assignment.version:
            node.assignment = node.assignment.model_copy(
                update={"version": req.assignment_version})
        if not known:
            # A supervisor rebuilt from its journal: a node that was ACTIVE there comes back
            # ACTIVE with its node rank (journaled, as every node move is).
            previous = self.ctx.view.nodes.get(req.node_id)
            if previous is not None and previous.state == NodeState.ACTIVE.value:
                self.nodes.move(node, NodeState.ACTIVE, reason="active before the "
                                "supervisor restart", node_rank=previous.node_rank)
        self._note_superseded(node, req.generation)
        if req.generation is not None and req.generation == self.generation \
                and self._live_ranks is not None:
            # Re-registration mid-generation (supervisor restart, network blip): the ranks
            # it reports alive count as started; exits it holds arrive as queued events.
            self._live_ranks(req.node_id, [r.rank for r in req.ranks])
        if not same:  # a retry of a registration that already counted is not news
            self.ctx.record(ev.NodeRegistered(
                node_id=req.node_id, host=req.host[:256], addr=req.addr[:256],
                procs=req.procs, agent_pid=req.agent_pid, reregistered=known,
                running_generation=req.generation))
            self.ctx.log.info("node registered", node=req.node_id, host=req.host,
                              procs=req.procs, running_generation=req.generation)
            self.nodes.sync_counts()
        if self._config_json is None:  # the same for every node: dumped once
            self._config_json = self.cfg.model_dump(mode="json")
        return RegisterResponse(node_id=req.node_id, job=self.cfg.job.name,
                                config=self._config_json,
                                heartbeat_interval_s=self.cfg.timeouts.heartbeat_interval_s,
                                epoch=self.nodes.epoch)

    def on_heartbeat(self, hb: Heartbeat) -> dict[str, Any]:
        node = self.nodes.heartbeat(hb.node_id, hb.generation, hb.free_port, hb.ranks)
        if node is None:
            raise UnknownNode(hb.node_id)
        self._note_superseded(node, hb.generation)
        self.progress.on_ranks(hb.generation, hb.ranks)
        if hb.generation is not None and hb.generation == self.generation:
            self.stragglers.on_ranks(hb.node_id, hb.ranks)
        gen = self.progress.current
        if hb.records and gen is not None and hb.generation == gen.generation:
            # Admission let only rank 0's node send them, for the current generation.
            taken = self.record_gate.take(gen.generation, hb.records)
            if taken.over_rate:
                self.reject(hb.node_id, "heartbeat", f"{taken.over_rate} step records past "
                            f"api.max_step_records_per_s ({self.record_gate.per_s:g}) dropped")
            if taken.records and self.progress.on_records(gen.generation, taken.records):
                for rec in taken.records:
                    self.ctx.metrics.on_record(rec)
                self.stability.on_records(gen.generation, taken.records)
        return {"assignment_version": node.assignment.version}

    def on_events(self, batch: EventBatch) -> None:
        node = self.nodes.nodes.get(batch.node_id)
        if node is None:
            raise UnknownNode(batch.node_id)
        exits: list[RankExit] = []  # consecutive exits of one generation: one observation
        for event in batch.events:
            if exits and not (isinstance(event, RankExit)
                              and event.generation == exits[0].generation):
                self.queue.put_nowait(Observation("exits", batch.node_id, exits))
                exits = []
            if isinstance(event, RankExit):
                exits.append(event)
            elif isinstance(event, HealthReport):  # the health round waits on these itself
                self._health_report(batch.node_id, event, self.ctx.clock.time())
            else:
                if isinstance(event, RanksStopped):  # the stop waits on this, not the queue
                    node.confirm_stop(event.generation, event.free_port)
                kind = {RanksStarted: "started", RanksStopped: "stopped",
                        WorkerEvent: "worker"}[type(event)]
                self.queue.put_nowait(Observation(kind, batch.node_id, event))
        if exits:
            self.queue.put_nowait(Observation("exits", batch.node_id, exits))

    async def poll_assignment(self, node_id: str, after: int,
                              timeout: float) -> Assignment | None:
        if node_id not in self.nodes.nodes:
            raise UnknownNode(node_id)
        return await self.nodes.wait_assignment(node_id, after, timeout)

    # -- generations -------------------------------------------------------------------------
    def feed(self) -> IntakeFeed:
        """The part of the intake a generation's parts use (:class:`IntakeFeed`)."""
        return IntakeFeed(self.queue, self.progress, self.begin_generation,
                          self.mark_silent_nodes_lost, self.worker_event, self.stragglers.tick)

    def begin_generation(self, generation: int, world_size: int, adopting: bool = False,
                         live_ranks: Callable[[str, list[int]], None] | None = None) -> None:
        """``generation`` was launched (or adopted): the queue's news is for it from now on.
        ``live_ranks`` (its ``Generation.set_started``) takes the ranks a node registering
        again mid-generation reports alive."""
        self.generation, self._live_ranks = generation, live_ranks
        known = adopting and generation in self.ctx.view.first_steps
        self.progress.start_generation(generation, world_size, first_step_known=known)
        self.resumes.begin(generation)

    async def apply_placement(self, placement: Placement) -> None:
        for node_id, rank in placement.active.items():
            node = self.nodes.nodes[node_id]
            if node.state is not NodeState.ACTIVE or node.node_rank != rank:
                self.nodes.move(node, NodeState.ACTIVE, node_rank=rank)
        for node_id in placement.spares:
            node = self.nodes.nodes[node_id]
            if node.state is not NodeState.SPARE:
                self.nodes.move(node, NodeState.SPARE, node_rank=None)

    def mark_silent_nodes_lost(self) -> list[NodeRecord]:
        held = self.nodes.held_back
        lost = self.nodes.mark_silent_lost(self.cfg.timeouts.node_lost_s)
        if self.nodes.held_back != held and self.nodes.held_back % 50 == 1:
            self.ctx.log.warning("many nodes silent at once: waiting longer before calling "
                                 "them lost (supervisor or network overloaded?)",
                                 checks_held_back=self.nodes.held_back)
        for node in lost:
            self.ctx.log.warning("node lost", node=node.node_id,
                                 silent_s=round(self.nodes.silent_for(node), 1),
                                 judged_silent_s=round(self.nodes.judged_silence(node), 1))
        return lost

    def worker_event(self, node_id: str, msg: WorkerEvent) -> None:
        """Journal a rank's event as its type. The rank, generation and node come from the
        message's envelope, never from its data; data that do not fit the event's model are
        rejected (journaled as ``message_rejected``), never half-applied."""
        data = {k: v for k, v in dict(msg.data).items() if k not in ev.RESERVED_KEYS}
        where = {"generation": msg.generation, "rank": msg.rank}
        try:
            if msg.name == "checkpoint_committed":
                self.ctx.record(ev.CheckpointCommitted(**data, **where))
            elif msg.name == "checkpoint_pruned":
                self.ctx.record(ev.CheckpointPruned(**data, **where))
            elif msg.name == "chaos":
                event = ev.Chaos(**{"id": str(data.pop("id", ""))[:256], **data},
                                 generation=msg.generation, node_id=node_id)
                self._chaos_fired(event.id)
                self.ctx.record(event)
                self.ctx.log.warning("chaos: rank signalled itself", rank=msg.rank,
                                     signal=event.signal, step=event.step)
            elif msg.name == "profile_written":
                self.ctx.record(ev.ProfileWritten(**data, **where, node_id=node_id))
            elif msg.name == "profile_failed":
                self.ctx.record(ev.ProfileFailed(**data, **where, node_id=node_id))
                self.ctx.log.warning("profile failed", rank=msg.rank, error=data.get("error"))
            elif msg.name == "restore_tier":
                self.ctx.record(ev.RestoreTier(node_id=node_id, **data, **where))
            elif msg.name == "memory_tier":
                self.ctx.record(ev.MemoryTier(node_id=node_id, **data, **where))
            elif msg.name in NOTE_NAMES:
                self.ctx.record(ev.WorkerNote(kind=msg.name, node_id=node_id, **data, **where))
            else:
                self.ctx.record(ev.WorkerNote(kind=OTHER_NOTE, name=msg.name,
                                              node_id=node_id, **data, **where))
                if msg.name == RESUME_EVENT and isinstance(data.get("step"), int):
                    self._resumed(msg.generation, msg.rank, data["step"])
        except (ValidationError, ValueError, TypeError) as exc:
            self.reject(node_id, "events", f"worker event {msg.name!r} of rank {msg.rank}: "
                        f"{_first_problem(exc)}")

    def _resumed(self, generation: int | None, rank: int, step: int) -> None:
        warning = self.resumes.note(generation, rank, step)
        if warning:
            self.ctx.record(ev.ResumeMismatch(
                generation=generation, message=warning,
                steps={str(r): s for r, s in list(self.resumes.steps.items())[:4096]}))
            self.ctx.log.warning("ranks resumed from different steps", generation=generation,
                                 steps=dict(list(self.resumes.steps.items())[:16]))

    def reject(self, node_id: str | None, route: str, reason: str) -> None:
        """A message that was not the node's to send, or did not fit its type: journaled
        (bounded: the first 100, then every 1,000th) and logged; nothing else changes."""
        self.rejected += 1
        if self.rejected <= 100 or self.rejected % 1000 == 0:
            self.ctx.record(ev.MessageRejected(node_id=(node_id or "")[:256] or None,
                                               route=route[:256], reason=reason[:4096],
                                               count=self.rejected))
            self.ctx.log.warning("message rejected", node=node_id, route=route,
                                 reason=reason[:500], rejected_so_far=self.rejected)


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False)[0]
        return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"[:300]
    return str(exc)[:300]
