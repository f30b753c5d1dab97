"""What agents tell the supervisor, and what it makes of it.

The API server hands every agent message to ``Intake``: registrations and heartbeats update
the node registry and the progress tracker at once; rank exits, starts, stops and worker
events go onto a queue that the supervisor's observe loop drains through ``judge``, which
turns them into a generation's outcome (completed, or failed with a cause).

Sized for 2,048 nodes x 8 ranks: the exits of one node that arrive in one batch are one
observation and one ``ranks_exited`` journal event; a stop confirmation marks its node at
once (the stop does not wait for the queue to reach it); a registration retry that changes
nothing is not journaled again; silences and hangs are checked once per batch of
observations, from the oldest node and rank only (``deadlines``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.contracts import events as ev
from orchestrator.contracts.chaos import ChaosDriver
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
from orchestrator.contracts.state import Cause, JobState, NodeState
from orchestrator.contracts.worker_events import NOTE_NAMES, OTHER_NOTE
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.generation.hangs import (
    Suspect,
    TrainingTimeout,
    any_overdue,
    find_hangs,
    silent_after_s,
)
from orchestrator.supervisor.nodes import NodeRecord, NodeRegistry
from orchestrator.supervisor.generation.outcome import Outcome, exit_reason
from orchestrator.supervisor.placement import Placement
from orchestrator.supervisor.generation.progress import ProgressTracker
from orchestrator.supervisor.recordgate import RecordGate
from orchestrator.supervisor.resumes import RESUME_EVENT, ResumeCheck
from orchestrator.supervisor.stability import StabilityHook
from orchestrator.supervisor.generation.stragglers import StragglerWatch


@dataclass(frozen=True)
class Observation:
    kind: str  # exit | exits (a list of one node's RankExit) | started | stopped | worker
    node_id: str
    payload: Any


class UnknownNode(LookupError):
    """A heartbeat or event from a node that has not registered (with this supervisor)."""


class Intake:
    """Takes what agents say (through the API server) and judges the generation by it.

    ``health_report`` receives health-round reports (the health coordinator waits on them).
    """

    def __init__(self, ctx: JobContext, nodes: NodeRegistry, stability: StabilityHook,
                 health_report: Callable[[str, HealthReport, float], None]) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.nodes = nodes
        self.stability = stability
        self._health_report = health_report
        self.queue: asyncio.Queue[Observation] = asyncio.Queue()
        # Beats stamped and hangs judged on the service clock (``deadlines.LoopLag``).
        self.progress = ProgressTracker(ctx.rundir.steps, nodes.judge_clock, ctx.record)
        self.record_gate = RecordGate(ctx.cfg.api.max_step_records_per_s,
                                      nodes.judge_clock.monotonic)
        self.stragglers = StragglerWatch(ctx)
        self.resumes = ResumeCheck()
        self.chaos = ChaosDriver(ctx.cfg.chaos, ctx.cfg.cluster.world_size,
                                 ctx.view.chaos_fired)
        self.generation: int | None = None
        self.world_size = 0
        self.started: dict[str, list[int]] = {}
        self._started_count = 0  # sum of len(started[...]), kept as it changes
        self.exits: dict[int, dict[str, Any]] = {}
        self.rejected = 0  # messages a node sent that were not its to send, or did not parse
        # Nodes that said they run a generation older than the newest launched (a node that
        # was lost and came back with its ranks): told to stop them at the next tick.
        self.superseded: set[str] = set()
        self._config_json: dict[str, Any] | None = None
        self.running_since: float | None = None
        self.training_timeout = TrainingTimeout(
            ctx.cfg.timeouts, ctx.view.calibration.get("max_interval_s"),
            ctx.view.calibration.get("intervals") or 0)

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
        if req.generation is not None and req.generation == self.generation:
            # Re-registration mid-generation (supervisor restart, network blip): the ranks
            # it reports alive count as started; exits it holds arrive as queued events.
            self._set_started(req.node_id, [r.rank for r in req.ranks])
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

    def _note_superseded(self, node: NodeRecord, generation: int | None) -> None:
        """A node whose ranks run a generation older than the newest launched was lost
        and is back: it never rejoins that generation (its peers have moved on)."""
        if generation is not None and generation < self.ctx.view.generation \
                and self._told_to_run_old(node):
            self.superseded.add(node.node_id)

    def _told_to_run_old(self, node: NodeRecord) -> bool:
        """Its assignment still runs (or stops) an old generation: not yet told otherwise
        (an active node told to run the newest one is on its way there)."""
        a = node.assignment
        return a.action in ("run", "stop") and a.generation != self.ctx.view.generation

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
                if isinstance(event, RanksStopped):
                    self._stop_confirmed(node, event)  # the stop waits on this, not the queue
                kind = {RanksStarted: "started", RanksStopped: "stopped",
                        WorkerEvent: "worker"}[type(event)]
                self.queue.put_nowait(Observation(kind, batch.node_id, event))
        if exits:
            self.queue.put_nowait(Observation("exits", batch.node_id, exits))

    @staticmethod
    def _stop_confirmed(node: NodeRecord, msg: RanksStopped) -> None:
        node.stopped_generation = msg.generation
        if msg.free_port:
            node.free_port = msg.free_port

    async def poll_assignment(self, node_id: str, after: int,
                              timeout: float) -> Assignment | None:
        if node_id not in self.nodes.nodes:
            raise UnknownNode(node_id)
        return await self.nodes.wait_assignment(node_id, after, timeout)

    # -- generations -------------------------------------------------------------------------
    def begin_generation(self, generation: int, world_size: int, adopting: bool = False) -> None:
        self.generation, self.world_size = generation, world_size
        self.started, self.exits, self._started_count = {}, {}, 0
        self.running_since = None
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

    def all_started(self, generation: int) -> bool:
        return generation == self.generation and self._started_count >= self.world_size

    def _set_started(self, node_id: str, ranks: list[int]) -> None:
        self._started_count += len(ranks) - len(self.started.get(node_id, ()))
        self.started[node_id] = ranks

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

    def judge(self, generation: int, obs: Observation | None) -> Outcome | None:
        """Fold one observation (or a quiet tick) into the generation's outcome, if any."""
        return self.judge_batch(generation, [] if obs is None else [obs])

    def judge_batch(self, generation: int, batch: list[Observation]) -> Outcome | None:
        """Fold every observation of ``batch`` (the first outcome wins; later ones are
        still journaled), then check silences and hangs once for the whole batch."""
        outcome = None
        for obs in batch:
            result = self._observe(generation, obs)
            outcome = outcome or result
        # A pending rollback outranks whatever else this observation says (a rank that died
        # of a NaN, or even completion): the lineage diverged and must be rolled back.
        divergence = self.stability.divergence(generation)
        if divergence is not None:
            return Outcome(Cause.DIVERGENCE, divergence)
        if outcome is not None:
            return outcome
        lost = [n for n in self.mark_silent_nodes_lost()
                if n.node_rank is not None and n.node_id in self._generation_nodes()]
        if lost:
            node = lost[0]
            return Outcome(Cause.NODE_LOST, {"node_id": node.node_id,
                                             "message": f"node {node.node_id} went silent"})
        return self._hang(generation)

    def _hang(self, generation: int) -> Outcome | None:
        gen = self.progress.current
        if gen is None or gen.generation != generation or \
                self.ctx.view.state not in (JobState.LAUNCHING, JobState.RUNNING):
            return None
        now = self.nodes.service_time()
        if not any_overdue(gen, self.cfg.timeouts, self.training_timeout, now):
            return None
        suspects = self._beating(find_hangs(gen, self.cfg.timeouts, self.training_timeout,
                                            now))
        if not suspects:
            return None
        first = suspects[0]
        node = self._node_of_rank(first.rank)
        return Outcome(Cause.HANG, {
            "rank": first.rank, "node_id": node.node_id if node else None,
            "message": first.describe(),
            "suspects": [{"rank": s.rank, "phase": s.phase, "step": s.step,
                          "idle_s": round(s.idle_s, 2), "silent": s.silent,
                          "timeout_s": round(s.timeout_s, 3),
                          "beat_age_s": None if s.beat_age_s is None else round(s.beat_age_s, 2)}
                         for s in suspects]})

    def _beating(self, suspects: list[Suspect]) -> list[Suspect]:
        """The suspects, once every suspect's node still beats; none while one's node is
        quiet. A rank quiet because its whole node went quiet is the node-loss check's to
        judge (with its grace for many silent nodes at once): under a burst of late beats
        every rank of the late nodes looked hung before any node was due to be lost. And no
        other suspect is named meanwhile: with the stopped rank's node late to beat (3 s on
        a loaded CI host), its blocked peer was named as the hang instead of it. The
        judgement waits for that node's next beat, or for its loss."""
        if not suspects:
            return suspects
        launch = self.ctx.view.launches[-1] if self.ctx.view.launches else {}
        by_rank = {rank: node_id for node_id, rank in launch.get("nodes", {}).items()}
        ppn = self.cfg.cluster.procs_per_node
        quiet = silent_after_s(self.cfg.timeouts.heartbeat_interval_s)
        for s in suspects:
            node = self.nodes.nodes.get(by_rank.get(s.rank // ppn, ""))
            if node is not None and self.nodes.judged_silence(node) > quiet:
                return []
        return suspects

    def _generation_nodes(self) -> set[str]:
        launch = self.ctx.view.launches[-1] if self.ctx.view.launches else {}
        return set(launch.get("nodes", {}))

    def _observe(self, generation: int, obs: Observation) -> Outcome | None:
        msg = obs.payload
        if obs.kind == "stopped":
            self._stop_confirmed(self.nodes.nodes[obs.node_id], msg)
            self.ctx.record(ev.RanksStopped(node_id=obs.node_id, generation=msg.generation))
            return None
        if obs.kind == "exits":
            return self._exits(generation, obs.node_id, msg)
        if obs.kind == "worker":
            self._worker_event(obs.node_id, msg)
            return None
        if msg.generation != generation:
            return None  # a straggler from a generation already handled
        if obs.kind == "started":
            self._set_started(obs.node_id, [r.rank for r in msg.ranks])
            self.ctx.record(ev.RanksStarted(
                node_id=obs.node_id, generation=generation,
                ranks=[ev.RankPid(rank=r.rank, pid=r.pid) for r in msg.ranks]))
            return None
        # a rank exit
        info = self._take_exit(obs.node_id, msg)
        if info is None:
            return None
        self.ctx.record(ev.RankExited(generation=generation, exit_ts=msg.ts,
                                      **{k: v for k, v in info.items() if k != "ts"}))
        return self._exit_outcome(info)

    def _exits(self, generation: int, node_id: str, msgs: list[RankExit]) -> Outcome | None:
        """A node's exits that arrived together: one ``ranks_exited`` event; the outcome
        is that of the first failing exit (or completion once every rank exited 0)."""
        if msgs[0].generation != generation:
            return None  # stragglers from a generation already handled
        taken = [(m, info) for m in msgs if (info := self._take_exit(node_id, m)) is not None]
        if not taken:
            return None
        self.ctx.record(ev.RanksExited(generation=generation, node_id=node_id, exits=[
            ev.RankExit(exit_ts=m.ts, **{k: v for k, v in info.items()
                                        if k not in ("ts", "node_id")})
            for m, info in taken]))
        outcome = None
        for _, info in taken:
            outcome = outcome or self._exit_outcome(info)
        return outcome

    def _take_exit(self, node_id: str, msg: RankExit) -> dict[str, Any] | None:
        """Note a rank's first exit in this generation (None: a repeat, or not our rank)."""
        if msg.rank in self.exits or not 0 <= msg.rank < self.world_size:
            return None
        exit_info = {"rank": msg.rank, "node_id": node_id, "pid": msg.pid,
                     "exit_code": msg.exit_code, "signal": msg.signal, "ts": msg.ts,
                     "log_tail": [line[:2048] for line in msg.log_tail[-200:]]}
        error = getattr(msg, "error", None)
        if error:
            exit_info["error"] = error
        self.exits[msg.rank] = exit_info
        return exit_info

    def _exit_outcome(self, info: dict[str, Any]) -> Outcome | None:
        if info["exit_code"] != 0 or info["signal"]:
            return Outcome(Cause.WORKER_EXIT, info)
        if len(self.exits) >= self.world_size and all(
                e["exit_code"] == 0 and not e["signal"] for e in self.exits.values()):
            return Outcome(Cause.COMPLETED, {})
        return None

    def _worker_event(self, node_id: str, msg: WorkerEvent) -> None:
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
                self.chaos.mark_fired(event.id)
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

    async def tick(self, generation: int) -> None:
        """Periodic work while a generation runs: calibration, interval chaos kills."""
        if self.training_timeout.needs_journal():
            self.ctx.record(ev.Calibration(
                max_interval_s=self.training_timeout.max_interval,
                training_timeout_s=round(self.training_timeout.value(), 3),
                intervals=self.training_timeout.intervals))
        if self.ctx.view.state is JobState.RUNNING and self.running_since is None:
            self.running_since = self.ctx.clock.monotonic()
        self.stragglers.tick(generation)
        while self.superseded:
            node_id = self.superseded.pop()
            node = self.nodes.nodes.get(node_id)
            if node is None or not self._told_to_run_old(node):
                continue
            self.ctx.log.warning("node runs a superseded generation: told to stop its ranks",
                                 node=node_id, runs=node.generation, current=generation)
            await self.nodes.assign(node_id, action="idle", generation=None)
            if node.state is NodeState.REGISTERED:  # back after being lost: a spare now
                self.nodes.move(node, NodeState.SPARE, node_rank=None,
                                reason="back after its generation was superseded")
        for inj in self.chaos.due_interval(self.running_since, self.ctx.clock.monotonic()):
            node = self._node_of_rank(inj.rank)
            if node is None:
                continue
            self.ctx.record(ev.Chaos(id=str(inj.id), rank=inj.rank, signal=inj.signal,
                                     step=inj.step, node_id=node.node_id,
                                     generation=generation))
            self.ctx.log.warning("chaos: signalling rank", rank=inj.rank, signal=inj.signal,
                                 at_step=inj.step)
            await self.nodes.send_signal(node.node_id, inj.rank, inj.signal)

    def _node_of_rank(self, rank: int) -> NodeRecord | None:
        ppn = self.cfg.cluster.procs_per_node
        for node in self.nodes.active():
            if node.node_rank is not None and node.node_rank * ppn <= rank < \
                    (node.node_rank + 1) * ppn:
                return node
        return None

    # -- failure report ----------------------------------------------------------------------
    def root_cause(self, generation: int, cause: Cause, detail: dict[str, Any]) -> dict:
        """The failure record: the earliest failing rank is the root cause."""
        failing = [e for e in self.exits.values() if e["exit_code"] != 0 or e["signal"]]
        failing.sort(key=lambda e: e["ts"])
        root = failing[0] if cause is Cause.WORKER_EXIT and failing else detail
        message = str(detail.get("message") or _describe_exit(root))[:4096]
        out = {"generation": generation, "cause": cause.value, "rank": root.get("rank"),
               "node_id": root.get("node_id"), "exit_code": root.get("exit_code"),
               "signal": root.get("signal"), "message": message,
               "log_tail": root.get("log_tail", []),
               "newest_checkpoint_step": self.ctx.view.newest_checkpoint_step,
               "newest_memory_step": self.progress.memory_step,
               "last_step": self.progress.current.last_step if self.progress.current else None,
               "other_exits": [{k: e[k] for k in ("rank", "exit_code", "signal")}
                               for e in failing[1:_MAX_LISTED + 1]]}
        if root.get("error"):
            out["error"] = root["error"]
        for key in ("suspects", "stacks"):  # the first ones; every stack file is in stacks/
            if key in detail:
                out[key] = detail[key][:_MAX_LISTED]
        return out


# A failure lists this many other exits, suspects and stack files at most (at 2,048 x 8 a
# stop's SIGTERMs are 16k "other exits"): the earliest, which are the ones that explain it.
_MAX_LISTED = 256


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False)[0]
        return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"[:300]
    return str(exc)[:300]


def _describe_exit(e: dict[str, Any]) -> str:
    if not e:
        return "unknown failure"
    where = f"rank {e.get('rank')} on node {e.get('node_id')}"
    reason = exit_reason(e)  # its error file, a spawn's OS error, else its last line
    why = f": {reason}" if reason else ""
    if e.get("signal"):
        return f"{where} was killed by {e['signal']}{why}"
    return f"{where} exited with code {e.get('exit_code')}{why}"
