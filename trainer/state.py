"""Everything a checkpoint holds, as DCP ``Stateful`` objects.

Model and optimizer go through torch's distributed state-dict API (sharded DTensors for
FSDP2, no full gather); the LR schedule, the step/token counters, the data position and
every RNG of every rank ride along in the same DCP checkpoint. RNG states are per rank
(distinct keys), so DCP's de-duplication of identical keys across ranks cannot drop one.

Nothing of ours is pickled: the counters are numbers, the data position and the guard are
JSON, the RNG states are JSON with the torch/CUDA generator bytes in base64. (DCP stores a
non-tensor value through ``torch.save``; the checkpointer reads those back with
``weights_only=True``, numbers and strings only.) Checkpoints of format 1 held the RNG
states as one pickle; those are read, for an operator who trusts such a checkpoint, by an
unpickler that admits only the numpy and torch types an RNG state is made of.
"""

from __future__ import annotations

import base64
import io
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


STATE_FORMAT = 2  # the manifest's state_format: 2 = RNG states as JSON (1: a pickle)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_states() -> dict[str, Any]:
    """This process's Python, numpy, torch and (when initialised) CUDA RNG states, as JSON
    values."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [_b64(t) for t in torch.cuda.get_rng_state_all()]
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``rng_states`` returned (or a format-1 pickle's decoded dict)."""
    py = states["python"]
    random.setstate((int(py[0]), tuple(int(x) for x in py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),
                         float(cached)))
    torch.set_rng_state(_unb64(states["torch"]) if isinstance(states["torch"], str)
                        else states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(t) if isinstance(t, str) else t
                                      for t in states["cuda"]])


class _Format1Unpickler(pickle.Unpickler):
    """Reads a format-1 RNG blob: numpy arrays and torch byte tensors, nothing else."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
                ("numpy._core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
                ("numpy", "dtype"), ("torch._utils", "_rebuild_tensor_v2"),
                ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda b: torch.load(io.BytesIO(b), weights_only=True)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"an RNG state does not hold {module}.{name}")


def decode_format1_rng(blob: bytes) -> dict[str, Any]:
    """The RNG states in a format-1 checkpoint's pickle, through ``_Format1Unpickler``."""
    states = _Format1Unpickler(io.BytesIO(blob)).load()
    if not isinstance(states, dict):
        raise ValueError("a format-1 RNG state is not a dict")
    return states  # set_rng_states takes its tuples, arrays and tensors as they are


class RngState(Stateful):
    """Python, numpy, torch and (when present) CUDA RNG states of this rank, as JSON."""

    def __init__(self) -> None:
        self._format1 = False

    def prepare_load(self, manifest: dict[str, Any] | None) -> None:
        """Read the next load as the checkpoint's state was written: a manifest without
        ``state_format`` (format 1, or one re-signed since) holds the RNG as a pickle."""
        self._format1 = int((manifest or {}).get("state_format") or 1) < STATE_FORMAT

    def state_dict(self) -> dict[str, Any]:
        if self._format1:
            return {"blob": b""}  # the key a format-1 checkpoint holds (a load template)
        return {"json": json.dumps(rng_states(), allow_nan=False)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "json" in state_dict:
            set_rng_states(json.loads(state_dict["json"]))
        else:
            set_rng_states(decode_format1_rng(state_dict["blob"]))
        self._format1 = False


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
