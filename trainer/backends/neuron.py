"""Trainium: tensor parallel + ZeRO-1 through neuronx-distributed (NxD) on torch-xla.

The path for Neuron SDK 2.31 or earlier (``trainer.device: xla``, ``parallelism.strategy:
neuron``): AWS ended NxD Training and the torch-xla training flow with Neuron 2.32. Later SDKs
run our FSDP2 backend on TorchNeuron's native device instead (``trainer.device: neuron``,
``trainer.backends.torchneuron``).

APIs used (AWS Neuron SDK; neuronx-distributed's ``trainer`` API as in the
aws-neuron/neuronx-distributed repository, torch-xla's ``xla_model``):

- ``torch.distributed.init_process_group("xla")`` after ``import torch_xla.distributed.
  xla_backend`` (``trainer.distributed``), ``torch_xla.core.xla_model.xla_device()``;
- ``neuronx_distributed.neuronx_distributed_config(tensor_parallel_size=, optimizer_config=
  {"zero_one_enabled", "grad_clipping", "max_grad_norm"}, mixed_precision_config=,
  activation_checkpoint_config=)``, which also builds the TP/DP groups
  (``neuronx_distributed.parallel_layers.parallel_state``);
- ``neuronx_distributed.initialize_parallel_model(nxd_config, model_fn)`` around our
  tensor-parallel Transformer (``trainer.backends.neuron_tp``);
- ``neuronx_distributed.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, groups,
  **defaults)``: NxDOptimizer, which reduces gradients (ZeRO-1: NeuronZero1Optimizer over the
  data-parallel group), clips them, steps, and exposes the pre-clipping norm as ``grad_norm``;
- ``neuronx_distributed.parallel_layers.loss_functions.parallel_cross_entropy`` on the
  vocabulary-parallel logits; ``xm.mark_step()`` once the step's graph is complete;
- ``neuronx_distributed.trainer.save_checkpoint`` / ``load_checkpoint`` (``use_xser``,
  ``async_save``) and ``checkpoint.finalize_checkpoint`` (``neuron_checkpoint``).

What ran here and what did not: neither torch-neuronx/torch-xla (built for another torch) nor
neuronx-distributed (the PyPI name is a placeholder; the wheels come from the Neuron
repository) can be installed on this machine, and there is no Trainium device. The pure parts
are unit-tested on the CPU: the config translation (``nxd_config_kwargs``), the sharding plan
and the TP forward's math (``neuron_tp``), the checkpoint file list, and the clear error when
the SDK is missing. The XLA code paths (this module's ``NeuronBackend`` and ``NeuronStepper``
methods, the NxD checkpoint calls) are written against the published APIs and have not run.

The data loader shards by the data-parallel rank from NxD's ``parallel_state`` (world / TP
groups; on trn1, TP=4 groups are not contiguous ranks), so the TP peers of a group read the
same samples. ``skip_step`` rules are rejected by config validation: NxDOptimizer computes
the gradient norm inside ``step()``, which also applies the update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.backends.base import Backend, Decide, MicroBatches, StepOutcome, mean_loss
from trainer.backends.neuron_checkpoint import (
    MODEL,
    OPTIMIZER,
    RNG,
    NeuronCheckpointer,
    XlaRngState,
)
from trainer.distributed import DistContext

if TYPE_CHECKING:
    from trainer.config import TrainerConfig
    from trainer.settings import WorkerSettings

NEURON_SDK = ("strategy neuron needs torch-neuronx and neuronx-distributed (AWS Neuron SDK 2.31 "
              "or earlier; with 2.33+, TorchNeuron: trainer.device neuron, strategy fsdp2)")


def require_neuron() -> Any:
    """``neuronx_distributed`` (and torch-xla), or a RuntimeError saying what is missing."""
    try:
        import neuronx_distributed
        import torch_xla.core.xla_model  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"{NEURON_SDK}: {exc}") from exc
    return neuronx_distributed


def nxd_config_kwargs(cfg: TrainerConfig, block_cls: type | None = None) -> dict[str, Any]:
    """Arguments of ``neuronx_distributed_config`` from ours. ``block_cls``: the module class
    NxD checkpoints activations of (our TP block) when ``activation_checkpointing`` is full."""
    par, prec = cfg.parallelism, cfg.precision
    zero1 = par.zero_stage == 1
    bf16 = prec.param_dtype == "bf16"
    return {
        "tensor_parallel_size": par.tensor_parallel,
        "pipeline_parallel_size": 1,
        "optimizer_config": {"zero_one_enabled": zero1, "grad_clipping": True,
                             "max_grad_norm": cfg.optimizer.grad_clip},
        # bf16 weights: ZeRO-1 keeps fp32 master weights (and accumulates gradients in fp32
        # when reductions are fp32). NxD allows neither without ZeRO-1.
        "mixed_precision_config": {"use_master_weights": zero1 and bf16,
                                   "use_fp32_grad_acc": zero1 and bf16
                                   and prec.reduce_dtype == "fp32",
                                   "use_master_weights_in_ckpt": False},
        "activation_checkpoint_config": (block_cls,) if par.activation_checkpointing == "full"
        else None,
        "sequence_parallel": False,
    }


class NeuronStepper:
    """One step: forward/backward per micro-batch into the lazy graph, ``mark_step``, then
    NxD's optimizer (reduction, clipping, update) and the LR, and ``mark_step`` again."""

    def __init__(self, model: nn.Module, optimizer: Any, scheduler: Any,
                 device: torch.device) -> None:
        import torch_xla.core.xla_model as xm
        from neuronx_distributed.parallel_layers import parallel_state
        from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy

        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self._xm = xm
        self._ce = parallel_cross_entropy
        self._tp_groups = parallel_state.get_tensor_model_parallel_group(as_list=True)

    def step(self, micro_batches: MicroBatches, scale: float,
             decide: Decide | None) -> StepOutcome:
        if decide is not None:
            raise RuntimeError("skip_step cannot be applied under strategy neuron (the config "
                               "validation rejects it: see trainer.backends.neuron)")
        accum = len(micro_batches)
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        for inputs, targets in micro_batches:
            logits = self.model(inputs.to(self.device))  # this rank's vocabulary slice
            loss = self._ce(logits, targets.to(self.device)).mean()
            (loss * (scale / accum)).backward()
            loss_sum += loss.detach()
        self._xm.mark_step()  # run forward/backward before the optimizer's collectives
        self.optimizer.step()
        grad_norm = self.optimizer.grad_norm  # global, before clipping (NxDOptimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._xm.mark_step()
        # TP peers hold the same loss, so the mean over all ranks is the data-parallel mean.
        return StepOutcome(mean_loss(loss_sum, accum, scale), float(grad_norm))

    def param_norm(self) -> float:
        sharded, replicated = [], []
        for p in self.model.parameters():
            # NxD's parallel layers mark their weights (set_tensor_model_parallel_attributes).
            (sharded if getattr(p, "tensor_model_parallel", False) else replicated).append(p)
        zero = torch.zeros((), device=self.device)
        sq_sharded = sum((p.detach().float().pow(2).sum() for p in sharded), zero)
        sq_sharded = self._xm.all_reduce(self._xm.REDUCE_SUM, sq_sharded,
                                         groups=self._tp_groups)
        sq_replicated = sum((p.detach().float().pow(2).sum() for p in replicated), zero)
        return float((sq_sharded + sq_replicated).sqrt())

    def local_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.model.named_parameters()


