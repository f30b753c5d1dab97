"""The supervisor's Prometheus metrics, on a registry passed in (never the global one).

Only the supervisor serves ``/metrics`` (no multiprocess mode): workers report through
heartbeats. Names carry the ``orchestrator_`` prefix and base units, counters end in
``_total``, the only labels are bounded sets (``job``, ``state``, ``cause``, ``category``,
``kind``, ``check``, ``action``). Every labelled series is created at start-up, so a query
never sees a hole before the first event of its kind. Things that happen between two scrapes (a one-step
gradient spike, a NaN loss on a skipped step) are counted, not only shown in a gauge.

The goodput books are computed elsewhere (``orchestrator.journal.books``) and pushed in through
``set_books``; a restarted supervisor replays the journal through ``on_event`` and the step
records through ``on_record`` so its counters carry on where the dead one left them.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from orchestrator import __version__
from orchestrator.contracts import events as ev
from orchestrator.journal.books import BADPUT_CATEGORIES
from orchestrator.contracts.events import Envelope, as_envelope
from orchestrator.health.catalog import CHECK_NAMES
from orchestrator.contracts.state import Cause, JobState, NodeState

STRAGGLER_ACTIONS = ("named", "cleared", "excluded")
FAILURE_CAUSES = tuple(c.value for c in Cause if c not in (Cause.COMPLETED,))
# What the stability detectors report (``stability.events.Event.kind``).
STABILITY_KINDS = ("grad_spike", "grad_spike_end", "growth", "persistent_spike", "nonfinite",
                   "loss_spike", "param_norm_jump")

# Step times from ~10 ms (tiny CPU models) to minutes (large models on slow links).
# The doors a heartbeat comes in by (orchestrator_heartbeats_total{door}).
HEARTBEAT_DOORS = ("api", "process")
_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)
# Checkpoint stalls: the target is <= 0.1 s; a synchronous save of a big model is minutes.
_CKPT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# The worker reports of a checkpoint that did not make it, by stage of the failure.
_FAILED_SAVE = {"checkpoint_failed": "save", "checkpoint_upload_failed": "upload"}
_CKPT_STAGES = tuple(_FAILED_SAVE.values())


class SupervisorMetrics:
    """Every metric the supervisor exports, on ``registry``, all labelled ``job``."""

    def __init__(self, registry: CollectorRegistry, job: str) -> None:
        self.registry = registry
        self.job = job
        r, j = registry, ["job"]
        self.info = Info("orchestrator", "Job, model, accelerator and version.", j, registry=r)
        self.state = Gauge("orchestrator_job_state", "1 for the job's current state.",
                           ["job", "state"], registry=r)
        self.nodes = Gauge("orchestrator_nodes", "Nodes by state.", ["job", "state"],
                           registry=r)
        self.restarts = Counter("orchestrator_restarts_total", "Restarts by the cause before.",
                                ["job", "cause"], registry=r)
        self.failures = Counter("orchestrator_failures_total", "Stops by failure cause.",
                                ["job", "cause"], registry=r)
        self.productive = Counter("orchestrator_productive_seconds_total",
                                  "Wall seconds booked to productive training.", j, registry=r)
        self.badput = Counter("orchestrator_badput_seconds_total",
                              "Wall seconds booked to a badput category.",
                              ["job", "category"], registry=r)
        self.goodput = Gauge("orchestrator_goodput_ratio", "Productive / total wall time.", j,
                             registry=r)
        self.step = Gauge("orchestrator_training_step", "Last completed step.", j, registry=r)
        self.tokens = Gauge("orchestrator_training_tokens",
                            "Tokens trained so far (goes back when a restart resumes from a "
                            "checkpoint).", j, registry=r)
        self.steps_done = Counter("orchestrator_steps_processed",
                                  "Training steps finished, redone ones included (rate() is "
                                  "the step rate).", j, registry=r)
        self.tokens_done = Counter("orchestrator_tokens_processed",
                                   "Tokens processed, redone steps included (rate() is the "
                                   "throughput).", j, registry=r)
        self.nonfinite = Counter("orchestrator_nonfinite_steps",
                                 "Steps whose loss or gradient norm was NaN or infinite.", j,
                                 registry=r)
        self.loss = Gauge("orchestrator_loss", "Training loss of the last step.", j, registry=r)
        self.lr = Gauge("orchestrator_learning_rate", "Learning rate of the last step.", j,
                        registry=r)
        self.grad_norm = Gauge("orchestrator_grad_norm", "Total gradient L2 norm.", j,
                               registry=r)
        self.grad_norm_mean = Gauge("orchestrator_grad_norm_running_mean",
                                    "Running mean r of the gradient norm.", j, registry=r)
        self.spikes = Counter("orchestrator_grad_norm_spikes_total",
                              "Gradient-norm spikes (onsets).", j, registry=r)
        self.spike_length = Gauge("orchestrator_grad_norm_spike_length_steps",
                                  "Length of the current (or last) gradient spike.", j,
                                  registry=r)
        self.growth = Gauge("orchestrator_grad_norm_growth_ratio",
                            "Gradient norm over its lowest value after warm-up.", j, registry=r)
        self.param_norm = Gauge("orchestrator_param_norm", "Total parameter L2 norm.", j,
                                registry=r)
        self.stability_events = Counter("orchestrator_stability_events_total",
                                        "Stability rule firings by kind.", ["job", "kind"],
                                        registry=r)
        self.rollbacks = Counter("orchestrator_rollbacks_total", "Automatic rollbacks.", j,
                                 registry=r)
        self.step_duration = Histogram("orchestrator_step_duration_seconds",
                                       "Duration of a training step.", j,
                                       buckets=_STEP_BUCKETS, registry=r)
        self.ckpt_blocking = Histogram("orchestrator_checkpoint_blocking_seconds",
                                       "Time a save blocked training.", j,
                                       buckets=_CKPT_BUCKETS, registry=r)
        self.last_ckpt_step = Gauge("orchestrator_last_checkpoint_step",
                                    "Step of the newest committed checkpoint.", j, registry=r)
        self.last_ckpt_ts = Gauge("orchestrator_last_checkpoint_timestamp_seconds",
                                  "Unix time of the newest committed checkpoint.", j,
                                  registry=r)
        self.last_step_ts = Gauge("orchestrator_last_step_timestamp_seconds",
                                  "Unix time the last step finished.", j, registry=r)
        self.created_ts = Gauge("orchestrator_job_created_timestamp_seconds",
                                "Unix time the job was created.", j, registry=r)
        self.steps_target = Gauge("orchestrator_training_steps_target",
                                  "The step the job completes at (absent for a script of "
                                  "the user's own: its total is not known).", j, registry=r)
        self.growth_threshold = Gauge("orchestrator_stability_growth_ratio_threshold",
                                      "stability.growth.ratio of the job's config: the growth "
                                      "warning's threshold (the alert compares against it).",
                                      j, registry=r)
        self.ckpt_failures = Counter("orchestrator_checkpoint_failures_total",
                                     "Checkpoints that failed to save (stage save) or to "
                                     "upload to the remote tier (stage upload).",
                                     ["job", "stage"], registry=r)
        self.memory_bytes = Gauge("orchestrator_checkpoint_memory_bytes",
                                  "Shared memory the memory tier holds on rank 0's node.", j,
                                  registry=r)
        self.memory_budget = Gauge("orchestrator_checkpoint_memory_budget_bytes",
                                   "Shared memory the memory tier may use on a node.", j,
                                   registry=r)
        self.health_failures = Counter("orchestrator_health_check_failures_total",
                                       "Failed health checks by check.", ["job", "check"],
                                       registry=r)
        self.late = Counter("orchestrator_supervisor_late_seconds",
                            "Time the supervisor's event loop woke late (more than 20 ms) "
                            "(node-loss deadlines are extended by it).", j, registry=r)
        self.straggler_nodes = Gauge("orchestrator_straggler_nodes",
                                     "Nodes named stragglers now (slower than their peers "
                                     "for the whole straggler window).", j, registry=r)
        self.straggler_ranks = Gauge("orchestrator_straggler_ranks",
                                     "Slow ranks on the nodes named stragglers now.", j,
                                     registry=r)
        self.straggler_excess = Gauge("orchestrator_straggler_excess_seconds",
                                      "The worst named straggler's step time or data wait "
                                      "above its peers' median, per step (0: none).", j,
                                      registry=r)
        self.straggler_events = Counter("orchestrator_straggler_events_total",
                                        "Stragglers named, cleared and excluded.",
                                        ["job", "action"], registry=r)
        self.heartbeats = Counter("orchestrator_heartbeats_total",
                                  "Heartbeats taken, by the door they came in: the API's "
                                  "port, or the heartbeat process (api.heartbeat_process).",
                                  ["job", "door"], registry=r)
        self.heartbeat_process_up = Gauge("orchestrator_heartbeat_process_up",
                                          "1 while the heartbeat process serves agents; 0 "
                                          "when it is off or was lost.", j, registry=r)
        self._stragglers: dict[str, tuple[int, float]] = {}  # node -> (ranks, excess)
        self._failed_saves: dict[tuple[str, int | None, int | None], None] = {}
        self._booked: dict[str, float] = {}
        self._last_tokens: tuple[int, float, float] | None = None  # step, tokens, per step
        self._init_series()

    def _init_series(self) -> None:
        job = self.job
        for s in JobState:
            self.state.labels(job, s.value).set(1 if s is JobState.PENDING else 0)
        for s in NodeState:
            self.nodes.labels(job, s.value).set(0)
        for c in FAILURE_CAUSES:
            self.restarts.labels(job, c)
            self.failures.labels(job, c)
        for cat in BADPUT_CATEGORIES:
            self.badput.labels(job, cat)
        for kind in STABILITY_KINDS:
            self.stability_events.labels(job, kind)
        for check in CHECK_NAMES:
            self.health_failures.labels(job, check)
        for door in HEARTBEAT_DOORS:
            self.heartbeats.labels(job, door)
        self.heartbeat_process_up.labels(job).set(0)
        for metric in (self.late, self.productive, self.spikes, self.rollbacks, self.steps_done,
                       self.tokens_done, self.nonfinite):
            metric.labels(job)
        # Gauges whose 0 is a true value from the start. The step's figures (loss, LR, the
        # norms, their running mean and growth, the last step's and checkpoint's time) stay
        # absent until they are known: a 0.0 loss or a checkpoint at the epoch is a lie
        # every dashboard and alert would have to guard against.
        for g in (self.goodput, self.step, self.tokens, self.spike_length, self.memory_bytes,
                  self.memory_budget):
            g.labels(job)
        for stage in _CKPT_STAGES:
            self.ckpt_failures.labels(job, stage)
        self.step_duration.labels(job)
        self.ckpt_blocking.labels(job)
        for g in (self.straggler_nodes, self.straggler_ranks, self.straggler_excess):
            g.labels(job).set(0)
        for action in STRAGGLER_ACTIONS:
            self.straggler_events.labels(job, action)

    # -- updates -----------------------------------------------------------------------------
    def set_info(self, model: str, accelerator: str) -> None:
        self.info.labels(self.job).info({"model": model, "accelerator": accelerator,
                                         "version": __version__})

    def set_thresholds(self, growth_ratio: float | None) -> None:
        """Config values the alert rules compare against (one source for both): the growth
        warning's ratio, absent when that rule is off."""
        if growth_ratio is not None:
            self.growth_threshold.labels(self.job).set(growth_ratio)

    def set_state(self, state: JobState) -> None:
        for s in JobState:
            self.state.labels(self.job, s.value).set(1 if s is state else 0)

    def set_nodes(self, counts: dict[str, int]) -> None:
        for state, n in counts.items():
            self.nodes.labels(self.job, state).set(n)

    def on_event(self, env: Envelope | dict[str, Any]) -> None:
        """Fold a journal event into the metrics it moves (a raw dict is parsed first)."""
        parsed = as_envelope(env)
        if parsed is None:
            return
        env = parsed
        e, job = env.event, self.job
        if isinstance(e, ev.JobCreated):
            self.created_ts.labels(job).set(env.ts)
            if e.steps:
                self.steps_target.labels(job).set(e.steps)
        elif isinstance(e, ev.WorkerNote) and e.kind in _FAILED_SAVE:
            # Every rank of a save may report the same failure: one save, one count.
            key = (e.kind, e.generation, e.step)
            if key not in self._failed_saves:
                self._failed_saves[key] = None
                if len(self._failed_saves) > 4096:
                    self._failed_saves.pop(next(iter(self._failed_saves)))
                self.ckpt_failures.labels(job, _FAILED_SAVE[e.kind]).inc()
        elif isinstance(e, ev.Transition):
            self.set_state(e.to)
        elif isinstance(e, ev.Failure) and e.cause.value in FAILURE_CAUSES:
            self.failures.labels(job, e.cause.value).inc()
        elif isinstance(e, ev.GenerationLaunched) and e.after_cause is not None \
                and e.after_cause is not Cause.OPERATOR and e.after_cause.value in FAILURE_CAUSES:
            self.restarts.labels(job, e.after_cause.value).inc()
        elif isinstance(e, ev.CheckpointCommitted) and e.via != "upload":
            # Uploads lag the saves: a remote copy committed later must not move these back.
            self.last_ckpt_step.labels(job).set(e.step)
            self.last_ckpt_ts.labels(job).set(env.ts)
            if e.blocking_s is not None:
                self.ckpt_blocking.labels(job).observe(e.blocking_s)
        elif isinstance(e, ev.Rollback):
            self.rollbacks.labels(job).inc()
        elif isinstance(e, ev.MemoryTier):
            self.memory_bytes.labels(job).set(e.node_bytes)
            self.memory_budget.labels(job).set(e.node_budget_bytes)
        elif isinstance(e, ev.HealthResult) and not e.ok:
            self.health_failures.labels(job, e.check).inc()
        elif isinstance(e, ev.Straggler):
            self.straggler_events.labels(job, e.action).inc()
            if e.action == "named":
                self._stragglers[e.node_id] = (len(e.ranks), e.excess_s or 0.0)
            else:
                self._stragglers.pop(e.node_id, None)
            self._set_stragglers()
        if isinstance(e, ev.GenerationLaunched) and self._stragglers:
            self._stragglers.clear()  # a new generation is judged afresh
            self._set_stragglers()

    def _set_stragglers(self) -> None:
        named = self._stragglers.values()
        self.straggler_nodes.labels(self.job).set(len(self._stragglers))
        self.straggler_ranks.labels(self.job).set(sum(n for n, _ in named))
        self.straggler_excess.labels(self.job).set(max((x for _, x in named), default=0.0))

    def on_record(self, rec: dict[str, Any]) -> None:
        """Fold one of rank 0's step records in."""
        job = self.job
        step = int(rec.get("step") or 0)
        self.step.labels(job).set(step)
        self.steps_done.labels(job).inc()
        if rec.get("tokens") is not None:
            self.tokens.labels(job).set(rec["tokens"])
            self._count_tokens(step, float(rec["tokens"]))
        for gauge, key in ((self.loss, "loss"), (self.lr, "lr"), (self.grad_norm, "grad_norm"),
                           (self.param_norm, "param_norm")):
            value = _number(rec.get(key))
            if value is not None:
                gauge.labels(job).set(value)
        if any(v is not None and not math.isfinite(v)
               for v in (_number(rec.get("loss")), _number(rec.get("grad_norm")))):
            self.nonfinite.labels(job).inc()
        if rec.get("step_time") is not None:
            self.step_duration.labels(job).observe(rec["step_time"])
        if rec.get("ts") is not None:
            self.last_step_ts.labels(job).set(rec["ts"])

    def _count_tokens(self, step: int, tokens: float) -> None:
        # Records carry the running token count; after a resume it goes back, so the step's
        # own tokens are taken as those of the last contiguous step.
        last = self._last_tokens
        if last is not None and step == last[0] + 1 and tokens >= last[1]:
            per_step = tokens - last[1]
        elif last is not None:
            per_step = last[2]
        else:
            per_step = tokens / step if step > 0 else 0.0
        self.tokens_done.labels(self.job).inc(per_step)
        self._last_tokens = (step, tokens, per_step)

    def on_stability(self, summary: dict[str, Any], events: list[dict[str, Any]]) -> None:
        """The stability monitor's summary (running mean, growth, spike length) and the
        events it fired on the latest records."""
        job = self.job
        for key, gauge in (("running_mean", self.grad_norm_mean),
                           ("growth_ratio", self.growth),
                           ("current_spike_length", self.spike_length)):
            value = _number(summary.get(key))
            if value is not None:
                gauge.labels(job).set(value)
        for fired in events:
            self.stability_events.labels(job, fired["kind"]).inc()
            if fired["kind"] == "grad_spike":
                self.spikes.labels(job).inc()

    def set_books(self, seconds: dict[str, float], goodput: float,
                  hold: tuple[str, ...] = ()) -> None:
        """Bring the books' counters up to ``seconds`` and set the goodput gauge.

        Counters never go down: when provisional time moves to another category (a failure
        turns the steps since the last checkpoint into wasted progress), the category that
        shrank keeps its counter until its books pass it again, while the one that grew
        takes the increase at once. Rates over windows longer than the re-booked time agree
        with the books; the goodput gauge always shows them exactly. Categories in ``hold``
        keep their counters where they are: the live window's ``failure_detection`` is a
        guess (no step for longer than any took) that the next step or record usually takes
        back, and a counter cannot give it back (a supervisor resumed before its agents'
        records caught up booked it in a run with no failure).
        """
        job = self.job
        self._raise_to("productive", self.productive.labels(job), seconds.get("productive", 0.0))
        for cat in BADPUT_CATEGORIES:
            if cat not in hold:
                self._raise_to(cat, self.badput.labels(job, cat), seconds.get(cat, 0.0))
        self.goodput.labels(job).set(goodput)

    def _raise_to(self, key: str, counter: Any, value: float) -> None:
        # Books are recomputed from the journal; a counter only takes the increase.
        current = self._booked.get(key, 0.0)
        if value > current:
            counter.inc(value - current)
            self._booked[key] = value


def _number(v: Any) -> float | None:
    """A float, NaN and infinities kept (the exposition format has them, and the "loss not
    finite" alert needs them); the strings "nan"/"inf" of the stability JSON read too."""
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None
