"""Rules on the loss: non-finite values, and loss spikes against the loss's own statistics.

Non-finite: a NaN or infinite loss, grad norm or param norm fires ``nonfinite`` on that step,
during warm-up too (a NaN is never a warm-up artefact), and on every such step (each one is an
update that must not be trusted).

Loss spike: the loss is compared with the mean and std of its own running window; it spikes
when it exceeds mean + zscore_k * std or mean * ratio (whichever criteria are set; either one
suffices). As for grad norms, spiking losses stay out of the window (a long spike must not
raise the bar it is measured against), warm-up losses all enter it, and one ``loss_spike``
event is emitted per run of consecutive spiking steps, at its onset. The ratio criterion
assumes a positive loss, as cross-entropy is.
"""

from __future__ import annotations

import math
from typing import Any

from stability._floats import json_safe
from stability.config import LossSpikeConfig, NonFiniteConfig
from stability.detectors._window import SpikeTracker, usable
from stability.events import Event
from stability.records import StepRecord


class NonFiniteDetector:
    """Emits ``nonfinite`` on any step whose loss, grad norm or param norm is NaN or infinite."""

    name = "loss.nonfinite"

    def __init__(self, config: NonFiniteConfig, warmup_steps: int = 0) -> None:
        # warmup_steps is accepted for a uniform constructor and deliberately ignored.
        self.config = config
        self._fired = 0

    def update(self, rec: StepRecord) -> list[Event]:
        values = {"loss": rec.loss, "grad_norm": rec.grad_norm, "param_norm": rec.param_norm}
        present = {k: v for k, v in values.items() if v is not None}
        if all(math.isfinite(v) for v in present.values()):
            return []
        self._fired += 1
        return [Event("nonfinite", rec.step, self.name, self.config.action, present)]

    def summary(self) -> dict[str, Any]:
        return {"nonfinite_total": self._fired}

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self._fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = int(state["fired"])


class LossSpikeDetector:
    """Emits ``loss_spike`` at the onset of each run of losses above the running threshold."""

    name = "loss.spike"

    def __init__(self, config: LossSpikeConfig, warmup_steps: int = 0) -> None:
        self.config = config
        self.warmup_steps = warmup_steps
        self._tracker = SpikeTracker(config.window, self._threshold, include_spikes=False)
        self._fired = 0

    def _threshold(self, mean: float, std: float) -> float:
        # A spike when any configured criterion is exceeded: the lowest bar decides.
        bars = []
        if self.config.zscore_k is not None:
            bars.append(mean + self.config.zscore_k * std)
        if self.config.ratio is not None:
            bars.append(mean * self.config.ratio)
        return min(bars) if bars else math.inf

    def update(self, rec: StepRecord) -> list[Event]:
        if not usable(rec.loss):
            return []
        obs = self._tracker.observe(rec.step, rec.loss, classify=rec.step >= self.warmup_steps)
        if not obs.started:
            return []
        self._fired += 1
        figures = {
            "loss": rec.loss,
            "running_mean": obs.mean,
            "std": obs.std,
            "threshold": obs.threshold,
        }
        return [Event("loss_spike", rec.step, self.name, self.config.action, figures)]

    def summary(self) -> dict[str, Any]:
        window = self._tracker.window
        return {
            "loss_running_mean": window.mean() if window.full else None,
            "loss_spikes_total": self._fired,
            "current_loss_spike_length": self._tracker.length,
        }

    def state_dict(self) -> dict[str, Any]:
        return json_safe({"tracker": self._tracker.state_dict(), "fired": self._fired})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tracker.load_state_dict(state["tracker"])
        self._fired = int(state["fired"])