class NeuronBackend(Backend):
    """Tensor parallel (``parallelism.tensor_parallel``) and ZeRO-1 (``zero_stage: 1``)."""

    checkpointer_class = NeuronCheckpointer

    def setup(self, settings: WorkerSettings, dctx: DistContext) -> None:
        self.nxd = require_neuron()
        from neuronx_distributed.parallel_layers import parallel_state

        from trainer.backends.neuron_tp import TPBlock

        cfg = settings.trainer
        # Also creates NxD's tensor- and data-parallel groups (initialize_model_parallel).
        self.nxd_config = self.nxd.neuronx_distributed_config(
            **nxd_config_kwargs(cfg, block_cls=TPBlock))
        tp = cfg.parallelism.tensor_parallel
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp = (parallel_state.get_data_parallel_rank(),
                   parallel_state.get_data_parallel_size())
        if self.dp[1] != dctx.world_size // tp:
            raise RuntimeError(f"NxD made {self.dp[1]} data-parallel ranks; world "
                               f"{dctx.world_size} / tensor_parallel {tp} expected")

    def data_parallel(self, dctx: DistContext) -> tuple[int, int]:
        return self.dp

    def _plan(self, settings: WorkerSettings) -> Any:
        from trainer.backends.neuron_tp import TPPlan
        from trainer.presets import resolve_model_args

        cfg = settings.trainer
        return TPPlan(resolve_model_args(cfg.model), cfg.parallelism.tensor_parallel)

    def build_model(self, settings: WorkerSettings, dctx: DistContext) -> nn.Module:
        from trainer.backends.neuron_tp import build_tp_model

        cfg = settings.trainer
        self.plan = self._plan(settings)
        dtype = torch.bfloat16 if cfg.precision.param_dtype == "bf16" else torch.float32
        # Built and filled on the CPU (this rank's shards only), then moved by NxD.
        return self.nxd.initialize_parallel_model(
            self.nxd_config, build_tp_model, self.plan, self.tp_rank, cfg.seed, dtype)

    def load_pretrained(self, model: nn.Module, path: str) -> None:
        """HF weights, read whole on every rank and cut to this rank's shards."""
        from trainer.hf import check_shape, read_hf_dir

        args, full = read_hf_dir(path)
        mismatch = check_shape(self.plan.args, args)
        if mismatch:
            raise ValueError(f"{path}: shape differs from the model: {'; '.join(mismatch)}")
        dtype = next(model.parameters()).dtype
        model.load_state_dict({n: self.plan.shard(n, t, self.tp_rank).to(dtype)
                               for n, t in full.items()}, strict=True)

    def build_optimizer(self, model: nn.Module, settings: WorkerSettings,
                        dctx: DistContext) -> torch.optim.Optimizer:
        from trainer.optim import param_groups

        opt = settings.trainer.optimizer
        return self.nxd.initialize_parallel_optimizer(
            self.nxd_config, torch.optim.AdamW, param_groups(model, opt), lr=opt.lr,
            betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)

    def build_stepper(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      settings: WorkerSettings, dctx: DistContext) -> NeuronStepper:
        return NeuronStepper(model, optimizer, scheduler, dctx.device)

    def checkpoint_state(self, stepper: Any, scheduler: Any, progress: Any, loader: Any,
                         rank: int) -> dict[str, Any]:
        from trainer.state import LoaderState, SchedulerState

        return {MODEL: stepper.model, OPTIMIZER: stepper.optimizer,
                "schedule": SchedulerState(scheduler), "progress": progress,
                "data": LoaderState(loader), RNG: XlaRngState()}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"writer": "neuronx-distributed", "state_layout": {
            "model": "model/dp_rank_00_tp_rank_<TP>_pp_rank_00.pt (xser: + .tensors/)",
            "optimizer": "optim/dp_rank_<DP>_tp_rank_<TP>_pp_rank_00.pt (ZeRO-1: per DP rank)",
            "lr_schedule": "user_content.pt['schedule']", "counters": "user_content.pt"
            "['progress']", "data_loader": "user_content.pt['data']",
            "rng": "user_content.pt['rng'][rank]"}}
