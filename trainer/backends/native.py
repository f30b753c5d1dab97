"""The native backend: FSDP2, DDP or a single replica, on plain torch.distributed.

It runs on CPU, CUDA and Trainium's native ``neuron`` device (TorchNeuron: what differs there,
the device, the process group and the compiler backend, is ``trainer.backends.torchneuron``).

The model is sharded or wrapped by ``trainer.parallel.parallelize``; the step is plain torch
(gradient sync only on the last micro-batch, our ``clip_grad_norm_``, then the optimizer
unless a ``skip_step`` rule says no); checkpoints are DCP (``trainer.state``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stability.norms import clip_grad_norm_, param_norm
from trainer.backends.base import Backend, Decide, MicroBatches, StepOutcome, lm_loss, mean_loss
from trainer.backends.torchneuron import compile_kwargs
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
                 cfg: TrainerConfig, device: torch.device, after_update: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = cfg
        self.device = device
        self.after_update = after_update  # FP8 under FSDP2: the weights' scales, once per step
        self._interrupt: Callable[[], None] | None = None
        # Fine-tuning: the frozen base (NF4 under QLoRA) is reloaded at every start and never
        # changes, so norms and digests cover the trained adapters only.
        self._tracked = [(n, p) for n, p in model.named_parameters()
                         if p.requires_grad or cfg.finetune is None]
        # Compiled, the upcast and the log-softmax fuse: the fp32 logits (4 bytes x vocab x
        # tokens, 1 GB for the 1.14B model's batch) are never materialised.
        self.loss_fn = torch.compile(lm_loss, **compile_kwargs(device.type)) \
            if cfg.parallelism.compile else lm_loss

    @property
    def interrupt(self) -> Callable[[], None] | None:
        """Called at a step's safe points (its start, before and after its host sync, and
        before each of FSDP2's collectives): raises when the step must stop (an in-job
        recovery's order came: ``trainer.rejoin``)."""
        return self._interrupt

    @interrupt.setter
    def interrupt(self, check: Callable[[], None] | None) -> None:
        from trainer.parallel import check_before_collectives

        self._interrupt = check
        if check is not None:
            check_before_collectives(self.model, check)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 casts through its mixed-precision policy; DDP and none use autocast.
        if self.cfg.precision.param_dtype == "bf16" and self.cfg.parallelism.strategy != "fsdp2":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, micro_batches: MicroBatches, scale: float,
             decide: Decide | None) -> StepOutcome:
        accum = len(micro_batches)
        if self.interrupt is not None:
            self.interrupt()
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            loss_sum += self.forward_backward(inputs, targets, i == accum - 1, scale / accum)
        if self.interrupt is not None:  # before the norm's all-reduce
            self.interrupt()
        grad_norm = float(clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip))
        if self.interrupt is not None:  # the host sync may have ended with an abort
            self.interrupt()
        loss = mean_loss(loss_sum, accum, scale)
        # The verdict comes from globally reduced values, so every rank decides alike.
        skipped = bool(decide is not None and decide(loss, grad_norm))
        if not skipped:
            self.optimizer.step()
            if self.after_update is not None:
                self.after_update(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepOutcome(loss, grad_norm, skipped)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, sync: bool,
                         weight: float) -> torch.Tensor:
        """One micro-batch's forward, loss and backward (gradients reduced when ``sync``,
        the loss weighted by ``weight`` for the backward); its detached loss. A warm
        standby runs it once on a small copy of the model to compile ahead
        (``trainer.standby_compile``)."""
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        with _grad_sync(self.model, sync), self._autocast():
            loss = self.loss_fn(self.model(inputs), targets)
        (loss * weight).backward()
        return loss.detach()

    def param_norm(self) -> float:
        return float(param_norm([p for _, p in self._tracked]))

    def local_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        for name, param in self._tracked:
            yield name, param.to_local() if hasattr(param, "to_local") else param


