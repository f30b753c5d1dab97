"""Rollback decisions as pure functions: what to restore, which data to skip, whether allowed.

A rule whose action is ``rollback`` (or ``lower_lr``) makes the supervisor stop the job and
restart it from the newest committed checkpoint *older than the problem's onset* (a checkpoint
written at or after the onset already holds the damage). ``rollback`` also moves the data
position past a window of global batches starting at the onset's batch; ``lower_lr`` retrains
the same data with the learning rate scaled down.

Why the window starts at the onset's batch: the checkpoint restored was taken after step
``c < onset``, so the restarted ranks read batches ``c .. onset_batch - 1`` again, exactly as
before, and then jump to ``onset_batch + skip_batches``. A run configured with
``trainer.data.skip_windows: [[onset_batch, onset_batch + skip_batches]]`` from the start reads
the very same sequence of batches at the very same steps, so on a deterministic run both end
with bit-identical parameters (the integration tests hold this).

The budget: at most ``max_rollbacks`` rollbacks whose onsets lie within ``window_steps`` of each
other; one more fails the job with the reason, since a run that keeps diverging over the same
stretch needs a person, not another retry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.contracts.steprecord import MAX_STEP
from stability.config import StabilityConfig
from stability.events import Event


# The largest batch index a window may reach (a step record's and the journal's bound).
MAX_BATCH = MAX_STEP


@dataclass(frozen=True)
class RollbackPlan:
    """What a divergence calls for, decided when the rule fires."""

    action: str  # rollback | lower_lr
    trigger: dict[str, Any]  # the event that asked for it (Event.to_dict())
    generation: int
    detected_step: int
    onset_step: int
    onset_batch: int | None
    restore_max_step: int  # the restored checkpoint is the newest committed at or below this
    skip_window: tuple[int, int] | None
    lr_scale: float  # this rollback's multiplier on the learning rate

    def describe(self) -> str:
        """One line for the failure record and the log."""
        what = f"{self.trigger.get('kind')} ({self.trigger.get('rule')}) at step " \
               f"{self.detected_step}"
        if self.onset_step != self.detected_step:
            what += f", onset at step {self.onset_step}"
        plan = f"{self.action}: restore a checkpoint at or before step {self.restore_max_step}"
        if self.skip_window is not None:
            plan += f", skip batches [{self.skip_window[0]}, {self.skip_window[1]})"
        if self.lr_scale != 1.0:
            plan += f", scale the LR by {self.lr_scale:g}"
        return f"divergence: {what}; {plan}"


def plan_rollback(event: Event, onset_step: int, onset_batch: int | None, generation: int,
                  config: StabilityConfig) -> RollbackPlan:
    """The plan for ``event`` (action ``rollback`` or ``lower_lr``) whose problem began at
    ``onset_step``, trained on global batch ``onset_batch`` (None when records carry none)."""
    if event.action not in ("rollback", "lower_lr"):
        raise ValueError(f"event action {event.action!r} does not call for a rollback")
    policy = config.rollback
    window = None
    if event.action == "rollback" and onset_batch is not None and policy.skip_batches > 0 \
            and onset_batch + policy.skip_batches <= MAX_BATCH:
        # A window past MAX_BATCH is no data position (and no journal event could hold it):
        # the rollback then retrains without skipping.
        window = (onset_batch, onset_batch + policy.skip_batches)
    scale = policy.lr_scale if event.action == "rollback" else config.lower_lr_scale
    return RollbackPlan(action=event.action, trigger=event.to_dict(), generation=generation,
                        detected_step=event.step, onset_step=onset_step,
                        onset_batch=onset_batch, restore_max_step=max(0, onset_step - 1),
                        skip_window=window, lr_scale=scale)


def budget_refusal(previous: Iterable[Mapping[str, Any]], onset_step: int,
                   config: StabilityConfig) -> str | None:
    """Why one more rollback (onset ``onset_step``) is not allowed, or None when it is.

    ``previous`` are the journal's earlier ``rollback`` events; those whose onset lies within
    ``window_steps`` of this one count against ``max_rollbacks``.
    """
    policy = config.rollback
    recent = [int(r["onset_step"]) for r in previous
              if r.get("onset_step") is not None
              and abs(onset_step - int(r["onset_step"])) < policy.window_steps]
    if len(recent) < policy.max_rollbacks:
        return None
    onsets = ", ".join(str(s) for s in sorted(recent + [onset_step]))
    return (f"rollback budget spent: a divergence at step {onset_step} would be rollback "
            f"{len(recent) + 1} within {policy.window_steps} steps (onsets at steps {onsets}); "
            f"stability.rollback.max_rollbacks is {policy.max_rollbacks}")


def steps_to_discard(checkpoint_steps: Iterable[int], restore_max_step: int) -> list[int]:
    """Checkpoints newer than the restore point: the abandoned lineage, never to be resumed."""
    return sorted(s for s in checkpoint_steps if s > restore_max_step)


def restore_step(committed_steps: Iterable[int], restore_max_step: int) -> int | None:
    """The checkpoint a rollback restores: the newest committed at or below the limit."""
    eligible = [s for s in committed_steps if s <= restore_max_step]
    return max(eligible) if eligible else None
