"""A job's state as folded from its journal: what the supervisor rebuilds and ``status`` shows.

One owner for "what does the journal say": the live supervisor applies each event it writes,
a restarted supervisor replays the file, and ``orchestrator status`` replays it too, so all
three always agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.contracts import events as ev
from orchestrator.contracts.events import Envelope, as_envelope
from orchestrator.contracts.rundir import is_remote
from orchestrator.contracts.state import Cause, JobState


def _newest(*steps: Any) -> int | None:
    """The largest of ``steps`` that are step numbers (None when none is)."""
    found = [s for s in steps if isinstance(s, int) and not isinstance(s, bool)]
    return max(found) if found else None


def _tier_of(path: str | None) -> str:
    """Events written before tiers existed name no tier: a URL is remote, a path local."""
    return "remote" if is_remote(path) else "local"


@dataclass
class NodeView:
    node_id: str
    host: str = ""
    state: str = "registered"
    node_rank: int | None = None
    agent_pid: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class JobView:
    """The fold of a journal. ``apply`` takes events in journal order."""

    job: str = ""
    run_dir: str = ""
    config_hash: str = ""
    world_size: int = 0
    total_steps: int = 0
    checkpoint_root: str = ""
    state: JobState = JobState.PENDING
    generation: int = 0
    created_ts: float | None = None
    ended_ts: float | None = None
    last_ts: float | None = None
    last_step: int = 0
    tokens: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    pruned: set[tuple[int, str]] = field(default_factory=set)  # (step, tier)
    nodes: dict[str, NodeView] = field(default_factory=dict)
    chaos_fired: set[str] = field(default_factory=set)
    launches: list[dict[str, Any]] = field(default_factory=list)
    supervisor_starts: list[dict[str, Any]] = field(default_factory=list)
    calibration: dict[str, Any] = field(default_factory=dict)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    skip_windows: list[list[int]] = field(default_factory=list)
    lr_scale: float = 1.0
    stability_events: int = 0
    stability_counts: dict[str, int] = field(default_factory=dict)
    divergence: dict[str, Any] | None = None  # a rollback asked for and not yet carried out
    last_failure_reason: str | None = None
    ended_by: Cause | None = None  # what ended the newest generation (a failure, a stop)
    resume_mismatch: dict[str, Any] | None = None  # ranks resumed from different steps
    health: list[dict[str, Any]] = field(default_factory=list)
    first_steps: dict[int, int] = field(default_factory=dict)
    recovery_delay_s: float | None = None  # the backoff of the newest RECOVERING move
    segments: int = 1  # a stopped job continued with `up --resume` starts another
    own_script: bool = False  # job.entrypoint: the user's script, its own checkpoints
    # Profiles by id: the request, and each rank's trace (or failure) as it arrives.
    profiles: dict[int, dict[str, Any]] = field(default_factory=dict)
    stragglers: dict[str, dict[str, Any]] = field(default_factory=dict)  # named now, by node
    straggler_log: list[dict[str, Any]] = field(default_factory=list)  # the newest 100
    memory_tier: dict[str, Any] | None = None  # the newest memory_tier report
    restore_tiers: list[dict[str, Any]] = field(default_factory=list)  # per generation

    @classmethod
    def from_events(cls, events: Iterable[Envelope | dict[str, Any]]) -> JobView:
        view = cls()
        for event in events:
            view.apply(event)
        return view

    # -- folding ---------------------------------------------------------------------------
    def apply(self, env: Envelope | dict[str, Any]) -> None:
        """Fold one event. A raw dict (a test's, a tool's) is parsed first; one that does
        not parse is ignored, as the journal reader would skip its line."""
        parsed = as_envelope(env)
        if parsed is None:
            return
        env = parsed
        self.last_ts = env.ts
        handler = getattr(self, f"_on_{env.event.kind}", None)
        if handler is not None:
            handler(env.event, env.ts)

    def _on_job_created(self, e: ev.JobCreated, ts: float) -> None:
        self.job, self.run_dir, self.config_hash = e.job, e.run_dir, e.config_hash
        self.world_size, self.total_steps = e.world_size, e.steps
        self.checkpoint_root = e.checkpoint_root
        self.own_script = e.own_script
        self.created_ts = ts

    def _on_memory_tier(self, e: ev.MemoryTier, ts: float) -> None:
        self.memory_tier = {**e.fields(), "ts": ts}

    def _on_restore_tier(self, e: ev.RestoreTier, ts: float) -> None:
        self.restore_tiers.append({k: v for k, v in e.fields().items()
                                   if k in ("generation", "tier", "step", "reason")})
        del self.restore_tiers[:-20]

    def _on_supervisor_started(self, e: ev.SupervisorStarted, ts: float) -> None:
        self.supervisor_starts.append({"ts": ts, "pid": e.pid, "resumed": e.resumed})

    def _on_transition(self, e: ev.Transition, ts: float) -> None:
        if e.to is JobState.PENDING and self.state is JobState.STOPPED:
            self.segments += 1  # the operator continued a stopped job
            self.ended_ts = None
        self.state = e.to
        if e.to is JobState.STOPPED:
            self.ended_by = Cause.OPERATOR
        if e.to is JobState.RECOVERING:
            self.recovery_delay_s = e.delay_s
        if self.state.terminal:
            self.ended_ts = ts
            if self.state is JobState.FAILED:
                self.last_failure_reason = e.reason

    def _on_node_registered(self, e: ev.NodeRegistered, ts: float) -> None:
        node = self.nodes.setdefault(e.node_id, NodeView(e.node_id))
        node.host = e.host or node.host
        node.agent_pid = e.agent_pid if e.agent_pid is not None else node.agent_pid
        node.history.append({"ts": ts, "event": "registered"})

    def _on_node_state(self, e: ev.NodeStateChanged, ts: float) -> None:
        node = self.nodes.setdefault(e.node_id, NodeView(e.node_id))
        node.state = e.state.value
        if "node_rank" in e.model_fields_set:
            node.node_rank = e.node_rank
        node.history.append({"ts": ts, "event": e.state.value, "reason": e.reason})

    def _on_generation_launched(self, e: ev.GenerationLaunched, ts: float) -> None:
        self.generation = e.generation
        self.stragglers = {}  # a new generation is judged afresh
        self.launches.append({**e.fields(), "ts": ts})
        # A generation after an operator's stop continues the job (up --resume): no restart,
        # and none of the restart budget spent.
        if self.generation > 1 and e.after_cause not in (None, Cause.OPERATOR):
            self.restarts.append({"generation": self.generation, "ts": ts,
                                  "cause": e.after_cause.value if e.after_cause else None,
                                  "resume_step": e.resume_step})

    def _on_resume_mismatch(self, e: ev.ResumeMismatch, ts: float) -> None:
        self.resume_mismatch = {"generation": e.generation, "message": e.message, "ts": ts}

    def _on_failure(self, e: ev.Failure, ts: float) -> None:
        self.failures.append({**e.fields(), "ts": ts})
        self.ended_by = e.cause
        node = self.nodes.get(e.node_id or "")
        if node is not None:
            node.history.append({"ts": ts, "event": "failure",
                                 "reason": f"{e.cause.value}: {e.message}"})

    def _on_checkpoint_committed(self, e: ev.CheckpointCommitted, ts: float) -> None:
        tier = e.tier or _tier_of(e.path)
        self.checkpoints = [c for c in self.checkpoints
                            if (c["step"], c["tier"]) != (e.step, tier)]
        self.checkpoints.append({"step": e.step, "path": e.path, "tier": tier,
                                 "tokens": e.tokens, "ts": ts, "generation": e.generation})
        self.checkpoints.sort(key=lambda c: (c["step"], c["tier"]))
        self.pruned.discard((e.step, tier))  # saved again after a rollback pruned it
        if (e.step, "*") in self.pruned:
            self.pruned.discard((e.step, "*"))
            self.pruned.update((e.step, t) for t in ("local", "remote") if t != tier)

    def _on_checkpoint_pruned(self, e: ev.CheckpointPruned, ts: float) -> None:
        # No tier named: pruned everywhere ("*"), e.g. a rollback discarding its lineage.
        tiers = [e.tier] if e.tier else ["*"]
        self.pruned.update((s, t) for s in e.steps for t in tiers)

    def _on_first_step(self, e: ev.FirstStep, ts: float) -> None:
        self.first_steps[e.generation] = e.step

    def _on_progress(self, e: ev.Progress, ts: float) -> None:
        self.last_step = e.step
        self.tokens = e.tokens if e.tokens is not None else self.tokens

    def _on_chaos(self, e: ev.Chaos, ts: float) -> None:
        self.chaos_fired.add(e.id)

    def _on_calibration(self, e: ev.Calibration, ts: float) -> None:
        self.calibration = {**e.fields(), "ts": ts}

    def _on_rollback(self, e: ev.Rollback, ts: float) -> None:
        self.rollbacks.append({**e.fields(), "ts": ts})
        if e.skip_window:
            self.skip_windows.append(list(e.skip_window))
        self.lr_scale = e.lr_scale_total
        self.divergence = None

    def _on_stability(self, e: ev.StabilityFired, ts: float) -> None:
        self.stability_events += 1
        self.stability_counts[e.event] = self.stability_counts.get(e.event, 0) + 1
        # The first rollback-action firing of a generation is the one the supervisor acts on.
        first = self.divergence is None or self.divergence.get("generation") != e.generation
        if e.action in ("rollback", "lower_lr") and first:
            self.divergence = {**e.fields(), "ts": ts}

    def _on_profile_requested(self, e: ev.ProfileRequested, ts: float) -> None:
        self.profiles[e.id] = {**e.fields(), "ts": ts, "written": {}, "failed": {}}

    def _on_profile_written(self, e: ev.ProfileWritten, ts: float) -> None:
        profile = self.profiles.get(e.id)
        if profile is not None:
            profile["written"][e.rank] = {**e.fields(), "ts": ts}

    def _on_profile_failed(self, e: ev.ProfileFailed, ts: float) -> None:
        profile = self.profiles.get(e.id or -1)
        if profile is not None:
            profile["failed"][e.rank] = e.error

    def _on_straggler(self, e: ev.Straggler, ts: float) -> None:
        entry = {**e.fields(), "ts": ts}
        if e.action == "named":
            self.stragglers[e.node_id] = entry
        else:
            self.stragglers.pop(e.node_id, None)
        self.straggler_log = [*self.straggler_log[-99:], entry]

    def _on_health(self, e: ev.HealthResult, ts: float) -> None:
        self.health.append({**e.fields(), "ts": ts})

    # -- derived -----------------------------------------------------------------------------
    @property
    def pruned_steps(self) -> set[int]:
        """Steps pruned from some tier (a rollback prunes every tier of a discarded step)."""
        return {step for step, _ in self.pruned}

    @property
    def committed_checkpoints(self) -> list[dict[str, Any]]:
        """Checkpoints committed and not pruned since, one entry per step (oldest first) with
        the tiers holding it: ``tier`` is "local", "remote" or "local+remote", ``paths`` maps
        each tier to its URL, and ``path`` is the copy a restart prefers (the local one)."""
        by_step: dict[int, dict[str, Any]] = {}
        for c in self.checkpoints:
            if (c["step"], c["tier"]) in self.pruned or (c["step"], "*") in self.pruned:
                continue
            entry = by_step.setdefault(c["step"], {**c, "paths": {}})
            entry["paths"][c["tier"]] = c["path"]
            if c["ts"] is not None and (entry["ts"] is None or c["ts"] < entry["ts"]):
                entry["ts"] = c["ts"]  # when the step was first committed anywhere
        for entry in by_step.values():
            tiers = sorted(entry["paths"])
            entry["tier"] = "+".join(tiers)
            entry["path"] = entry["paths"].get("local", entry["paths"][tiers[0]])
        return [by_step[s] for s in sorted(by_step)]

    @property
    def run_id(self) -> str:
        """This run's id, the same from every reader of its journal: the fencing token's
        scope (generations are numbered per run; ``trainer.checkpoint.fence``)."""
        import hashlib

        seed = f"{self.run_dir}|{self.created_ts!r}|{self.job}".encode()
        return "run-" + hashlib.sha256(seed).hexdigest()[:16]

    def lineage(self, launching: int | None = None) -> list[tuple[int, int]]:
        """Every launched generation with the step it resumed from (-1: none), plus
        ``launching`` (about to be launched, from the newest checkpoint) when given."""
        out = [(int(launch["generation"]), -1 if launch.get("resume_step") is None
                else int(launch["resume_step"])) for launch in self.launches]
        if launching is not None:
            step = self.newest_checkpoint_step
            out.append((launching, -1 if step is None else step))
        return out

    @property
    def newest_checkpoint_step(self) -> int | None:
        live = self.committed_checkpoints
        return live[-1]["step"] if live else None

    def restarts_without_progress(self) -> int:
        """Failures in a row, counted back from the newest, that made no progress.

        A failure made "progress" when a checkpoint newer than the one available at the
        previous failure was committed before it. A script of the user's own keeps its own
        checkpoints, which the orchestrator does not see: for it, a generation that advanced
        optimizer steps (counted by the SDK or the preload hook) made progress.
        """
        count = 0
        # What a restart could resume from at each failure: the durable tier's newest step
        # or the memory tier's (in-job recoveries roll back to it), whichever is newer.
        steps_at_failure = [_newest(f.get("newest_checkpoint_step"),
                                    f.get("newest_memory_step")) for f in self.failures]
        for i in range(len(steps_at_failure) - 1, -1, -1):
            if self.own_script and self._steps_advanced(self.failures[i]) > 0:
                break
            previous = steps_at_failure[i - 1] if i > 0 else None
            current = steps_at_failure[i]
            if i > 0 and (current or -1) > (previous or -1):
                break
            if i == 0 and current is not None:
                break
            count += 1
        return count

    def _steps_advanced(self, failure: dict[str, Any]) -> int:
        """Optimizer steps the failed generation made (its first step to its last)."""
        first = self.first_steps.get(failure.get("generation") or -1)
        last = failure.get("last_step")
        return 0 if first is None or last is None else max(0, last - first + 1)

    def cause_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.failures:
            counts[f.get("cause", "?")] = counts.get(f.get("cause", "?"), 0) + 1
        return counts
