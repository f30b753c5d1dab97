"""What a parallelism backend builds, and the training step each one runs.

A backend is one builder per component (model, optimizer, stepper, checkpoint state,
checkpointer) for one ``trainer.parallelism.strategy``; ``trainer.build`` wires the parts and
never asks which strategy it has. The step itself is a ``Stepper``: forward and backward over
the micro-batches, the gradient norm, and the update. Everything around it (the batch, the
chaos poison scale, the learning rate, progress, the step record) is the loop's and is the
same for every backend.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.distributed import DistContext, all_reduce_mean

if TYPE_CHECKING:
    from trainer.settings import WorkerSettings

MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]
# decide(loss, grad_norm) -> skip this step's update? (globally reduced values, every rank)
Decide = Callable[[float, float], bool]


@dataclass(frozen=True)
class StepOutcome:
    """A step's globally reduced loss (times the chaos scale), its gradient norm before
    clipping, and whether its update was skipped."""

    loss: float
    grad_norm: float
    skipped: bool = False


class Stepper(Protocol):
    """One optimizer step of one backend. ``model`` is the module the backend trains (a
    DeepSpeed engine, an NxD model, an FSDP2 module, ...)."""

    model: nn.Module

    def step(self, micro_batches: MicroBatches, scale: float,
             decide: Decide | None) -> StepOutcome:
        """Forward and backward over ``micro_batches`` with the loss times ``scale`` (the
        chaos poison), then the update unless ``decide`` says skip. Also steps the LR."""

    def param_norm(self) -> float:
        """Global L2 norm of the parameters (a collective: every rank calls it)."""

    def local_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's parameter values (its shards where sharded), for the final digest."""


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over a [B, T, V] batch, in fp32 whatever the logits'
    dtype (the model returns them in its compute dtype)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def mean_loss(loss_sum: torch.Tensor, accum: int, scale: float) -> float:
    """The step's loss for the record: mean over micro-batches and ranks, times the scale."""
    return float(all_reduce_mean(loss_sum / accum)) * scale


class Backend(abc.ABC):
    """Builders for one parallelism strategy. Subclasses override what differs."""

    #: The checkpointer class (same interface as the DCP one the loop uses).
    checkpointer_class: type[Checkpointer] = Checkpointer

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy

    def setup(self, settings: WorkerSettings, dctx: DistContext) -> None:
        """Anything the strategy needs before the data loader and the model are built."""

    def data_parallel(self, dctx: DistContext) -> tuple[int, int]:
        """(rank, world) the data loader shards by: every rank is a data-parallel rank
        unless the strategy splits the model across ranks."""
        return dctx.rank, dctx.world_size

    @abc.abstractmethod
    def build_model(self, settings: WorkerSettings, dctx: DistContext) -> nn.Module:
        """The model, initialised from ``trainer.seed`` (identically whatever the layout)."""

    def load_pretrained(self, model: nn.Module, path: str) -> None:
        """Load Hugging Face weights into the built model (before the optimizer exists)."""
        from trainer.hf import load_into

        load_into(model, path)

    def build_optimizer(self, model: nn.Module, settings: WorkerSettings,
                        dctx: DistContext) -> torch.optim.Optimizer:
        from trainer.optim import build_optimizer

        return build_optimizer(model, settings.trainer.optimizer, dctx.device.type)

    @abc.abstractmethod
    def build_stepper(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      settings: WorkerSettings, dctx: DistContext) -> Stepper:
        """The step; it may wrap the model and optimizer (DeepSpeed's engine does)."""

    @abc.abstractmethod
    def checkpoint_state(self, stepper: Stepper, scheduler: Any, progress: Any, loader: Any,
                         rank: int) -> dict[str, Any]:
        """What a checkpoint holds, in the form ``checkpointer_class`` saves and loads."""

    def rejoin_unsupported(self, settings: WorkerSettings) -> str | None:
        """Why this strategy's ranks cannot rejoin a new generation in place (an in-job
        recovery), or None when they can."""
        return f"the {self.strategy} backend keeps process-group state of its own"

    def rejoin(self, stepper: Stepper, dctx: DistContext) -> None:
        """Point the model's own process-group state at the groups just made anew."""
        raise NotImplementedError(self.rejoin_unsupported(None))  # type: ignore[arg-type]

    def reset_step_state(self, stepper: Stepper) -> None:
        """Forget a step cut short by a peer's failure (before its state is restored)."""

    def checkpoint_meta(self) -> dict[str, Any]:
        """Manifest fields naming the writer and where each part of the state lives."""
        from trainer.state import STATE_LAYOUT

        return {"writer": "dcp", "state_layout": STATE_LAYOUT}
