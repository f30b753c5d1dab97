"""Checkpointed extras: the skip-step guard's state and the per-rank parameter digest."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stability import SkipStepGuard, StabilityConfig
from trainer.model import build_model
from trainer.presets import ModelArgs
from trainer.state import GuardState, params_digest


def test_params_digest_sees_a_single_changed_value(small_args: ModelArgs) -> None:
    torch.manual_seed(0)
    a = build_model(small_args)
    torch.manual_seed(0)
    b = build_model(small_args)
    assert params_digest(a) == params_digest(b)
    assert params_digest(a)["numel"] == a.num_params()
    with torch.no_grad():
        next(b.parameters()).view(-1)[7] += 1e-6
    assert params_digest(a)["crc32"] != params_digest(b)["crc32"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_guard_state_rides_in_a_dcp_checkpoint(tmp_path) -> None:
    cfg = StabilityConfig(warmup_steps=3, grad_spike={"window": 3, "action": "skip_step"})
    guard = SkipStepGuard(cfg)
    for step in range(1, 8):
        guard.should_skip(step, 2.0, 1.0 + 0.01 * step)
    dcp.save({"stability": GuardState(guard)}, checkpoint_id=str(tmp_path))
    restored = SkipStepGuard(cfg)
    dcp.load({"stability": GuardState(restored)}, checkpoint_id=str(tmp_path))
    # The restored guard calls the next spike exactly as the original does.
    assert restored.should_skip(8, 2.0, 9.0) and guard.should_skip(8, 2.0, 9.0)
    assert restored.state_dict() == guard.state_dict()
