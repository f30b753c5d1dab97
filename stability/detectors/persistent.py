"""Persistent grad-norm spikes: a spike that reaches ``length`` steps signals divergence.

Spikes are called by the grad_spike rule (mode, window, margins, include_spikes_in_mean) even
when grad_spike's own events are disabled; this detector keeps its own copy of that window so it
works, and restores, on its own. It fires once per spike, on the step the spike's length reaches
``length``; the spike carrying on afterwards does not fire again.
"""

from __future__ import annotations

from typing import Any

from stability._floats import json_safe
from stability.config import GradSpikeConfig, PersistentSpikeConfig
from stability.detectors.grad_spike import spike_tracker_for, usable_grad_norm
from stability.events import Event
from stability.records import StepRecord


class PersistentSpikeDetector:
    """Emits ``persistent_spike`` when the current grad-norm spike reaches ``config.length``."""

    name = "persistent_spike"

    def __init__(
        self, config: PersistentSpikeConfig, spike: GradSpikeConfig, warmup_steps: int = 0
    ) -> None:
        self.config = config
        self.warmup_steps = warmup_steps
        self._tracker = spike_tracker_for(spike)
        self._fired = 0

    def update(self, rec: StepRecord) -> list[Event]:
        g = rec.grad_norm
        if not usable_grad_norm(g):
            return []
        obs = self._tracker.observe(rec.step, g, classify=rec.step >= self.warmup_steps)
        # The length grows by one per spiking step, so equality is met exactly once per spike.
        if not (obs.spiking and obs.length == self.config.length):
            return []
        self._fired += 1
        figures = {
            "length": obs.length,
            "onset_step": obs.onset_step,
            "grad_norm": g,
            "running_mean": obs.mean,
            "threshold": obs.threshold,
        }
        return [Event("persistent_spike", rec.step, self.name, self.config.action, figures)]

    def summary(self) -> dict[str, Any]:
        return {"persistent_spikes_total": self._fired}

    def state_dict(self) -> dict[str, Any]:
        return json_safe({"tracker": self._tracker.state_dict(), "fired": self._fired})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tracker.load_state_dict(state["tracker"])
        self._fired = int(state["fired"])
