"""What agents tell the supervisor, and what it makes of it.

The API server hands every agent message to ``Intake``: registrations and heartbeats update
the node registry and the progress tracker at once; rank exits, starts, stops and worker
events go onto a queue that the supervisor's observe loop drains through ``judge``, which
turns them into a generation's outcome (completed, or failed with a cause).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.protocol import (
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
from orchestrator.state import Cause, JobState, NodeState
from orchestrator.supervisor.chaos import ChaosDriver
from orchestrator.supervisor.hangs import TrainingTimeout, find_hangs
from orchestrator.supervisor.nodes import NodeRecord, NodeRegistry
from orchestrator.supervisor.placement import Placement
from orchestrator.supervisor.progress import ProgressTracker

if TYPE_CHECKING:
    from orchestrator.supervisor.core import Outcome, Supervisor


@dataclass(frozen=True)
class Observation:
    kind: str  # exit | started | stopped | worker
    node_id: str
    payload: Any


class UnknownNode(LookupError):
    """A heartbeat or event from a node that has not registered (with this supervisor)."""


class Intake:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.cfg = sup.cfg
        self.nodes = NodeRegistry(sup.clock)
        self.queue: asyncio.Queue[Observation] = asyncio.Queue()
        self.progress = ProgressTracker(sup.rundir.steps, sup.clock, sup.record)
        self.chaos = ChaosDriver(sup.cfg.chaos, sup.cfg.cluster.world_size,
                                 sup.view.chaos_fired)
        self.generation: int | None = None
        self.world_size = 0
        self.started: dict[str, list[int]] = {}
        self.exits: dict[int, dict[str, Any]] = {}
        self.resume_max_step: int | None = None
        self.running_since: float | None = None
        self.training_timeout = TrainingTimeout(
            sup.cfg.timeouts, sup.view.calibration.get("max_interval_s"))

    # -- messages from agents (called by the API server) ------------------------------------
    def on_register(self, req: RegisterRequest) -> RegisterResponse:
        node, known = self.nodes.register(req)
        if req.assignment_version > node.assignment.version:
            node.assignment = node.assignment.model_copy(
                update={"version": req.assignment_version})
        if not known:
            previous = self.sup.view.nodes.get(req.node_id)
            if previous is not None and previous.state == NodeState.ACTIVE.value:
                node.state, node.node_rank = NodeState.ACTIVE, previous.node_rank
        if req.generation is not None and req.generation == self.generation:
            # Re-registration mid-generation (supervisor restart, network blip): the ranks
            # it reports alive count as started; exits it holds arrive as queued events.
            self.started[req.node_id] = [r.rank for r in req.ranks]
        self.sup.record("node_registered", node_id=req.node_id, host=req.host, addr=req.addr,
                        procs=req.procs, agent_pid=req.agent_pid, reregistered=known,
                        running_generation=req.generation)
        self.sup.log.info("node registered", node=req.node_id, host=req.host,
                          procs=req.procs, running_generation=req.generation)
        self._sync_node_metrics()
        return RegisterResponse(node_id=req.node_id, job=self.cfg.job.name,
                                config=self.cfg.model_dump(mode="json"),
                                heartbeat_interval_s=self.cfg.timeouts.heartbeat_interval_s)

    def on_heartbeat(self, hb: Heartbeat) -> dict[str, Any]:
        node = self.nodes.heartbeat(hb.node_id, hb.generation, hb.free_port, hb.ranks)
        if node is None:
            raise UnknownNode(hb.node_id)
        self.progress.on_ranks(hb.generation, hb.ranks)
        if hb.records:
            accepted = self.progress.on_records(hb.generation, hb.records)
            for rec in hb.records:
                self.sup.metrics.on_record(rec)
            if accepted and hb.generation is not None:
                self.sup.stability.on_records(hb.generation, hb.records)
        return {"assignment_version": node.assignment.version}

    def on_events(self, batch: EventBatch) -> None:
        if batch.node_id not in self.nodes.nodes:
            raise UnknownNode(batch.node_id)
        for event in batch.events:
            if isinstance(event, HealthReport):  # the health round waits on these itself
                self.sup.health.on_report(batch.node_id, event, self.sup.clock.time())
                continue
            kind = {RankExit: "exit", RanksStarted: "started", RanksStopped: "stopped",
                    WorkerEvent: "worker"}[type(event)]
            self.queue.put_nowait(Observation(kind, batch.node_id, event))

    async def poll_assignment(self, node_id: str, after: int,
                              timeout: float) -> Assignment | None:
        if node_id not in self.nodes.nodes:
            raise UnknownNode(node_id)
        return await self.nodes.wait_assignment(node_id, after, timeout)

    # -- generations -------------------------------------------------------------------------
    def begin_generation(self, generation: int, world_size: int, adopting: bool = False) -> None:
        self.generation, self.world_size = generation, world_size
        self.started, self.exits = {}, {}
        self.running_since = None
        known = adopting and generation in self.sup.view.first_steps
        self.progress.start_generation(generation, world_size, first_step_known=known)

    async def apply_placement(self, placement: Placement) -> None:
        for node_id, rank in placement.active.items():
            node = self.nodes.nodes[node_id]
            if node.state is not NodeState.ACTIVE or node.node_rank != rank:
                node.node_rank = rank
                self.set_node_state(node, NodeState.ACTIVE, node_rank=rank)
        for node_id in placement.spares:
            node = self.nodes.nodes[node_id]
            if node.state is not NodeState.SPARE:
                node.node_rank = None
                self.set_node_state(node, NodeState.SPARE, node_rank=None)

    def set_node_state(self, node: NodeRecord, state: NodeState, reason: str | None = None,
                       **fields: Any) -> None:
        node.state = state
        self.sup.record("node_state", node_id=node.node_id, state=state.value, reason=reason,
                        **fields)
        self._sync_node_metrics()

    def _sync_node_metrics(self) -> None:
        self.sup.metrics.set_nodes(self.nodes.counts())

    def all_started(self, generation: int) -> bool:
        return generation == self.generation and \
            sum(len(r) for r in self.started.values()) >= self.world_size

    def mark_silent_nodes_lost(self) -> list[NodeRecord]:
        limit = self.cfg.timeouts.node_lost_s
        lost = []
        for node in self.nodes.nodes.values():
            if node.state in (NodeState.ACTIVE, NodeState.SPARE, NodeState.REGISTERED) \
                    and self.nodes.silent_for(node) > limit:
                self.set_node_state(node, NodeState.LOST,
                                    reason=f"silent for {self.nodes.silent_for(node):.1f} s")
                self.sup.log.warning("node lost", node=node.node_id,
                                     silent_s=round(self.nodes.silent_for(node), 1))
                lost.append(node)
        return lost

    def judge(self, generation: int, obs: Observation | None) -> Outcome | None:
        """Fold one observation (or a quiet tick) into the generation's outcome, if any."""
        from orchestrator.supervisor.core import Outcome

        outcome = self._observe(generation, obs) if obs is not None else None
        # A pending rollback outranks whatever else this observation says (a rank that died
        # of a NaN, or even completion): the lineage diverged and must be rolled back.
        divergence = self.sup.stability.divergence(generation)
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
        from orchestrator.supervisor.core import Outcome

        gen = self.progress.current
        if gen is None or gen.generation != generation or \
                self.sup.view.state not in (JobState.LAUNCHING, JobState.RUNNING):
            return None
        suspects = find_hangs(gen, self.cfg.timeouts, self.training_timeout,
                              self.sup.clock.monotonic())
        if not suspects:
            return None
        first = suspects[0]
        node = self._node_of_rank(first.rank)
        return Outcome(Cause.HANG, {
            "rank": first.rank, "node_id": node.node_id if node else None,
            "message": first.describe(),
            "suspects": [{"rank": s.rank, "phase": s.phase, "step": s.step,
                          "idle_s": round(s.idle_s, 2), "silent": s.silent,
                          "beat_age_s": None if s.beat_age_s is None else round(s.beat_age_s, 2)}
                         for s in suspects]})

    def _generation_nodes(self) -> set[str]:
        launch = self.sup.view.launches[-1] if self.sup.view.launches else {}
        return set(launch.get("nodes", {}))

    def _observe(self, generation: int, obs: Observation) -> Outcome | None:
        from orchestrator.supervisor.core import Outcome

        ev = obs.payload
        if obs.kind == "stopped":
            node = self.nodes.nodes[obs.node_id]
            node.stopped_generation = ev.generation
            if ev.free_port:
                node.free_port = ev.free_port
            self.sup.record("ranks_stopped", node_id=obs.node_id, generation=ev.generation)
            return None
        if obs.kind == "worker":
            self._worker_event(obs.node_id, ev)
            return None
        if ev.generation != generation:
            return None  # a straggler from a generation already handled
        if obs.kind == "started":
            self.started[obs.node_id] = [r.rank for r in ev.ranks]
            self.sup.record("ranks_started", node_id=obs.node_id, generation=generation,
                            ranks=[{"rank": r.rank, "pid": r.pid} for r in ev.ranks])
            return None
        # a rank exit
        if ev.rank in self.exits:
            return None
        exit_info = {"rank": ev.rank, "node_id": obs.node_id, "pid": ev.pid,
                     "exit_code": ev.exit_code, "signal": ev.signal, "ts": ev.ts,
                     "log_tail": ev.log_tail}
        self.exits[ev.rank] = exit_info
        self.sup.record("rank_exited", generation=generation,
                        **{k: v for k, v in exit_info.items() if k != "ts"}, exit_ts=ev.ts)
        if ev.exit_code != 0 or ev.signal:
            return Outcome(Cause.WORKER_EXIT, exit_info)
        if len(self.exits) >= self.world_size and all(
                e["exit_code"] == 0 and not e["signal"] for e in self.exits.values()):
            return Outcome(Cause.COMPLETED, {})
        return None

    def _worker_event(self, node_id: str, ev: WorkerEvent) -> None:
        data = dict(ev.data)
        if ev.name == "checkpoint_committed":
            self.sup.record("checkpoint_committed", generation=ev.generation, rank=ev.rank,
                            **data)
        elif ev.name == "chaos":
            self.chaos.mark_fired(str(data.get("id")))
            self.sup.record("chaos", generation=ev.generation, node_id=node_id, **data)
            self.sup.log.warning("chaos: rank signalled itself", rank=ev.rank,
                                 signal=data.get("signal"), step=data.get("step"))
        elif ev.name == "checkpoint_pruned":
            self.sup.record("checkpoint_pruned", generation=ev.generation, **data)
        else:
            self.sup.record(ev.name if ev.name in _PLAIN_WORKER_EVENTS else "worker_event",
                            generation=ev.generation, rank=ev.rank, node_id=node_id,
                            **({} if ev.name in _PLAIN_WORKER_EVENTS else {"name": ev.name}),
                            **data)

    async def tick(self, generation: int) -> None:
        """Periodic work while a generation runs: calibration, interval chaos kills."""
        if self.training_timeout.needs_journal():
            self.sup.record("calibration", max_interval_s=self.training_timeout.max_interval,
                            training_timeout_s=round(self.training_timeout.value(), 3))
        if self.sup.view.state is JobState.RUNNING and self.running_since is None:
            self.running_since = self.sup.clock.monotonic()
        for inj in self.chaos.due_interval(self.running_since, self.sup.clock.monotonic()):
            node = self._node_of_rank(inj.rank)
            if node is None:
                continue
            self.sup.record("chaos", id=inj.id, rank=inj.rank, signal=inj.signal,
                            step=inj.step, node_id=node.node_id, generation=generation)
            self.sup.log.warning("chaos: signalling rank", rank=inj.rank, signal=inj.signal,
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
        message = detail.get("message") or _describe_exit(root)
        out = {"generation": generation, "cause": cause.value, "rank": root.get("rank"),
               "node_id": root.get("node_id"), "exit_code": root.get("exit_code"),
               "signal": root.get("signal"), "message": message,
               "log_tail": root.get("log_tail", []),
               "newest_checkpoint_step": self.sup.view.newest_checkpoint_step,
               "last_step": self.progress.current.last_step if self.progress.current else None,
               "other_exits": [{k: e[k] for k in ("rank", "exit_code", "signal")}
                               for e in failing[1:]]}
        for key in ("suspects", "stacks"):
            if key in detail:
                out[key] = detail[key]
        node = self.nodes.nodes.get(out["node_id"] or "")
        if node is not None:
            node.failure_times.append(self.sup.clock.time())
        return out


_PLAIN_WORKER_EVENTS = {"resumed", "checkpoint_failed", "checkpoint_skipped",
                        "checkpoint_fetched", "checkpoint_upload_retry",
                        "checkpoint_upload_failed", "checkpoint_upload_skipped",
                        "stability_skip", "startup"}


def _describe_exit(e: dict[str, Any]) -> str:
    if not e:
        return "unknown failure"
    where = f"rank {e.get('rank')} on node {e.get('node_id')}"
    if e.get("signal"):
        return f"{where} was killed by {e['signal']}"
    return f"{where} exited with code {e.get('exit_code')}"
