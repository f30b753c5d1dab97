"""The stability monitor: every enabled detector over one stream of step records.

The orchestrator feeds it one ``StepRecord`` per step and acts on ``worst_action`` of the events;
the worker holds a ``SkipStepGuard`` to skip an optimizer update before it happens. Both are
deterministic functions of the stream they have seen (no clocks, no randomness, no I/O), which
is what lets every rank reach the same decision and a restored state continue exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stability._floats import decode_float, json_safe
from stability.config import StabilityConfig
from stability.detectors import (
    Detector,
    GradSpikeDetector,
    GrowthDetector,
    LossSpikeDetector,
    NonFiniteDetector,
    ParamNormDetector,
    PersistentSpikeDetector,
)
from stability.events import Event
from stability.records import StepRecord

# Strongest first: a rollback subsumes lowering the LR, which subsumes skipping one update.
ACTION_ORDER = ("rollback", "lower_lr", "skip_step", "record")

_STATE_VERSION = 1


def worst_action(events: Iterable[Event]) -> str | None:
    """The strongest action among ``events`` (rollback > lower_lr > skip_step > record).

    None when there are no events. Raises ValueError on an action outside ``ACTION_ORDER``.
    """
    best: int | None = None
    for event in events:
        if event.action not in ACTION_ORDER:
            raise ValueError(f"unknown action {event.action!r} in event {event.kind!r}")
        rank = ACTION_ORDER.index(event.action)
        best = rank if best is None else min(best, rank)
    return None if best is None else ACTION_ORDER[best]


def build_detectors(config: StabilityConfig) -> list[Detector]:
    """The enabled detectors, in the fixed order their events are reported.

    Non-finite values come first: on a NaN step that event is the one that matters.
    """
    w = config.warmup_steps
    candidates: list[tuple[bool, Detector]] = [
        (config.loss.nonfinite.enabled, NonFiniteDetector(config.loss.nonfinite, w)),
        (config.grad_spike.enabled, GradSpikeDetector(config.grad_spike, w)),
        (
            config.persistent_spike.enabled,
            PersistentSpikeDetector(config.persistent_spike, config.grad_spike, w),
        ),
        (config.growth.enabled, GrowthDetector(config.growth, w)),
        (config.loss.spike.enabled, LossSpikeDetector(config.loss.spike, w)),
        (config.param_norm.enabled, ParamNormDetector(config.param_norm, w)),
    ]
    return [detector for enabled, detector in candidates if enabled]


_SUMMARY_KEYS = (
    "step",
    "last_loss",
    "last_grad_norm",
    "last_param_norm",
    "running_mean",
    "threshold",
    "spikes_total",
    "spike_length_histogram",
    "longest_spike",
    "current_spike_length",
    "growth_ratio",
    "lowest_grad_norm",
)


class StabilityMonitor:
    """Runs every enabled detector on each record; state and summary for the whole set."""

    def __init__(self, config: StabilityConfig) -> None:
        self.config = config
        self._detectors = build_detectors(config)
        self._last: dict[str, Any] = {
            "step": None,
            "last_loss": None,
            "last_grad_norm": None,
            "last_param_norm": None,
        }

    def update(self, rec: StepRecord) -> list[Event]:
        """Feed one step; returns its events in detector order (possibly none)."""
        events: list[Event] = []
        for detector in self._detectors:
            events.extend(detector.update(rec))
        self._last["step"] = rec.step
        self._last["last_loss"] = rec.loss
        # Norms are not measured on every step: keep the last measured value.
        if rec.grad_norm is not None:
            self._last["last_grad_norm"] = rec.grad_norm
        if rec.param_norm is not None:
            self._last["last_param_norm"] = rec.param_norm
        return events

    def summary(self) -> dict[str, Any]:
        """The current picture for operators, JSON-safe (non-finite floats as strings).

        Always has the keys in ``_SUMMARY_KEYS`` (None where the detector behind one is disabled
        or has no value yet), plus per-detector totals.
        """
        out: dict[str, Any] = dict.fromkeys(_SUMMARY_KEYS)
        for detector in self._detectors:
            out.update(detector.summary())
        out.update(self._last)
        return json_safe(out)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data (strict: no NaN tokens) of bounded size, keyed by detector rule."""
        return {
            "version": _STATE_VERSION,
            "last": json_safe(self._last),
            "detectors": {d.name: d.state_dict() for d in self._detectors},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``.

        A detector enabled now but absent from ``state`` starts fresh; state of a detector that
        is disabled now is ignored, so a config edit between restarts never blocks a resume.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"stability state version {state.get('version')!r} is not {_STATE_VERSION}"
            )
        for key, value in state["last"].items():
            if key in self._last:
                is_float = value is not None and key != "step"
                self._last[key] = decode_float(value, key) if is_float else value
        saved = state["detectors"]
        for detector in self._detectors:
            if detector.name in saved:
                detector.load_state_dict(saved[detector.name])


class SkipStepGuard:
    """Worker-side decision to skip the optimizer update of the current step.

    Call ``should_skip`` after backward and before ``optimizer.step()``, on every step and every
    rank, with the GLOBALLY REDUCED loss and grad norm (the all-reduced mean loss, the total
    norm from ``stability.norms.clip_grad_norm_``), never a rank's local values. The guard is a
    pure function of the values it has been fed, so ranks fed the same values decide identically
    with no further communication. It runs the same detectors as the orchestrator's monitor on
    a private ``StabilityMonitor`` and answers True when a rule whose action is ``skip_step``
    fires. Save its ``state_dict`` with the checkpoint so a restarted worker decides as before.
    """

    def __init__(self, config: StabilityConfig) -> None:
        self._monitor = StabilityMonitor(config)
        self.last_events: list[Event] = []
        # Lets the worker skip the bookkeeping entirely when no rule can ever answer True.
        self.active = "skip_step" in config.rule_actions().values()

    def should_skip(
        self, step: int, loss: float, grad_norm: float | None, param_norm: float | None = None
    ) -> bool:
        """True when a ``skip_step`` rule fires on this step; the events are in ``last_events``."""
        # float() accepts 0-d tensors and numpy scalars, so the worker can pass either.
        rec = StepRecord(
            step=int(step),
            loss=float(loss),
            grad_norm=None if grad_norm is None else float(grad_norm),
            param_norm=None if param_norm is None else float(param_norm),
        )
        self.last_events = self._monitor.update(rec)
        return any(event.action == "skip_step" for event in self.last_events)

    def state_dict(self) -> dict[str, Any]:
        return self._monitor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._monitor.load_state_dict(state)
