"""One launch of the job's ranks, judged: ``Generation`` turns what its ranks said into how
it ended.

Message intake (``supervisor.intake``) takes what agents send and queues the rank exits,
starts, stops and worker events; the generation's loop (``parts.GenerationParts``) hands each
batch of them to the ``Generation`` of that launch, which alone knows which of its ranks
started and which exited, and returns a typed ``Outcome`` (completed, or failed with a cause)
or None while the generation runs on. Silences and hangs are checked once per batch, from
the oldest node and rank only (``deadlines``).

A ``Generation`` lives for one launch: a new launch (or an adopted one, after a supervisor
restart) gets a new one, so nothing of a previous launch's ranks is carried into the next.
What outlives a launch (the node registry, progress tracking, the training timeout's
calibration, the stability hook, the straggler watch) is handed in as the narrow objects and
callables it needs. Between batches the loop calls ``tick``: the launch's periodic judgement
(the calibration journaled when it moved, stragglers named or cleared).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.contracts import events as ev
from orchestrator.contracts.protocol import RankExit, WorkerEvent
from orchestrator.contracts.state import Cause, JobState
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.generation.hangs import (
    Suspect,
    TrainingTimeout,
    any_overdue,
    find_hangs,
    silent_after_s,
)
from orchestrator.supervisor.generation.outcome import Outcome, exit_reason
from orchestrator.supervisor.generation.progress import ProgressTracker
from orchestrator.supervisor.nodes import NodeRecord, NodeRegistry


@dataclass(frozen=True)
class Observation:
    # exits: a list of one node's RankExit (what arrived together); started: RanksStarted;
    # stopped: RanksStopped; worker: a rank's WorkerEvent.
    kind: Literal["exits", "started", "stopped", "worker"]
    node_id: str
    payload: Any


class Generation:
    """One launch (``number``, ``world_size`` ranks): which ranks started and exited, and
    the outcome that ``judge`` finds in each batch of observations.

    ``progress`` and ``training_timeout`` judge hangs; ``divergence`` is the stability hook's
    pending rollback for a generation; ``mark_lost`` marks silent nodes lost and returns
    them; ``on_worker`` journals a rank's worker event (a node id and the message);
    ``stragglers`` judges the stragglers of a generation (journaling what changed).
    """

    def __init__(self, number: int, world_size: int, *, ctx: JobContext,
                 nodes: NodeRegistry, progress: ProgressTracker,
                 training_timeout: TrainingTimeout,
                 divergence: Callable[[int], dict[str, Any] | None],
                 mark_lost: Callable[[], list[NodeRecord]],
                 on_worker: Callable[[str, WorkerEvent], None],
                 stragglers: Callable[[int], object]) -> None:
        self.number = number
        self.world_size = world_size
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.nodes = nodes
        self.progress = progress
        self.training_timeout = training_timeout
        self._divergence = divergence
        self._mark_lost = mark_lost
        self._on_worker = on_worker
        self._stragglers = stragglers
        self.started: dict[str, list[int]] = {}
        self._started_count = 0  # sum of len(started[...]), kept as it changes
        self.exits: dict[int, dict[str, Any]] = {}

    # -- started ranks -----------------------------------------------------------------------
    def all_started(self) -> bool:
        return self._started_count >= self.world_size

    def set_started(self, node_id: str, ranks: list[int]) -> None:
        """The ranks of ``node_id`` that run this generation (its starts, what a node that
        registered again mid-generation reports alive, or what an adopted node ran before
        this supervisor listened)."""
        self._started_count += len(ranks) - len(self.started.get(node_id, ()))
        self.started[node_id] = ranks

    # -- judgement ---------------------------------------------------------------------------
    def judge(self, batch: list[Observation]) -> Outcome | None:
        """Fold every observation of ``batch`` (the first outcome wins; later ones are
        still journaled), then check silences and hangs once for the whole batch."""
        outcome = None
        for obs in batch:
            result = self._observe(obs)
            outcome = outcome or result
        # A pending rollback outranks whatever else this observation says (a rank that died
        # of a NaN, or even completion): the lineage diverged and must be rolled back.
        divergence = self._divergence(self.number)
        if divergence is not None:
            return Outcome(Cause.DIVERGENCE, divergence)
        if outcome is not None:
            return outcome
        lost = [n for n in self._mark_lost()
                if n.node_rank is not None and n.node_id in self._generation_nodes()]
        if lost:
            node = lost[0]
            return Outcome(Cause.NODE_LOST, {"node_id": node.node_id,
                                             "message": f"node {node.node_id} went silent"})
        return self._hang()

    def tick(self) -> None:
        """A turn of the loop: journal the training timeout's calibration once it moved
        enough (``TrainingTimeout.needs_journal``), then judge the launch's stragglers."""
        timeout = self.training_timeout
        if timeout.needs_journal():
            self.ctx.record(ev.Calibration(max_interval_s=timeout.max_interval,
                                           training_timeout_s=round(timeout.value(), 3),
                                           intervals=timeout.intervals))
        self._stragglers(self.number)

    def _hang(self) -> Outcome | None:
        gen = self.progress.current
        if gen is None or gen.generation != self.number or \
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
        node = self.nodes.node_of_rank(first.rank, self.cfg.cluster.procs_per_node)
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

    def _observe(self, obs: Observation) -> Outcome | None:
        msg = obs.payload
        if obs.kind == "stopped":
            self.nodes.nodes[obs.node_id].confirm_stop(msg.generation, msg.free_port)
            self.ctx.record(ev.RanksStopped(node_id=obs.node_id, generation=msg.generation))
            return None
        if obs.kind == "exits":
            return self._exits(obs.node_id, msg)
        if obs.kind == "worker":
            self._on_worker(obs.node_id, msg)
            return None
        if msg.generation != self.number:
            return None  # a straggler from a generation already handled
        self.set_started(obs.node_id, [r.rank for r in msg.ranks])
        self.ctx.record(ev.RanksStarted(
            node_id=obs.node_id, generation=self.number,
            ranks=[ev.RankPid(rank=r.rank, pid=r.pid) for r in msg.ranks]))
        return None

    def _exits(self, node_id: str, msgs: list[RankExit]) -> Outcome | None:
        """A node's exits that arrived together: one ``ranks_exited`` event; the outcome
        is that of the first failing exit (or completion once every rank exited 0)."""
        if msgs[0].generation != self.number:
            return None  # stragglers from a generation already handled
        taken = [(m, info) for m in msgs if (info := self._take_exit(node_id, m)) is not None]
        if not taken:
            return None
        self.ctx.record(ev.RanksExited(generation=self.number, node_id=node_id, exits=[
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

    # -- failure report ----------------------------------------------------------------------
    def root_cause(self, cause: Cause, detail: dict[str, Any]) -> dict:
        """The failure record: the earliest failing rank is the root cause."""
        failing = [e for e in self.exits.values() if e["exit_code"] != 0 or e["signal"]]
        failing.sort(key=lambda e: e["ts"])
        root = failing[0] if cause is Cause.WORKER_EXIT and failing else detail
        message = str(detail.get("message") or _describe_exit(root))[:4096]
        out = {"generation": self.number, "cause": cause.value, "rank": root.get("rank"),
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


def _describe_exit(e: dict[str, Any]) -> str:
    if not e:
        return "unknown failure"
    where = f"rank {e.get('rank')} on node {e.get('node_id')}"
    reason = exit_reason(e)  # its error file, a spawn's OS error, else its last line
    why = f": {reason}" if reason else ""
    if e.get("signal"):
        return f"{where} was killed by {e['signal']}{why}"
    return f"{where} exited with code {e.get('exit_code')}{why}"
