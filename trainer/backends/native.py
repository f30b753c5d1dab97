"""The native backend: FSDP2, DDP or a single replica, on plain torch.distributed.

The model is sharded or wrapped by ``trainer.parallel.parallelize``; the step is plain torch
(gradient sync only on the last micro-batch, our ``clip_grad_norm_``, then the optimizer
unless a ``skip_step`` rule says no); checkpoints are DCP (``trainer.state``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stability.norms import clip_grad_norm_, param_norm
from trainer.backends.base import Backend, Decide, MicroBatches, StepOutcome, lm_loss, mean_loss
from trainer.distributed import DistContext

if TYPE_CHECKING:
    from trainer.config import TrainerConfig
    from trainer.settings import WorkerSettings


def _grad_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Reduce gradients only on the last micro-batch of an accumulation window."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


class TorchStepper:
    """The plain torch step (FSDP2, DDP, none)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 cfg: TrainerConfig, device: torch.device) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = cfg
        self.device = device
        # Compiled, the upcast and the log-softmax fuse: the fp32 logits (4 bytes x vocab x
        # tokens, 1 GB for the 1.14B model's batch) are never materialised.
        self.loss_fn = torch.compile(lm_loss) if cfg.parallelism.compile else lm_loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 casts through its mixed-precision policy; DDP and none use autocast.
        if self.cfg.precision.param_dtype == "bf16" and self.cfg.parallelism.strategy != "fsdp2":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, micro_batches: MicroBatches, scale: float,
             decide: Decide | None) -> StepOutcome:
        accum = len(micro_batches)
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with _grad_sync(self.model, i == accum - 1), self._autocast():
                loss = self.loss_fn(self.model(inputs), targets)
            (loss * (scale / accum)).backward()
            loss_sum += loss.detach()
        grad_norm = float(clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip))
        loss = mean_loss(loss_sum, accum, scale)
        # The verdict comes from globally reduced values, so every rank decides alike.
        skipped = bool(decide is not None and decide(loss, grad_norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepOutcome(loss, grad_norm, skipped)

    def param_norm(self) -> float:
        return float(param_norm(self.model.parameters()))

    def local_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.to_local() if hasattr(param, "to_local") else param


class NativeBackend(Backend):
    """FSDP2 (``fully_shard`` per block, then the root), DDP, or none."""

    def build_model(self, settings: WorkerSettings, dctx: DistContext) -> nn.Module:
        from trainer import model as model_mod
        from trainer.parallel import parallelize
        from trainer.presets import resolve_model_args

        cfg = settings.trainer
        model = model_mod.build_model(resolve_model_args(cfg.model), device="meta")
        return parallelize(model, cfg.parallelism, cfg.precision, dctx, seed=cfg.seed)

    def build_stepper(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      settings: WorkerSettings, dctx: DistContext) -> TorchStepper:
        return TorchStepper(model, optimizer, scheduler, settings.trainer, dctx.device)

    def checkpoint_state(self, stepper: Any, scheduler: Any, progress: Any, loader: Any,
                         rank: int) -> dict[str, Any]:
        from trainer.state import checkpoint_state

        return checkpoint_state(stepper.model, stepper.optimizer, scheduler, progress, loader,
                                rank)
