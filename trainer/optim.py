"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine LR schedule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:  # annotations only: any object with these fields will do
    from trainer.config import OptimizerConfig, ScheduleConfig

__all__ = ["param_groups", "build_optimizer", "lr_at", "LRLambda", "ScheduledLR", "build_scheduler"]


class _ScheduleLike(Protocol):
    warmup_steps: int
    decay: str
    min_lr_ratio: float


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict[str, Any]]:
    """``model``'s trainable parameters in AdamW's two groups.

    Group 0 (weight decay ``cfg.weight_decay``): parameters of 2 or more dimensions (linear
    weights, embeddings). Group 1 (no decay): 1-D parameters (norm weights, biases), because
    decaying a norm's gain toward 0 only fights the normalisation. ``ndim`` of an FSDP2 DTensor
    parameter is its global rank, and a tensor-parallel shard keeps its rank, so the split is
    the same sharded or not.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters")
    return [{"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig,
                    device_type: str) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters in the two groups of ``param_groups``.

    Fused kernels by default on CUDA (``cfg.fused`` overrides), multi-tensor foreach otherwise.
    """
    fused = cfg.fused if cfg.fused is not None else device_type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        # fused and foreach are exclusive: ask for exactly one implementation.
        fused=True if fused else None, foreach=None if fused else True,
    )


def lr_at(step: int, peak: float, sched: _ScheduleLike, total_steps: int) -> float:
    """Learning rate of 0-based optimizer step ``step``.

    Warmup: ``peak * (step + 1) / warmup_steps`` for ``step < warmup_steps``, so the first step
    already moves the weights and the last warmup step reaches the peak. Then either constant
    at ``peak`` or a cosine from ``peak`` at ``warmup_steps`` down to ``min_lr_ratio * peak``
    at ``total_steps`` (and held there past it).
    """
    if step < 0:
        raise ValueError(f"step {step} is negative")
    warmup = sched.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if sched.decay == "constant":
        return peak
    if sched.decay != "cosine":
        raise ValueError(f"unknown decay {sched.decay!r}")
    floor = sched.min_lr_ratio * peak
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRLambda:
    """Picklable multiplier of the peak LR for ``LambdaLR``: ``lr_at(step, 1.0, ...) * scale``.

    Holds only plain numbers and strings, copied out of the ScheduleConfig.
    """

    def __init__(self, sched: _ScheduleLike, total_steps: int, lr_scale: float = 1.0) -> None:
        self.warmup_steps = int(sched.warmup_steps)
        self.decay = str(sched.decay)
        self.min_lr_ratio = float(sched.min_lr_ratio)
        self.total_steps = int(total_steps)
        self.lr_scale = float(lr_scale)

    def __call__(self, step: int) -> float:
        return lr_at(step, 1.0, self, self.total_steps) * self.lr_scale


class ScheduledLR(LambdaLR):
    """``LambdaLR`` whose schedule always comes from the config, never from a checkpoint.

    Plain ``LambdaLR`` saves its lambda's attributes and restores them on load, which would
    silently undo a lowered ``lr_scale`` after a rollback. Here only the position
    (``last_epoch`` and friends) is saved; loading keeps the constructed schedule and base LRs
    and writes the resumed step's LR into the optimizer. Load the optimizer state first, then
    this, so the optimizer's saved ``lr`` is overwritten rather than the other way round.
    """

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)  # never mutate the caller's dict
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        state.pop("base_lrs", None)
        super().load_state_dict(state)
        lrs = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def build_scheduler(optimizer: torch.optim.Optimizer, sched: ScheduleConfig, total_steps: int,
                    lr_scale: float = 1.0) -> ScheduledLR:
    """Warmup + cosine/constant schedule over ``total_steps``, every LR times ``lr_scale``.

    Call ``scheduler.step()`` once after each ``optimizer.step()``; optimizer step ``s`` then
    runs at ``lr_at(s, peak, sched, total_steps) * lr_scale``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if lr_scale <= 0:
        raise ValueError(f"lr_scale must be positive, got {lr_scale}")
    return ScheduledLR(optimizer, lr_lambda=LRLambda(sched, total_steps, lr_scale))
