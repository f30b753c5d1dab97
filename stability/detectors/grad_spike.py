"""Gradient-norm spikes: onset and end events, spike lengths.

The rule, from the Trainium pre-training study: r is the running mean of the grad norm over the
previous ``window`` (20) steps, and step t spikes when g_t > r + margin (0.1). The relative
(g > r * (1 + rel_margin)) and z-score (g > mean + k * std) rules are configurable. A spike lasts
from its onset to the first step whose g is back at or below the threshold; its length is the
number of steps above it (86% of the study's spikes lasted one step).

Decision: spiking steps do NOT enter the running window (``include_spikes_in_mean=False``).
If they did, a long spike would pull r up towards itself, the threshold would rise to meet the
spiking values, and the spike would be declared over while g is still far above where it was:
the length (and so the persistent-spike rule) would be underestimated, and a slow divergence
would hide itself. With spikes kept out, r is the level the run left, so the threshold holds
still for the spike's duration. The price: a genuine, permanent level shift stays a spike until
the persistent-spike rule acts on it, which is the intended reading of "persistent spikes are a
sign of divergence". ``include_spikes_in_mean=True`` restores the plain moving average.

Until the window holds ``window`` values, r is undefined and no spike is called. During warm-up
(step < warmup_steps) every grad norm enters the window and no spike is tracked, so a spike can
only start at or after ``warmup_steps``. Records without a grad norm, or with a non-finite or
negative one (a norm is never negative: that is a producer bug, not a data point), are skipped.
"""

from __future__ import annotations

from typing import Any

from stability._floats import json_safe
from stability.config import GradSpikeConfig
from stability.detectors._window import SpikeTracker, ThresholdFn, usable
from stability.events import Event
from stability.records import StepRecord


def usable_grad_norm(g: float | None) -> bool:
    """Present, finite and non-negative."""
    return usable(g) and g >= 0  # type: ignore[operator]


def threshold_fn(config: GradSpikeConfig) -> ThresholdFn:
    """The configured threshold as a function of the window's (mean, std)."""
    if config.mode == "absolute":
        margin = config.margin
        return lambda mean, std: mean + margin
    if config.mode == "relative":
        factor = 1.0 + config.rel_margin
        return lambda mean, std: mean * factor
    k = config.zscore_k
    return lambda mean, std: mean + k * std


def spike_tracker_for(config: GradSpikeConfig) -> SpikeTracker:
    """A tracker that calls grad-norm spikes exactly as ``config`` defines them."""
    return SpikeTracker(config.window, threshold_fn(config), config.include_spikes_in_mean)


class GradSpikeDetector:
    """Emits ``grad_spike`` at each onset and ``grad_spike_end`` (with ``length``) at each end.

    The onset event carries the rule's action; the end event is always ``record`` (by then the
    spike is over, and acting on it twice would double the response).
    """

    name = "grad_spike"

    def __init__(self, config: GradSpikeConfig, warmup_steps: int = 0) -> None:
        self.config = config
        self.warmup_steps = warmup_steps
        self._tracker = spike_tracker_for(config)
        # histogram[i] counts spikes of length i + 1; the last bucket counts lengths > K.
        self._histogram = [0] * (config.histogram_max_length + 1)
        self._total = 0
        self._longest = 0

    def update(self, rec: StepRecord) -> list[Event]:
        g = rec.grad_norm
        if not usable_grad_norm(g):
            return []
        obs = self._tracker.observe(rec.step, g, classify=rec.step >= self.warmup_steps)
        events: list[Event] = []
        if obs.ended_length:
            k = self.config.histogram_max_length
            self._histogram[min(obs.ended_length, k + 1) - 1] += 1
            figures = {"length": obs.ended_length, "onset_step": obs.onset_step, "grad_norm": g}
            if obs.threshold is not None:
                figures["threshold"] = obs.threshold
            events.append(Event("grad_spike_end", rec.step, self.name, "record", figures))
        if obs.started:
            self._total += 1
            figures = {"grad_norm": g, "running_mean": obs.mean, "threshold": obs.threshold}
            if self.config.mode == "zscore":
                figures["std"] = obs.std
            events.append(Event("grad_spike", rec.step, self.name, self.config.action, figures))
        self._longest = max(self._longest, obs.length)
        return events

    def histogram(self) -> dict[str, int]:
        """Completed spikes by length: ``{"1": n, ..., "K": n, ">K": n}``."""
        k = self.config.histogram_max_length
        out = {str(i + 1): self._histogram[i] for i in range(k)}
        out[f">{k}"] = self._histogram[k]
        return out

    def summary(self) -> dict[str, Any]:
        window = self._tracker.window
        mean = window.mean() if window.full else None
        threshold = None
        if mean is not None:
            threshold = threshold_fn(self.config)(mean, window.std())
        return {
            "running_mean": mean,
            "threshold": threshold,
            "spikes_total": self._total,
            "spike_length_histogram": self.histogram(),
            "longest_spike": self._longest,
            "current_spike_length": self._tracker.length,
        }

    def state_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "tracker": self._tracker.state_dict(),
                "histogram": list(self._histogram),
                "total": self._total,
                "longest": self._longest,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tracker.load_state_dict(state["tracker"])
        k = self.config.histogram_max_length
        saved = [int(c) for c in state["histogram"]]
        # Saved under another K: lengths beyond the new K fold into the ">K" bucket. (A saved
        # ">K_old" bucket stays in ">K" when K grew: its exact lengths are gone.)
        self._histogram = (saved[:-1] + [0] * k)[:k] + [sum(saved[k:-1]) + saved[-1]]
        self._total = int(state["total"])
        self._longest = int(state["longest"])
