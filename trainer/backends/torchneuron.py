"""TorchNeuron: the native backend (FSDP2, DDP, none) on AWS Trainium's native ``neuron`` device.

``trainer.device: neuron`` runs ``trainer.backends.native`` and ``trainer.parallel`` as they
are: the same model, step, ``fully_shard`` and DCP checkpoints as on CUDA. Only what differs
per device lives here: registering the device, choosing this rank's NeuronCore, the
process-group backend and the ``torch.compile`` backend. As AWS documents them (Neuron
documentation, TorchNeuron pages, awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/):

- "What is TorchNeuron?" (torch/about-pytorch-neuron): TorchNeuron registers Trainium as the
  PyTorch device ``neuron`` through the PrivateUse1 mechanism; "code written against
  ``torch.accelerator`` needs no change". Public beta with Neuron 2.33 (torch-neuronx 2.14.*
  for PyTorch 2.14, release notes of aws-neuron/torch-neuronx v2.33.0), on Trn2 and Trn3.
- "How to use torch.distributed on Neuron" (torch/guides/torch-distributed): ``import
  torch_neuronx`` "registers the Neuron device and distributed backend", then
  ``dist.init_process_group(backend="neuron")``; DDP, FSDP2 and DTensor run on it. The
  distributed tutorial runs 64 workers on a full trn2.48xlarge.
- "torch.compile backend reference" (torch/compile/reference-torch-compile):
  ``torch.compile(model, backend="neuron")``; ``fullgraph=True`` "recommended for the Neuron
  path", ``dynamic=True`` is rejected, ``mode`` other than the default has no effect. It
  lowers through StableHLO and neuronx-cc, not inductor.
- Announcements: NxD Training and the XLA-based torch-neuronx training flow reached end of
  support with Neuron 2.32 (NxD Training last supported in 2.31). ``trainer.backends.neuron``
  (``trainer.device: xla``, ``parallelism.strategy: neuron``) stays for those SDKs.

The process group is ``cpu:gloo,neuron:neuron``: AWS's ``neuron`` backend for neuron tensors
and, in PyTorch's own per-device syntax, gloo for CPU tensors, as ``cpu:gloo,cuda:nccl`` does
on CUDA (DCP's asynchronous save coordinates on the CPU).

What ran here: none of torch-neuronx (no wheel for this machine's torch, no Trainium). The
choices above are unit-tested on the CPU, the device registration and the process group
through a stand-in ``torch_neuronx`` that renames PrivateUse1 and registers a gloo-backed
``neuron`` process-group backend, as the real package registers its own.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Protocol

import torch

PACKAGE = "torch_neuronx"  # importing it registers the device and the process-group backend
DEVICE = "neuron"
PG_BACKEND = "neuron"
PG_SPEC = f"cpu:gloo,{DEVICE}:{PG_BACKEND}"
COMPILE_BACKEND = "neuron"

MISSING = ("trainer.device neuron needs TorchNeuron (torch-neuronx 2.14.*, Neuron SDK 2.33 or "
           "later, on trn2/trn3); with Neuron SDK 2.31 or earlier use the NxD backend: "
           "trainer.device: xla and trainer.parallelism.strategy: neuron")


class Accelerator(Protocol):
    """The part of ``torch.accelerator`` this module uses (injectable for tests)."""

    def device_count(self) -> int: ...

    def set_device_index(self, device: Any, /) -> None: ...

    def current_device_index(self) -> int: ...


def require() -> ModuleType:
    """Import torch-neuronx (which registers ``neuron``), or a RuntimeError saying what is
    missing and where the NxD path is."""
    try:
        module = importlib.import_module(PACKAGE)
    except ImportError as exc:
        raise RuntimeError(f"{MISSING}: {exc}") from exc
    try:
        torch.device(DEVICE)
    except RuntimeError as exc:
        raise RuntimeError(f"{PACKAGE} was imported but torch knows no {DEVICE!r} device "
                           f"(its PrivateUse1 backend is named "
                           f"{torch._C._get_privateuse1_backend_name()!r}): {exc}") from exc
    return module


def core_index(local_rank: int, visible: int) -> int:
    """This rank's NeuronCore among the ``visible`` ones. The runtime reserves a core for one
    process, so ranks never share one: with several visible, local rank i takes core i; with
    one, the launcher (or NEURON_RT_VISIBLE_CORES) already gave this process its own."""
    if local_rank < 0:
        raise ValueError(f"local rank {local_rank} is negative")
    if visible < 1:
        raise RuntimeError("no NeuronCore is visible to this process (neuron-ls shows the "
                           "node's; NEURON_RT_VISIBLE_CORES may hide them)")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"local rank {local_rank} has no NeuronCore of its own: "
                           f"{visible} are visible (cluster.procs_per_node is above the "
                           f"node's logical NeuronCores)")
    return local_rank


def pick_device(local_rank: int, accelerator: Accelerator | None = None) -> torch.device:
    """Register TorchNeuron, make this rank's NeuronCore the current device, return it."""
    require()
    acc = accelerator if accelerator is not None else torch.accelerator
    index = core_index(local_rank, acc.device_count())
    acc.set_device_index(index)
    return torch.device(DEVICE, acc.current_device_index())


def compile_kwargs(device_type: str) -> dict[str, Any]:
    """``torch.compile`` arguments for blocks and the loss on ``device_type`` (none but the
    defaults off Neuron). Our blocks and loss compile without graph breaks (tested on the
    CPU), so fullgraph holds; our shapes are fixed, so dynamic is off, not rejected."""
    if device_type != DEVICE:
        return {}
    return {"backend": COMPILE_BACKEND, "fullgraph": True, "dynamic": False}
