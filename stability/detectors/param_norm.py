"""Jumps of the parameter norm between consecutive measured steps.

The parameter norm moves slowly (about 1,600 at init for the study's 7B model); a jump of its
ratio to the previous tracked value beyond ``jump_ratio`` is an early sign of trouble. Records
without a param norm are skipped (it need not be measured every step), so "consecutive" means
consecutive measurements. Non-finite values are left to the nonfinite rule and do not replace
the previous value. Only upward jumps are flagged: a drop is what weight decay and a rollback
to an older checkpoint both produce, and neither is an instability.
"""

from __future__ import annotations

from typing import Any

from stability._floats import json_safe
from stability.config import ParamNormConfig
from stability.detectors._window import usable
from stability.events import Event
from stability.records import StepRecord


class ParamNormDetector:
    """Emits ``param_norm_jump`` when norm / previous tracked norm exceeds ``jump_ratio``."""

    name = "param_norm"

    def __init__(self, config: ParamNormConfig, warmup_steps: int = 0) -> None:
        self.config = config
        self.warmup_steps = warmup_steps
        self._previous: float | None = None
        self._fired = 0

    def update(self, rec: StepRecord) -> list[Event]:
        p = rec.param_norm
        if not usable(p) or p < 0:  # type: ignore[operator]
            return []
        previous, self._previous = self._previous, p
        if previous is None or previous <= 0 or rec.step < self.warmup_steps:
            return []
        ratio = p / previous
        if ratio <= self.config.jump_ratio:
            return []
        self._fired += 1
        figures = {"param_norm": p, "previous": previous, "ratio": ratio}
        return [Event("param_norm_jump", rec.step, self.name, self.config.action, figures)]

    def summary(self) -> dict[str, Any]:
        return {"param_norm_jumps_total": self._fired}

    def state_dict(self) -> dict[str, Any]:
        return json_safe({"previous": self._previous, "fired": self._fired})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._previous = None if state["previous"] is None else float(state["previous"])
        self._fired = int(state["fired"])
