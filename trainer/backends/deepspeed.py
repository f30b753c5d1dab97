"""DeepSpeed ZeRO (stages 0-3): our model, optimizer and schedule inside a DeepSpeed engine.

The model is our Transformer, materialised from ``trainer.seed`` exactly as for the other
strategies (so a DeepSpeed run starts from the same weights as an FSDP2 run); the optimizer
is our torch AdamW (``trainer.optim.build_optimizer``), handed to ``deepspeed.initialize``,
which wraps it in its ZeRO optimizer (DeepSpeed's FusedAdam would compile a kernel first).
The LR schedule stays ours and outside the engine: we step it after each optimizer step and
checkpoint its position ourselves, so that loading restores the optimizer first and then
writes the schedule's LR (``ScheduledLR``), as with DCP; DeepSpeed would load the schedule
before the ZeRO optimizer state, whose saved LR would then win.

The step is ``engine(inputs)``, ``engine.backward(loss)``, ``engine.step()`` per micro-batch:
the engine divides the loss by the accumulation steps, reduces gradients and applies the
update (with clipping) only at the accumulation boundary. The gradient norm comes from
``engine.get_global_grad_norm()`` afterwards, except at stage 0 in fp32, where DeepSpeed
clips with ``clip_grad_norm_`` and drops the norm: there we take it from the reduced
gradients just before ``engine.step()``.

``skip_step`` rules cannot apply here: DeepSpeed computes the gradient norm inside
``engine.step()``, the same call that applies the update, and offers no supported way to
decide between the two. Config validation rejects the combination (``trainer.config``).

DeepSpeed is imported inside functions only: other strategies never need it installed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from stability.norms import param_norm
from trainer.backends.base import Backend, Decide, MicroBatches, StepOutcome, lm_loss, mean_loss
from trainer.backends.deepspeed_checkpoint import (
    ENGINE,
    RNG,
    DeepSpeedCheckpointer,
    EngineState,
)
from trainer.distributed import DistContext

if TYPE_CHECKING:
    from trainer.config import TrainerConfig
    from trainer.settings import WorkerSettings

# DeepSpeed prints throughput every steps_per_print steps; the orchestrator has its own.
NEVER = 10**12
# DeepSpeed's default ZeRO bucket (elements) for gradient reduction and parameter gathering.
DEFAULT_BUCKET = 500_000_000


def deepspeed_config(cfg: TrainerConfig) -> dict[str, Any]:
    """The DeepSpeed config (the JSON ``deepspeed.initialize`` takes) derived from ours."""
    from trainer.presets import resolve_model_args

    # A bucket larger than the model only costs memory: DeepSpeed allocates whole buckets,
    # and under deterministic mode torch fills every fresh allocation (NaN), which made
    # 2 GB buffers cost 1.3 s per step of the tiny CPU model instead of 30 ms.
    bucket = min(DEFAULT_BUCKET, resolve_model_args(cfg.model).num_params())
    zero: dict[str, Any] = {"stage": cfg.parallelism.zero_stage, "reduce_bucket_size": bucket}
    if cfg.parallelism.zero_stage in (1, 2):
        zero["allgather_bucket_size"] = bucket
    elif cfg.parallelism.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket
    offload = cfg.parallelism.offload
    extra: dict[str, Any] = {}
    if offload in ("optimizer", "params"):
        # ZeRO-Offload: fp32 master weights, Adam state and the step on the CPU. Our torch
        # AdamW steps there (DeepSpeedCPUAdam would first compile a C++ op on every machine),
        # so DeepSpeed is told not to insist on its own CPU optimizer.
        pin = torch.cuda.is_available()
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        extra["zero_force_ds_cpu_optimizer"] = False
        if offload == "params":  # ZeRO-Infinity's parameter offload (stage 3, validated)
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    out: dict[str, Any] = {
        **extra,
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch_size,
        "gradient_accumulation_steps": cfg.data.grad_accum_steps,
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": zero,
        # Gradient reductions in the dtype the config asks for (fp32 under bf16 compute).
        "communication_data_type": cfg.precision.reduce_dtype,
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
    }
    if cfg.precision.param_dtype == "bf16":
        # bf16 weights and compute; fp32 master weights and Adam state in the ZeRO optimizer.
        out["bf16"] = {"enabled": True}
    return out


def _zero3_local(param: torch.Tensor) -> torch.Tensor:
    """This rank's own elements of a ZeRO-3 partitioned parameter: its flat partition
    (``ds_tensor``) without the padding that rounds the last partition up."""
    part = param.ds_tensor
    start = dist.get_rank(group=param.ds_process_group) * part.numel()
    return part.narrow(0, 0, max(0, min(part.numel(), param.ds_numel - start)))


class DeepSpeedStepper:
    """One optimizer step through a DeepSpeed engine (see the module docstring)."""

    def __init__(self, engine: Any, scheduler: Any, device: torch.device) -> None:
        self.model = engine
        self.engine = engine
        self.optimizer = engine.optimizer
        self.scheduler = scheduler
        self.device = device
        self.zero3 = engine.zero_optimization_stage() == 3
        # Stage 0 in fp32 clips with torch's clip_grad_norm_ and discards the norm
        # (DeepSpeedEngine.clip_fp32_gradients), so get_global_grad_norm() stays None.
        self._own_norm = engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled()

    def step(self, micro_batches: MicroBatches, scale: float,
             decide: Decide | None) -> StepOutcome:
        if decide is not None:
            raise RuntimeError("skip_step cannot be applied under DeepSpeed (the config "
                               "validation rejects it: see trainer.backends.deepspeed)")
        engine = self.engine
        accum = len(micro_batches)
        if accum != engine.gradient_accumulation_steps():
            raise RuntimeError(f"{accum} micro-batches, but the engine accumulates "
                               f"{engine.gradient_accumulation_steps()}")
        engine.train()
        loss_sum = torch.zeros((), device=self.device)
        own_norm = None
        for inputs, targets in micro_batches:
            loss = lm_loss(engine(inputs.to(self.device)), targets.to(self.device))
            engine.backward(loss * scale)  # the engine divides by the accumulation steps
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary and self._own_norm:
                # At the boundary, backward has already all-reduced the gradients.
                grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                own_norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
            engine.step()  # the update (and clipping) happens at the boundary only
            loss_sum += loss.detach()
        if not boundary:
            raise RuntimeError("the last micro-batch was not DeepSpeed's accumulation boundary")
        norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
        if norm is None:
            raise RuntimeError("DeepSpeed reported no gradient norm for this step")
        self.scheduler.step()
        return StepOutcome(mean_loss(loss_sum, accum, scale), float(norm))

    def param_norm(self) -> float:
        if not self.zero3:  # ZeRO 0-2: every rank holds the whole (replicated) model
            return float(param_norm(self.engine.module.parameters()))
        parts = [_zero3_local(p) for p in self.engine.module.parameters()]
        norms = torch._foreach_norm(parts, 2, dtype=torch.float32)
        total = torch.stack(norms).square().sum()
        dist.all_reduce(total, group=self.engine.data_parallel_group)
        return float(total.sqrt())

    def local_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        for name, param in self.engine.module.named_parameters():
            yield name, _zero3_local(param) if self.zero3 else param


class DeepSpeedBackend(Backend):
    """ZeRO 0-3 through ``deepspeed.initialize`` (data parallel only)."""

    checkpointer_class = DeepSpeedCheckpointer

    def setup(self, settings: WorkerSettings, dctx: DistContext) -> None:
        if not dist.is_initialized():
            raise RuntimeError("strategy deepspeed needs torch.distributed: run under "
                               "`orchestrator up` or torchrun")
        from deepspeed.utils import logger

        # DeepSpeed logs its config and every checkpoint file at INFO into each rank's log.
        logger.setLevel(logging.WARNING)

    def build_model(self, settings: WorkerSettings, dctx: DistContext) -> nn.Module:
        from trainer import model as model_mod
        from trainer.parallel import parallelize
        from trainer.presets import resolve_model_args

        cfg = settings.trainer
        model = model_mod.build_model(resolve_model_args(cfg.model), device="meta")
        # Materialised whole from the seed; the engine partitions it (ZeRO-3: the
        # parameters) when it is built, so every rank holds it fully until then.
        return parallelize(model, cfg.parallelism, cfg.precision, dctx, seed=cfg.seed)

    def build_stepper(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      settings: WorkerSettings, dctx: DistContext) -> DeepSpeedStepper:
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=deepspeed_config(settings.trainer),
                                               dist_init_required=False)
        if settings.trainer.parallelism.offload != "none" and dctx.is_main:
            # What the engine made of the offload request (its parsed config), in the log.
            where = [str(getattr(c.device, "value", c.device)) if c is not None else "none"
                     for c in (engine.zero_offload_optimizer(), engine.zero_offload_param())]
            opt, par = (w if w != "none" else "the accelerator" for w in where)
            print(f"[rank {dctx.rank}] ZeRO-Offload: optimizer state and step on {opt}, "
                  f"parameters on {par}", flush=True)
        return DeepSpeedStepper(engine, scheduler, dctx.device)

    def checkpoint_state(self, stepper: Any, scheduler: Any, progress: Any, loader: Any,
                         rank: int) -> dict[str, Any]:
        from trainer.state import LoaderState, RngState, SchedulerState

        return {ENGINE: EngineState(stepper.engine), "schedule": SchedulerState(scheduler),
                "progress": progress, "data": LoaderState(loader), RNG: RngState()}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"writer": "deepspeed", "state_layout": {
            "model_and_optimizer": "DeepSpeed's files (mp_rank_*_model_states.pt, "
                                   "zero_pp_rank_*_optim_states.pt)",
            "lr_schedule": "client_state['schedule'] in the model states file",
            "counters": "client_state['progress']", "data_loader": "client_state['data']",
            "rng": "client_state['rng'][rank]"}}
