"""Growth of the grad norm over the lowest value seen: the study's "> 3x" divergence warning.

The lowest grad norm is tracked from ``warmup_steps`` on: the first steps of a run have norms
that say nothing about its steady level. Only positive norms can be the lowest (a ratio over
zero means nothing). The warning fires once per crossing of ``ratio`` and re-arms only when the
ratio has fallen to ``ratio * rearm_fraction``, so a norm hovering at the threshold warns once.
"""

from __future__ import annotations

from typing import Any

from stability._floats import json_safe
from stability.config import GrowthConfig
from stability.detectors.grad_spike import usable_grad_norm
from stability.events import Event
from stability.records import StepRecord


class GrowthDetector:
    """Emits ``growth`` (a divergence warning) when g / lowest g crosses ``config.ratio``."""

    name = "growth"

    def __init__(self, config: GrowthConfig, warmup_steps: int = 0) -> None:
        self.config = config
        self.warmup_steps = warmup_steps
        self._lowest: float | None = None
        self._ratio: float | None = None
        self._armed = True
        self._fired = 0

    def update(self, rec: StepRecord) -> list[Event]:
        g = rec.grad_norm
        if not usable_grad_norm(g) or rec.step < self.warmup_steps:
            return []
        if g > 0 and (self._lowest is None or g < self._lowest):
            self._lowest = g
        if self._lowest is None:
            return []
        ratio = g / self._lowest
        self._ratio = ratio
        if self._armed and ratio > self.config.ratio:
            self._armed = False
            self._fired += 1
            figures = {"grad_norm": g, "lowest": self._lowest, "ratio": ratio}
            return [Event("growth", rec.step, self.name, self.config.action, figures)]
        if not self._armed and ratio <= self.config.ratio * self.config.rearm_fraction:
            self._armed = True
        return []

    def summary(self) -> dict[str, Any]:
        return {
            "growth_ratio": self._ratio,
            "lowest_grad_norm": self._lowest,
            "growth_warnings_total": self._fired,
        }

    def state_dict(self) -> dict[str, Any]:
        state = {"lowest": self._lowest, "ratio": self._ratio, "armed": self._armed}
        return json_safe({**state, "fired": self._fired})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._lowest = None if state["lowest"] is None else float(state["lowest"])
        self._ratio = None if state["ratio"] is None else float(state["ratio"])
        self._armed = bool(state["armed"])
        self._fired = int(state["fired"])
