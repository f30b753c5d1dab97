"""Everything a checkpoint holds, as DCP ``Stateful`` objects.

Model and optimizer go through torch's distributed state-dict API (sharded DTensors for
FSDP2, no full gather); the LR schedule, the step/token counters, the data position and
every RNG of every rank ride along in the same DCP checkpoint. RNG states are per rank
(distinct keys), so DCP's de-duplication of identical keys across ranks cannot drop one.
"""

from __future__ import annotations

import json
import pickle
import random
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class ModelOptimState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class SchedulerState(Stateful):
    """Only the schedule's position: the schedule itself comes from the config."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": int(self.scheduler.last_epoch)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        full = self.scheduler.state_dict()
        full["last_epoch"] = int(state_dict["last_epoch"])
        full["_step_count"] = full["last_epoch"] + 1
        self.scheduler.load_state_dict(full)


@dataclass
class Progress(Stateful):
    """Optimizer steps done and tokens trained (global)."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens = int(state_dict["tokens"])


class LoaderState(Stateful):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(dict(state_dict))


class RngState(Stateful):
    """Python, numpy, torch and (when present) CUDA RNG states of this rank."""

    def state_dict(self) -> dict[str, Any]:
        states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                                  "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
        return {"blob": pickle.dumps(states)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = pickle.loads(state_dict["blob"])
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])


class GuardState(Stateful):
    """The stability ``SkipStepGuard``'s detector state, so a resumed rank decides as before.

    Plain JSON in one string: every rank holds the same state (the guard is fed globally
    reduced values), so DCP keeps one copy and every rank loads it.
    """

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.guard.state_dict(), allow_nan=False)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.guard.load_state_dict(json.loads(state_dict["json"]))


def params_digest(model: nn.Module) -> dict[str, Any]:
    """CRC32 over this rank's parameter bytes (local shards under FSDP2), in module order.

    Replicated strategies (DDP, none) must give the same digest on every rank: ranks that
    disagree have drifted apart (one applied an update the other skipped).
    """
    return tensors_digest((name, param.to_local() if hasattr(param, "to_local") else param)
                          for name, param in model.named_parameters())


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """CRC32 over the bytes of ``(name, tensor)`` pairs, in order (see ``params_digest``)."""
    crc, numel = 0, 0
    with torch.no_grad():
        for _, tensor in tensors:
            data = tensor.detach().contiguous().cpu()
            crc = zlib.crc32(data.view(torch.uint8).numpy().tobytes(), crc)
            numel += data.numel()
    return {"crc32": f"{crc:08x}", "numel": numel}


def rng_key(rank: int) -> str:
    return f"rng_rank{rank:05d}"


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     progress: Progress, loader: Any, rank: int) -> dict[str, Stateful]:
    """The DCP state dict; keys are the manifest's ``state`` map."""
    return {"app": ModelOptimState(model, optimizer), "schedule": SchedulerState(scheduler),
            "progress": progress, "data": LoaderState(loader), rng_key(rank): RngState()}


STATE_LAYOUT = {"model_and_optimizer": "app", "lr_schedule": "schedule",
                "counters": "progress", "data_loader": "data", "rng": "rng_rank<RANK>",
                "skip_step_guard": "stability (only when a rule's action is skip_step)"}
