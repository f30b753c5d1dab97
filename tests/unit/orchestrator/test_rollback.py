"""Rollback decisions: the plan (restore point, data window, LR), the budget, what to discard."""

from __future__ import annotations

import pytest

from orchestrator.supervisor.rollback import (
    budget_refusal,
    plan_rollback,
    restore_step,
    steps_to_discard,
)
from stability import Event, StabilityConfig

CFG = StabilityConfig(rollback={"skip_batches": 50, "lr_scale": 0.5, "max_rollbacks": 2,
                                "window_steps": 1000}, lower_lr_scale=0.25)


def ev(action: str, step: int = 120, **figures: float | int) -> Event:
    return Event("grad_spike", step, "grad_spike", action, {"grad_norm": 9.0, **figures})


def test_rollback_restores_before_the_onset_and_skips_from_its_batch() -> None:
    plan = plan_rollback(ev("rollback"), onset_step=120, onset_batch=131, generation=3,
                         config=CFG)
    assert plan.restore_max_step == 119  # a checkpoint taken at the onset holds the damage
    assert plan.skip_window == (131, 181)
    assert plan.lr_scale == 0.5 and plan.action == "rollback" and plan.generation == 3
    assert plan.trigger["kind"] == "grad_spike" and plan.trigger["step"] == 120
    text = plan.describe()
    assert "step 120" in text and "[131, 181)" in text and "0.5" in text


def test_a_persistent_spike_rolls_back_to_its_onset_not_its_detection() -> None:
    event = Event("persistent_spike", 125, "persistent_spike", "rollback",
                  {"onset_step": 120, "length": 5})
    plan = plan_rollback(event, onset_step=120, onset_batch=119, generation=1, config=CFG)
    assert plan.detected_step == 125 and plan.restore_max_step == 119
    assert plan.skip_window == (119, 169)
    assert "onset at step 120" in plan.describe()


def test_lower_lr_retrains_the_same_data_with_a_smaller_lr() -> None:
    plan = plan_rollback(ev("lower_lr"), onset_step=120, onset_batch=119, generation=1,
                         config=CFG)
    assert plan.skip_window is None and plan.lr_scale == 0.25


def test_no_window_without_a_batch_index_or_with_zero_skip() -> None:
    assert plan_rollback(ev("rollback"), 120, None, 1, CFG).skip_window is None
    zero = StabilityConfig(rollback={"skip_batches": 0})
    assert plan_rollback(ev("rollback"), 120, 119, 1, zero).skip_window is None


def test_a_problem_at_the_first_step_restarts_from_scratch() -> None:
    assert plan_rollback(ev("rollback", step=1), 1, 0, 1, CFG).restore_max_step == 0


def test_only_rollback_actions_make_a_plan() -> None:
    with pytest.raises(ValueError, match="skip_step"):
        plan_rollback(ev("skip_step"), 120, 119, 1, CFG)


def test_budget_counts_rollbacks_whose_onsets_are_within_the_window() -> None:
    previous = [{"onset_step": 100}, {"onset_step": 900}]
    assert budget_refusal([], 50, CFG) is None
    assert budget_refusal(previous[:1], 1099, CFG) is None  # one in the window, max 2
    reason = budget_refusal(previous, 1050, CFG)  # 100 is 950 back: inside the window
    assert reason is not None
    assert "rollback 3 within 1000 steps" in reason and "max_rollbacks is 2" in reason
    assert "100, 900, 1050" in reason
    assert budget_refusal(previous, 1100, CFG) is None  # 100 has left the window
    assert budget_refusal([{"onset_step": None}, {}], 10, CFG) is None


def test_checkpoints_past_the_restore_point_are_discarded() -> None:
    assert steps_to_discard([10, 20, 30, 40], 24) == [30, 40]
    assert steps_to_discard([10, 20], 24) == []
    assert restore_step([10, 20, 30], 24) == 20
    assert restore_step([30], 24) is None
