"""The training loop. It receives built parts; it builds nothing itself."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from stability.norms import clip_grad_norm_, param_norm
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import TrainerConfig
from trainer.distributed import DistContext, all_reduce_mean
from trainer.state import Progress, params_digest

# A poisoned batch (chaos) scales its loss, hence its gradients, by this much: a gradient
# explosion the stability detectors must catch, reproducible from the batch index alone.
POISON_SCALE = 1e4


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


@dataclass
class Parts:
    cfg: TrainerConfig
    dctx: DistContext
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    progress: Progress
    checkpointer: Checkpointer
    checkpoint_state: dict[str, Any]
    worker: Any  # orchestrator.worker.Worker (or a stand-in with the same methods)
    checkpoint_interval: int
    log: Callable[[str], None]
    skip_guard: Any = None  # stability.SkipStepGuard when a rule asks for skip_step
    poison_batches: set[int] = field(default_factory=set)
    slow_checkpoint_s: float = 0.0  # chaos: extra blocking time per save
    slow_first_step_s: float = 0.0  # chaos: extra time in each generation's first step
    startup: dict[str, float | None] | None = None  # wall times of start-up milestones
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss


def _grad_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Reduce gradients only on the last micro-batch of an accumulation window."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def _autocast(p: Parts) -> contextlib.AbstractContextManager:
    # FSDP2 casts through its mixed-precision policy; other strategies use autocast.
    if p.cfg.precision.param_dtype == "bf16" and p.cfg.parallelism.strategy != "fsdp2":
        return torch.autocast(p.dctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(p: Parts) -> dict[str, Any]:
    """One optimizer step over one global batch; returns the step record's figures."""
    t0 = time.perf_counter()
    batch = p.loader.next_batch()
    data_s = time.perf_counter() - t0
    scale = POISON_SCALE if batch.index in p.poison_batches else 1.0
    accum = len(batch.micro_batches)
    p.model.train()
    loss_sum = torch.zeros((), device=p.dctx.device)
    for i, (inputs, targets) in enumerate(batch.micro_batches):
        inputs = inputs.to(p.dctx.device, non_blocking=True)
        targets = targets.to(p.dctx.device, non_blocking=True)
        with _grad_sync(p.model, i == accum - 1), _autocast(p):
            logits = p.model(inputs)
            loss = p.loss_fn(logits, targets)
        (loss * (scale / accum)).backward()
        loss_sum += loss.detach()
    grad_norm = clip_grad_norm_(p.model.parameters(), p.cfg.optimizer.grad_clip)
    loss_value = float(all_reduce_mean(loss_sum / accum)) * scale
    gnorm = float(grad_norm)
    next_step = p.progress.step + 1
    skipped = bool(p.skip_guard is not None and p.skip_guard.active
                   and p.skip_guard.should_skip(next_step, loss_value, gnorm))
    if not skipped:
        p.optimizer.step()
    p.optimizer.zero_grad(set_to_none=True)
    lr = p.scheduler.get_last_lr()[0]
    p.scheduler.step()
    p.progress.step = next_step
    p.progress.tokens += batch.tokens * p.dctx.world_size
    record: dict[str, Any] = {"loss": loss_value, "grad_norm": gnorm, "lr": lr,
                              "tokens": p.progress.tokens, "batch": batch.index,
                              "data_s": round(data_s, 6)}
    if skipped:
        record["skipped"] = True
    if next_step % p.cfg.param_norm_every == 0:
        record["param_norm"] = float(param_norm(p.model.parameters()))
    record["step_time"] = time.perf_counter() - t0
    return record


def train(p: Parts) -> None:
    """Steps until ``cfg.steps``; checkpoints every interval and always at the last step."""
    cfg = p.cfg
    first = True
    while p.progress.step < cfg.steps:
        rec = train_step(p)
        if first and p.slow_first_step_s:
            time.sleep(p.slow_first_step_s)
        if first and p.startup is not None and p.dctx.is_main:
            # Where a (re)start's seconds went: process start, imports, process group,
            # build + restore, first step (the recovery benchmark reads this).
            p.worker.event("startup", first_step_done=time.time(), **p.startup)
        first = False
        step = p.progress.step
        if step % p.checkpoint_interval == 0 or step == cfg.steps:
            with p.worker.phase("checkpointing"):
                if p.slow_checkpoint_s:
                    time.sleep(p.slow_checkpoint_s)
                rec["ckpt_block_s"] = p.checkpointer.save(step, p.checkpoint_state,
                                                          p.progress.tokens)
        p.checkpointer.poll()
        p.worker.step_done(step, **rec)
        if p.dctx.is_main and (step % cfg.log_every == 0 or step == cfg.steps or step == 1):
            loss = rec["loss"]
            p.log(f"step {step}/{cfg.steps} loss {loss:.4f} grad_norm {rec['grad_norm']:.3f} "
                  f"lr {rec['lr']:.2e} tokens {rec['tokens']} "
                  f"step_time {rec['step_time'] * 1000:.0f} ms"
                  + (" (update skipped)" if rec.get("skipped") else "")
                  + ("" if math.isfinite(loss) else " NON-FINITE LOSS"))
    # The last save and its upload: a phase of its own, so the hang timeout of a phase with
    # no steps (checkpointing) applies, not the calibrated step interval.
    with p.worker.phase("checkpointing"):
        p.checkpointer.finish()
    # Every rank reports its parameters' checksum: replicas (DDP) that disagree have drifted.
    digest = params_digest(p.model)
    p.log(f"final parameters: crc32 {digest['crc32']} over {digest['numel']} local values")
    p.worker.event("params_digest", step=p.progress.step, **digest)