class NativeBackend(Backend):
    """FSDP2 (``fully_shard`` per block, then the root), DDP, or none; optionally with LoRA /
    QLoRA adapters (``trainer.finetune``), FP8 linears (``trainer.precision.fp8``) and FSDP2's
    CPU offload (``trainer.parallelism.offload: params``)."""

    settings: WorkerSettings | None = None

    def setup(self, settings: WorkerSettings, dctx: DistContext) -> None:
        self.settings = settings

    def build_model(self, settings: WorkerSettings, dctx: DistContext) -> nn.Module:
        """The model to train; under LoRA/QLoRA with the frozen base loaded (and in NF4)."""
        from trainer import model as model_mod
        from trainer.parallel import parallelize
        from trainer.presets import resolve_model_args

        cfg = settings.trainer
        model = model_mod.build_model(resolve_model_args(cfg.model), device="meta")
        if cfg.precision.fp8:
            from trainer.precision import fp8

            fp8.convert(model, dctx.device, fsdp=self._fsdp(settings, dctx))
        if cfg.finetune is None:
            return parallelize(model, cfg.parallelism, cfg.precision, dctx, seed=cfg.seed)
        from trainer.finetune import add_adapters, prepare_base

        model = add_adapters(model, cfg.finetune)
        nf4_sharded = cfg.finetune.method == "qlora" and self._fsdp(settings, dctx)

        def load_base(m: nn.Module) -> None:
            # Every start, resumed or not: checkpoints hold the adapters only.
            prepare_base(m, cfg.finetune, str(cfg.model.init_from_hf),
                         shards=dctx.world_size if nf4_sharded else 1)

        if nf4_sharded:
            # NF4 before fully_shard: FSDP2 shards torchao's NF4 tensors as they are.
            return parallelize(model, cfg.parallelism, cfg.precision, dctx, seed=cfg.seed,
                               before_shard=load_base)
        model = parallelize(model, cfg.parallelism, cfg.precision, dctx, seed=cfg.seed)
        load_base(model)
        return model

    @staticmethod
    def _fsdp(settings: WorkerSettings, dctx: DistContext) -> bool:
        return settings.trainer.parallelism.strategy == "fsdp2" and dctx.distributed

    def build_stepper(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      settings: WorkerSettings, dctx: DistContext) -> TorchStepper:
        after = None
        if settings.trainer.precision.fp8 and self._fsdp(settings, dctx):
            from trainer.precision.fp8 import after_optimizer_step

            after = after_optimizer_step
        return TorchStepper(model, optimizer, scheduler, settings.trainer, dctx.device, after)

    def rejoin_unsupported(self, settings: WorkerSettings) -> str | None:
        cfg = settings.trainer
        if cfg.parallelism.strategy == "ddp":
            return "DDP's reducer holds the process group it was built with"
        if cfg.finetune is not None:
            return "fine-tuning reloads its frozen base at every start"
        return None

    def rejoin(self, stepper: Any, dctx: DistContext) -> None:
        from trainer.parallel import rebind_process_groups

        rebind_process_groups(stepper.model)

    def reset_step_state(self, stepper: Any) -> None:
        from trainer.parallel import fsdp_param_groups, reset_iteration

        if fsdp_param_groups(stepper.model):
            reset_iteration(stepper.model)
        stepper.optimizer.zero_grad(set_to_none=True)

    def checkpoint_state(self, stepper: Any, scheduler: Any, progress: Any, loader: Any,
                         rank: int) -> dict[str, Any]:
        from trainer.state import LoaderState, checkpoint_state

        state = checkpoint_state(stepper.model, stepper.optimizer, scheduler, progress, loader,
                                 rank)
        if self.settings is not None and self.settings.trainer.finetune is not None:
            from trainer.finetune import AdapterOptimState

            state["app"] = AdapterOptimState(stepper.model, stepper.optimizer)
        if getattr(loader, "per_rank_state", False):
            # Each rank reads its own rows (trainer.data.arrow): one entry per rank, as RNGs.
            del state["data"]
            state[f"data_rank{rank:05d}"] = LoaderState(loader)
        return state

    def checkpoint_meta(self) -> dict[str, Any]:
        meta = super().checkpoint_meta()
        cfg = self.settings.trainer if self.settings is not None else None
        if cfg is not None and cfg.finetune is not None:
            from trainer.finetune import finetune_meta

            meta["finetune"] = finetune_meta(cfg.finetune, str(cfg.model.init_from_hf))
            meta["state_layout"] = {**meta["state_layout"],
                                    "model_and_optimizer": "app (LoRA adapters and their "
                                                           "optimizer state only)"}
        if cfg is not None and cfg.data.format == "arrow":
            meta["state_layout"] = {**meta["state_layout"], "data_loader": "data_rank<RANK>"}
        return meta
