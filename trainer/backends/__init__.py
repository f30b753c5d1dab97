"""Parallelism backends: one module per family of ``trainer.parallelism.strategy``.

- ``native``: FSDP2 (``fully_shard``), DDP and none, on torch.distributed; DCP checkpoints.
  On CPU, CUDA or Trainium's native ``neuron`` device (``torchneuron``: TorchNeuron, Neuron
  SDK 2.33+).
- ``deepspeed``: ZeRO stages 0-3 through ``deepspeed.initialize``; DeepSpeed's own checkpoint
  files, committed by our manifest.
- ``neuron``: Trainium through torch-xla and neuronx-distributed (tensor parallel + ZeRO-1);
  NxD checkpoints, committed by our manifest. Neuron SDK 2.31 or earlier.

Each backend module imports its third-party library lazily (inside functions), so importing
this package, or the trainer with another strategy, never needs DeepSpeed or the Neuron SDK.
"""

from __future__ import annotations

import importlib

from trainer.backends.base import Backend, StepOutcome, Stepper

__all__ = ["MODULES", "Backend", "StepOutcome", "Stepper", "backend_for"]

# strategy -> (module, class)
MODULES = {
    "fsdp2": ("trainer.backends.native", "NativeBackend"),
    "ddp": ("trainer.backends.native", "NativeBackend"),
    "none": ("trainer.backends.native", "NativeBackend"),
    "deepspeed": ("trainer.backends.deepspeed", "DeepSpeedBackend"),
    "neuron": ("trainer.backends.neuron", "NeuronBackend"),
}


def backend_for(strategy: str) -> Backend:
    """The backend that builds the parts of ``strategy``."""
    try:
        module, name = MODULES[strategy]
    except KeyError:
        raise ValueError(f"unknown parallelism strategy {strategy!r}; known: "
                         f"{', '.join(MODULES)}") from None
    return getattr(importlib.import_module(module), name)(strategy)
