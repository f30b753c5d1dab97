"""The ``stability`` config section: one model per detector, composed by ``StabilityConfig``.

Every rule carries ``enabled`` and ``action``: what the orchestrator does when the rule fires.
``record`` writes a journal event, bumps a metric and logs a line; ``skip_step`` makes the worker
skip the optimizer update (the same decision on every rank, see ``SkipStepGuard``); ``rollback``
restores the newest checkpoint before the onset and skips a window of data (``rollback``);
``lower_lr`` scales the learning rate down without rolling back.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Action = Literal["record", "skip_step", "rollback", "lower_lr"]

_ACTION_HELP = (
    "What the orchestrator does when this rule fires: record, skip_step, rollback, lower_lr."
)


class _Section(BaseModel):
    # allow_inf_nan=False: a threshold of NaN would silently disable a rule.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class GradSpikeConfig(_Section):
    """Gradient-norm spikes against a running window (the Trainium study's rule by default).

    ``enabled`` switches only the onset/end events: the threshold rule (mode, window, margins)
    also defines what a spike is for ``persistent_spike``.
    """

    enabled: bool = Field(True, description="Report spike onsets and ends.")
    mode: Literal["absolute", "relative", "zscore"] = Field(
        "absolute",
        description=(
            "Threshold over the running window: absolute (r + margin), relative "
            "(r * (1 + rel_margin)), zscore (mean + zscore_k * std). No spike is called until "
            "the window holds `window` values."
        ),
    )
    window: int = Field(20, ge=2, description="Grad norms in the running mean r.")
    margin: float = Field(0.1, ge=0, description="absolute mode: spike when g > r + margin.")
    rel_margin: float = Field(
        0.1, ge=0, description="relative mode: spike when g > r * (1 + rel_margin)."
    )
    zscore_k: float = Field(3.0, gt=0, description="zscore mode: spike when g > mean + k * std.")
    include_spikes_in_mean: bool = Field(
        False,
        description=(
            "Let spiking steps enter the running window. Off by default: a long spike would "
            "otherwise raise r, end itself early and hide its own length."
        ),
    )
    histogram_max_length: int = Field(
        10, ge=1, description="Spike lengths 1..K get their own histogram bucket, longer go to >K."
    )
    action: Action = Field("record", description=_ACTION_HELP)


class GrowthConfig(_Section):
    """Growth of the grad norm over the lowest value seen after warm-up (a divergence warning)."""

    enabled: bool = Field(True, description="Warn when g / lowest g exceeds `ratio`.")
    ratio: float = Field(
        3.0, gt=1, description="Warn when g exceeds this multiple of the lowest g."
    )
    rearm_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "After a warning, warn again only once g / lowest has fallen to ratio * "
            "rearm_fraction (hysteresis, so noise around the threshold warns once)."
        ),
    )
    action: Action = Field("record", description=_ACTION_HELP)


class PersistentSpikeConfig(_Section):
    """A grad-norm spike (as grad_spike defines it) that lasts too long: divergence."""

    enabled: bool = Field(True, description="Fire once per spike that reaches `length` steps.")
    length: int = Field(5, ge=1, description="Spike length, in steps, that counts as persistent.")
    # Alert by default: early in training the grad norm wanders above r + 0.1 for many steps
    # (a 1.1B model on an H100 tripped four rollbacks in its first 100 steps), so rolling
    # back automatically is an operator's opt-in once thresholds are tuned by replay.
    action: Action = Field("record", description=_ACTION_HELP)


class NonFiniteConfig(_Section):
    """NaN or infinite loss, grad norm or param norm: fires at once, warm-up or not."""

    enabled: bool = Field(True, description="Check every step for non-finite values.")
    action: Action = Field("rollback", description=_ACTION_HELP)


class LossSpikeConfig(_Section):
    """Loss spikes against the loss's own running mean and std."""

    enabled: bool = Field(
        True, description="Report loss spikes (one event per run of consecutive spiking steps)."
    )
    window: int = Field(50, ge=2, description="Losses in the running window.")
    zscore_k: float | None = Field(
        6.0, gt=0, description="Spike when loss > mean + k * std (null: no z-score criterion)."
    )
    ratio: float | None = Field(
        None, gt=1, description="Spike when loss > mean * ratio (null: no ratio criterion)."
    )
    action: Action = Field("record", description=_ACTION_HELP)


class LossConfig(_Section):
    """Rules on the loss value."""

    nonfinite: NonFiniteConfig = Field(
        default_factory=NonFiniteConfig, description="Non-finite values."
    )
    spike: LossSpikeConfig = Field(default_factory=LossSpikeConfig, description="Loss spikes.")


class ParamNormConfig(_Section):
    """Jumps of the parameter norm between consecutive measured steps (an early signal)."""

    enabled: bool = Field(True, description="Flag jumps of the tracked parameter norm.")
    jump_ratio: float = Field(
        1.5, gt=1, description="Flag when norm / previous tracked norm exceeds this."
    )
    action: Action = Field("record", description=_ACTION_HELP)


class RollbackPolicy(_Section):
    """How a rollback is carried out, and how many are allowed."""

    skip_batches: int = Field(50, ge=0, description="Global batches skipped past the spike onset.")
    lr_scale: float = Field(
        1.0, gt=0, le=1, description="Multiplier applied to the LR after a rollback (e.g. 0.5)."
    )
    max_rollbacks: int = Field(
        3, ge=0, description="Rollbacks allowed within window_steps; one more FAILS the job."
    )
    window_steps: int = Field(1000, ge=1, description="Steps over which max_rollbacks is counted.")


class StabilityConfig(_Section):
    """Training-stability detectors and the responses to them."""

    warmup_steps: int = Field(
        20,
        ge=0,
        description=(
            "No events before this step (except nonfinite); running statistics still accumulate."
        ),
    )
    grad_spike: GradSpikeConfig = Field(
        default_factory=GradSpikeConfig, description="Grad spikes."
    )
    growth: GrowthConfig = Field(default_factory=GrowthConfig, description="Grad-norm growth.")
    persistent_spike: PersistentSpikeConfig = Field(
        default_factory=PersistentSpikeConfig, description="Spikes that do not end."
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="Loss rules.")
    param_norm: ParamNormConfig = Field(
        default_factory=ParamNormConfig, description="Parameter-norm jumps."
    )
    rollback: RollbackPolicy = Field(default_factory=RollbackPolicy, description="Rollbacks.")
    lower_lr_scale: float = Field(
        0.5, gt=0, lt=1, description="Multiplier applied to the LR by a rule with action lower_lr."
    )

    def rule_actions(self) -> dict[str, str]:
        """Dotted rule name -> action, for the enabled rules."""
        rules = {
            "grad_spike": self.grad_spike,
            "growth": self.growth,
            "persistent_spike": self.persistent_spike,
            "loss.nonfinite": self.loss.nonfinite,
            "loss.spike": self.loss.spike,
            "param_norm": self.param_norm,
        }
        return {name: rule.action for name, rule in rules.items() if rule.enabled}

    @model_validator(mode="after")
    def _check_consistency(self) -> StabilityConfig:
        # Collect every cross-field problem and raise once (field ranges are pydantic's job).
        problems: list[str] = []
        spike = self.loss.spike
        if spike.enabled and spike.zscore_k is None and spike.ratio is None:
            problems.append(
                "loss.spike.zscore_k / loss.spike.ratio: both are null while loss.spike.enabled "
                "is true; set at least one, or disable the rule"
            )
        if self.rollback.max_rollbacks == 0:
            for name, action in self.rule_actions().items():
                if action == "rollback":
                    problems.append(
                        f"{name}.action: is 'rollback' but rollback.max_rollbacks is 0, so the "
                        "first firing would fail the job"
                    )
        if problems:
            raise ValueError("invalid stability config:\n  - " + "\n  - ".join(problems))
        return self
