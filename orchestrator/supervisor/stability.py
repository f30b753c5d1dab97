"""The supervisor's stability hook: detectors on rank 0's step stream, and rollbacks.

Rank 0's records reach ``on_records`` from the heartbeats (after ``ProgressTracker`` has
appended them to ``steps.jsonl``). A ``LineageMonitor`` held here, in the supervisor, runs the
detectors: its state survives worker restarts because it never lived in a worker, and a redone
step is handled by the lineage rules (reset to the snapshot of the checkpoint the generation
resumed from). Every event becomes a ``stability`` journal event, a metric
(``SupervisorMetrics.on_stability``) and a log line. A rule whose action is ``rollback`` or
``lower_lr`` leaves a ``RollbackPlan`` pending; the launch's ``Generation.judge`` turns it into a
``divergence`` outcome and the recovery path calls ``roll_back``.

Surviving a supervisor restart: ``steps.jsonl`` is the source of truth, and replaying it through
the same monitor rebuilds the same state. Replaying a long run costs ~35 us a record (100,000
steps: 3-4 s of start-up, which the supervisor must not spend), so the hook also keeps a cache,
``stability.json``: the lineage's state and the byte offset of ``steps.jsonl`` it covers,
rewritten atomically every few seconds. Start-up loads the cache and replays only the records
past its offset; with no usable cache it replays the whole file. The cache is not a second
source of truth: deleting it changes nothing but the start-up time. (Snapshots in the journal
were the alternative; at ~2.5 KB a state they would bloat the file every reader folds.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.contracts import events as ev
from orchestrator.contracts import readback
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.steprecord import StepRecord, read_steps
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.rollback import (
    RollbackPlan,
    budget_refusal,
    plan_rollback,
    restore_step,
    steps_to_discard,
)
from stability.config import StabilityConfig
from stability.events import Event
from stability.lineage import LineageMonitor

if TYPE_CHECKING:
    from orchestrator.journal.view import JobView

CACHE_NAME = "stability.json"
_CACHE_VERSION = 1
# Seconds between cache rewrites: a supervisor restart replays at most this much of the stream.
_CACHE_EVERY_S = 2.0
_ROLLBACK_ACTIONS = ("rollback", "lower_lr")


def new_lineage(stability: StabilityConfig, checkpoint_every: int | None,
                keep_last: int) -> LineageMonitor:
    """The monitor for a job: snapshots at its checkpoint steps, as many as may be restored."""
    return LineageMonitor(stability, checkpoint_every=checkpoint_every,
                          max_snapshots=keep_last + 2)


def load_lineage(run: RunDir, make: Callable[[], LineageMonitor]) -> tuple[LineageMonitor, int]:
    """The lineage as of the end of ``steps.jsonl``, and the offset it covers.

    Starts from the cache when it is readable and not past the file's end, else from a fresh
    ``make()``; then replays the records past that point.
    """
    lineage = make()
    offset = 0
    cache = _read_cache(run.root / CACHE_NAME)
    size = run.steps.stat().st_size if run.steps.exists() else 0
    if cache is not None and isinstance(cache.get("steps_offset"), int) \
            and 0 <= cache["steps_offset"] <= size:
        try:
            lineage.load_state_dict(cache["lineage"])
            offset = cache["steps_offset"]
        except Exception:  # noqa: BLE001 - a cache, not a source of truth: replay instead
            lineage, offset = make(), 0
    for generation, rec, end in read_steps(run.steps, offset):
        try:
            lineage.feed(rec, generation)
        except ValueError:
            pass  # a record the live hook also skipped (and logged)
        offset = end
    return lineage, offset


def _read_cache(path: Path) -> dict[str, Any] | None:
    try:
        data = readback.read_object(path, readback.SMALL)
    except (OSError, readback.Unreadable):
        return None
    return data if data.get("version") == _CACHE_VERSION else None


def run_lineage(run: RunDir) -> Callable[[], LineageMonitor]:
    """A factory of fresh monitors as a run's resolved ``config.yaml`` sets them up (defaults
    where it is unreadable): what ``status`` rebuilds the live picture with."""
    import yaml

    try:
        data = yaml.safe_load(run.config.read_text()) or {}
        stability = StabilityConfig.model_validate(data.get("stability") or {})
        ckpt = data.get("checkpoint") or {}
        every, keep = int(ckpt.get("interval_steps") or 0) or None, int(ckpt.get("keep_last") or 3)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        stability, every, keep = StabilityConfig(), None, 3
    return lambda: new_lineage(stability, every, keep)


class StabilityHook:
    """Held by the supervisor: detectors on rank 0's records, pending rollback, rollbacks."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.config = ctx.cfg.stability
        ckpt = ctx.cfg.checkpoint
        self.lineage, self._offset = load_lineage(
            ctx.rundir, lambda: new_lineage(self.config, ckpt.interval_steps, ckpt.keep_last))
        self.pending: RollbackPlan | None = _pending_from(ctx.recorder.view, self.config)
        self._cache_path = ctx.rundir.root / CACHE_NAME
        self._cache_written = -math.inf
        # A rollback's restore limit, for the next launch only (the launch consumes it).
        self._resume_max_step: int | None = None
        self.abandoned_records = 0  # records that arrived after a rollback was decided
        # The newest generation rolled back: its records may still arrive after the rollback
        # (an agent relays what its ranks sent before the stop with its next beat, which can
        # land in RECOVERING, when nothing is pending any more).
        self.rolled_back: int = max((int(r.get("generation") or 0)
                                     for r in ctx.recorder.view.rollbacks), default=0)

    def resume_limit(self) -> int | None:
        """The newest step the next launch may resume from (a rollback's restore limit; 0:
        start afresh), or None: any committed step."""
        return self._resume_max_step

    def launched(self) -> None:
        """A launch carried ``resume_limit()`` to its ranks: a rollback's limit holds for
        that one launch only."""
        self._resume_max_step = None

    # -- the live stream -----------------------------------------------------------------------
    def on_records(self, generation: int, records: list[StepRecord]) -> None:
        """Feed rank 0's records of ``generation``; journal, count and log what fires.

        Once a rollback of ``generation`` is pending, its later records belong to the lineage
        being abandoned (the ranks train on until the stop lands, a heartbeat or two): they
        still feed the detectors (a restarted supervisor replays them too) but nothing they
        fire is journaled or acted on, so one divergence is one response (CI once journaled
        a second spike of generation 1 at step 32, seven steps past the onset). The same
        holds once the rollback is carried out: an agent relays what its ranks sent before
        the stop with its next beat, which CI saw arrive after ``roll_back``."""
        fired: list[dict[str, Any]] = []
        abandoned = self.abandoned_records
        for raw in records:
            if "loss" not in raw:  # the preload hook's {step, ts}: a step, no figures to judge
                continue
            try:
                events = self.lineage.feed(raw, generation)
            except ValueError as exc:
                self.ctx.log.warning("stability: unreadable step record skipped",
                                     step=raw.get("step"), error=str(exc))
                continue
            batch = raw.get("batch")
            if generation <= self.rolled_back or (
                    self.pending is not None and self.pending.generation == generation):
                self.abandoned_records += 1
                continue
            for event in events:
                onset: dict[str, Any] = {}
                if event.action in _ROLLBACK_ACTIONS:
                    # Journaled with the event, so a restarted supervisor can rebuild the plan.
                    step = self.lineage.onset_of(event)
                    onset = {"onset_step": step, "onset_batch": self.lineage.batch_of(step)}
                fired.append(self._report(event, generation, batch, onset))
                if onset:
                    self._maybe_plan(event, generation, **onset)
            if raw.get("skipped"):
                fired.append(self._report_skipped(raw, generation))
        if self.abandoned_records > abandoned:
            self.ctx.log.info("stability: records of a lineage being rolled back, not judged",
                              generation=generation, records=self.abandoned_records - abandoned,
                              rolled_back=generation <= self.rolled_back)
        self.ctx.metrics.on_stability(self.lineage.monitor.summary(), fired)
        if self.ctx.rundir.steps.exists():
            self._offset = self.ctx.rundir.steps.stat().st_size
        now = self.ctx.clock.monotonic()
        if fired or now - self._cache_written >= _CACHE_EVERY_S:
            self._cache_written = now
            try:
                self.save_cache()
            except OSError as exc:  # only start-up time depends on it: never fail a beat
                self.ctx.log.warning("stability: could not write the cache", error=str(exc))

    def _report(self, event: Event, generation: int, batch: Any,
                onset: dict[str, Any]) -> dict[str, Any]:
        data = event.to_dict()
        figures = {k: v for k, v in data.items() if k not in ("kind", "step", "rule", "action")}
        figures.update(onset)
        figures = {k: _json_number(v) for k, v in figures.items()}
        self.ctx.record(ev.StabilityFired(
            event=event.kind, rule=event.rule, action=event.action, step=event.step,
            generation=generation, batch=batch if isinstance(batch, int) else None,
            **figures))
        log = self.ctx.log.info if event.kind == "grad_spike_end" else self.ctx.log.warning
        log("stability rule fired", kind=event.kind, rule=event.rule, action=event.action,
            step=event.step, **figures)
        return data

    def _report_skipped(self, raw: dict[str, Any], generation: int) -> dict[str, Any]:
        # The worker's SkipStepGuard skipped this update (on every rank): make it visible.
        data = {"kind": "update_skipped", "step": raw.get("step"), "rule": "worker",
                "action": "skip_step"}
        step, batch = raw.get("step"), raw.get("batch")
        self.ctx.record(ev.StabilityFired(
            event="update_skipped", rule="worker", action="skip_step",
            step=step if isinstance(step, int) and step >= 0 else None,
            generation=generation, batch=batch if isinstance(batch, int) and batch >= 0
            else None, grad_norm=_json_number(raw.get("grad_norm")),
            loss=_json_number(raw.get("loss"))))
        self.ctx.log.warning("optimizer update skipped by the workers", step=raw.get("step"),
                             batch=raw.get("batch"))
        return data

    def _maybe_plan(self, event: Event, generation: int, onset_step: int,
                    onset_batch: int | None) -> None:
        if self.pending is not None and self.pending.generation == generation:
            return  # this generation is already being rolled back: one response per generation
        self.pending = plan_rollback(event, onset_step, onset_batch, generation, self.config)
        if onset_batch is None and event.action == "rollback":
            self.ctx.log.warning("stability: the records carry no batch index; rolling back "
                                 "without skipping data", step=event.step)
        self.ctx.log.error("divergence: rollback requested", plan=self.pending.describe())

    # -- the recovery path ------------------------------------------------------------------
    def divergence(self, generation: int) -> dict[str, Any] | None:
        """The outcome detail while a rollback of ``generation`` is pending, else None."""
        plan = self.pending
        if plan is None or plan.generation != generation:
            return None
        return {"message": plan.describe(), "step": plan.detected_step,
                "onset_step": plan.onset_step, "event": plan.trigger.get("kind"),
                "rule": plan.trigger.get("rule")}

    def refusal(self, view: JobView, generation: int | None) -> str | None:
        """Why the rollback pending for ``generation`` may not happen (budget spent), or None."""
        if self.pending is None or self.pending.generation != generation:
            return None
        return budget_refusal(view.rollbacks, self.pending.onset_step, self.config)

    def roll_back(self, view: JobView, failure: dict[str, Any]) -> dict[str, Any] | None:
        """Carry out the plan pending for the generation ``failure`` ended, before the next
        launch; returns the ``rollback`` journal event (None when there was no plan).

        Checkpoints newer than the restore point belong to the abandoned lineage: they are
        deleted, so no later restart can resume them (raises OSError when that fails). The
        next generation restores at most ``restore_max_step`` and reads the journal's skip
        windows and LR scale (``JobView._on_rollback`` folds them in).
        """
        plan, self.pending = self.pending, None
        if plan is None or plan.generation != failure.get("generation"):
            return None  # nothing pending, or a late plan from a generation already handled
        self.rolled_back = max(self.rolled_back, plan.generation)
        from_step = failure.get("last_step")
        from trainer.checkpoint import layout
        from trainer.checkpoint.store import open_store

        # Every tier: a discarded step must not come back from S3 on the next restore.
        store = open_store(self.ctx.cfg.checkpoint, self.ctx.cfg.job.name,
                           self.ctx.checkpoint_root)
        listed = {tier.name: layout.list_checkpoints(tier.root, tier.fs) for tier in store.tiers}
        steps = sorted({c.step for infos in listed.values() for c in infos})
        discard = steps_to_discard(steps, plan.restore_max_step)
        for tier in store.tiers:
            for info in listed[tier.name]:
                if info.step in discard:
                    tier.fs.rm(layout.filesystem(info.url)[1], recursive=True)
        if discard:
            self.ctx.record(ev.CheckpointPruned(steps=discard, reason="rollback"))
        committed = {c.step for infos in listed.values() for c in infos if c.committed}
        target = restore_step(sorted(committed - set(discard)), plan.restore_max_step)
        env = self.ctx.record(ev.Rollback(
            action=plan.action, generation=plan.generation,
            trigger={k: _json_number(v) for k, v in plan.trigger.items()},
            detected_step=plan.detected_step, onset_step=plan.onset_step,
            onset_batch=plan.onset_batch, restore_max_step=plan.restore_max_step,
            restore_step=target,
            skip_window=list(plan.skip_window) if plan.skip_window else None,
            lr_scale=plan.lr_scale, lr_scale_total=view.lr_scale * plan.lr_scale,
            discarded_checkpoints=discard, from_step=from_step,
            wasted_steps=None if from_step is None else max(0, from_step - (target or 0))))
        event = env.event.fields()
        self._resume_max_step = plan.restore_max_step
        self.ctx.log.warning("rolled back", restore_step=target, skip_window=plan.skip_window,
                             lr_scale_total=event["lr_scale_total"], discarded=discard)
        return event

    # -- persistence -------------------------------------------------------------------------
    def save_cache(self) -> None:
        """Write the lineage state and the ``steps.jsonl`` offset it covers (atomically)."""
        self.ctx.rundir.write_json(self._cache_path, {
            "version": _CACHE_VERSION, "steps_offset": self._offset,
            "lineage": self.lineage.state_dict()})


def _pending_from(view: JobView, config: StabilityConfig) -> RollbackPlan | None:
    """A restarted supervisor's pending rollback: the journal's last rollback-action event
    of the running generation that no ``rollback`` event has carried out yet."""
    e = view.divergence
    if e is None or e.get("generation") != view.generation:
        return None
    skip = ("event", "rule", "action", "step", "generation", "batch", "onset_step",
            "onset_batch", "ts", "seq", "kind")
    event = Event.from_dict({"kind": e["event"], "step": e["step"], "rule": e["rule"],
                             "action": e["action"],
                             **{k: v for k, v in e.items() if k not in skip}})
    return plan_rollback(event, int(e["onset_step"]), e.get("onset_batch"), e["generation"],
                         config)


def _json_number(value: Any) -> Any:
    # The journal is strict JSON for its readers: a NaN loss is written "nan" (stability's
    # convention), never the non-standard NaN token.
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
