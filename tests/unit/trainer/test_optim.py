"""AdamW parameter groups and the warmup + cosine schedule."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from trainer.config import OptimizerConfig, ScheduleConfig
from trainer.model import build_model
from trainer.optim import LRLambda, build_optimizer, build_scheduler, lr_at
from trainer.presets import ModelArgs

PEAK = 1e-3


def test_warmup_endpoints_and_linear_ramp() -> None:
    sched = ScheduleConfig(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_at(0, PEAK, sched, 100) == pytest.approx(PEAK / 10)
    assert lr_at(4, PEAK, sched, 100) == pytest.approx(PEAK * 5 / 10)
    assert lr_at(9, PEAK, sched, 100) == pytest.approx(PEAK)
    warm = [lr_at(s, PEAK, sched, 100) for s in range(10)]
    assert all(b > a for a, b in zip(warm, warm[1:]))


def test_cosine_endpoints_midpoint_and_monotone_decay() -> None:
    sched = ScheduleConfig(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_at(10, PEAK, sched, 110) == pytest.approx(PEAK)
    assert lr_at(60, PEAK, sched, 110) == pytest.approx(0.55 * PEAK)  # halfway: mean of ends
    assert lr_at(110, PEAK, sched, 110) == pytest.approx(0.1 * PEAK)
    assert lr_at(500, PEAK, sched, 110) == pytest.approx(0.1 * PEAK)  # held past the end
    decay = [lr_at(s, PEAK, sched, 110) for s in range(10, 111)]
    assert all(b < a for a, b in zip(decay, decay[1:]))


def test_constant_and_no_warmup() -> None:
    const = ScheduleConfig(warmup_steps=3, decay="constant")
    assert [lr_at(s, PEAK, const, 50) for s in (2, 3, 49, 80)] == [PEAK] * 4
    no_warm = ScheduleConfig(warmup_steps=0, decay="cosine", min_lr_ratio=0.0)
    assert lr_at(0, PEAK, no_warm, 20) == pytest.approx(PEAK)
    assert lr_at(20, PEAK, no_warm, 20) == pytest.approx(0.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                 vocab_size=50, max_seq_len=16))


def test_weight_decay_groups_split_matrices_from_vectors() -> None:
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert ids == {id(p) for p in model.parameters()}
    assert len(ids) == len(decay["params"]) + len(no_decay["params"])
    assert any(p is model.tok_embeddings.weight for p in decay["params"])
    assert any(p is model.norm.weight for p in no_decay["params"])
    assert not opt.defaults["fused"] and opt.defaults["foreach"]
    fused = build_optimizer(model, OptimizerConfig(fused=True), device_type="cpu")
    assert fused.defaults["fused"] and not fused.defaults["foreach"]


def test_weight_decay_shrinks_only_matrices() -> None:
    model = _model()
    with torch.no_grad():
        model.norm.weight.fill_(2.0)
    opt = build_optimizer(model, OptimizerConfig(lr=0.1, weight_decay=0.5), device_type="cpu")
    before_w = model.output.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: only decoupled decay can move weights
    opt.step()
    torch.testing.assert_close(model.output.weight, before_w * (1 - 0.1 * 0.5))
    assert torch.equal(model.norm.weight, torch.full_like(model.norm.weight, 2.0))


def _run(total: int, steps: int, lr_scale: float = 1.0, state=None):
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(lr=PEAK), device_type="cpu")
    sched = build_scheduler(opt, ScheduleConfig(warmup_steps=5, min_lr_ratio=0.1), total,
                            lr_scale=lr_scale)
    if state is not None:
        opt.load_state_dict(state[0])
        sched.load_state_dict(state[1])
    lrs = []
    for _ in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return opt, sched, lrs


def test_scheduler_follows_lr_at_times_scale() -> None:
    cfg = ScheduleConfig(warmup_steps=5, min_lr_ratio=0.1)
    _, _, lrs = _run(total=30, steps=30, lr_scale=0.5)
    for step, pair in enumerate(lrs):
        want = 0.5 * lr_at(step, PEAK, cfg, 30)
        assert pair == [pytest.approx(want), pytest.approx(want)]


def test_scheduler_state_round_trip_resumes_exactly() -> None:
    _, _, straight = _run(total=30, steps=20)
    opt, sched, first = _run(total=30, steps=8)
    state = (opt.state_dict(), sched.state_dict())
    json.dumps(state[1])  # plain data: no callables in the scheduler state
    assert state[1]["last_epoch"] == 8
    _, _, rest = _run(total=30, steps=12, state=state)
    assert first + rest == straight


def test_lowered_lr_scale_survives_loading_an_older_state() -> None:
    opt, sched, _ = _run(total=30, steps=8)
    state = (opt.state_dict(), sched.state_dict())
    _, resumed, lrs = _run(total=30, steps=3, lr_scale=0.25, state=state)
    cfg = ScheduleConfig(warmup_steps=5, min_lr_ratio=0.1)
    assert lrs[0][0] == pytest.approx(0.25 * lr_at(8, PEAK, cfg, 30))
    assert resumed.lr_lambdas[0].lr_scale == 0.25


def test_lr_lambda_pickles_as_plain_data() -> None:
    fn = LRLambda(ScheduleConfig(warmup_steps=4), total_steps=40, lr_scale=0.5)
    clone = pickle.loads(pickle.dumps(fn))
    assert [clone(s) for s in range(45)] == [fn(s) for s in range(45)]
    assert all(isinstance(v, (int, float, str)) for v in vars(fn).values())
