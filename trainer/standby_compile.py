"""A warm standby compiles its rank's step ahead, on a two-block copy of the model.

A replacement rank's first step used to trace and compile the job's blocks and loss (1.3-1.8
s of a 2.4-3.1 s first step on an H200, with the compile cache loaded): TorchDynamo keeps its
compiled code per Python code object, guarded by what the code saw (module classes,
parameter and input shapes and dtypes, the process's global settings), not per module
instance. So a standby builds the job's model as a rank builds it (activation checkpointing,
``Module.compile`` per block, FSDP2, the same micro-batch shape) but with at most two blocks
(both kinds of block under selective checkpointing), sharded over a **fake** process group
of the job's world size (``torch.distributed``'s ``fake`` backend: collectives that do
nothing), and runs one forward, loss and backward through the job's own step. The graphs it
compiles are the ones the real model's blocks and loss look up: the rank this process
becomes compiles nothing at its first step.

What it costs: two blocks, the embeddings and the activations of one micro-batch on the GPU
for the seconds the step takes (5.4 GB for the 1.14B model at micro-batch 8; bounded to half
of the memory free at the time, so the training rank beside it cannot be starved), then
given back to the driver; the compiled kernels stay loaded.
Everything is undone before the standby waits: the fake group is destroyed (the real
groups are then named as in a fresh process) and DTensor's generator state, which the
model's initialisation sets up, is forgotten.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any

import torch

# The most blocks the copy gets: one of each kind (plain, and wrapped for checkpointing).
COPY_BLOCKS = 2
# The share of the GPU memory free at the start that the copy may take.
MEMORY_SHARE = 0.5


def why_not(settings: Any) -> str | None:
    """Why this job's step cannot be compiled ahead this way (None: it can)."""
    t = settings.trainer
    if not t.parallelism.compile:
        return "the job does not compile"
    if not t.parallelism.standby_compile:
        return "parallelism.standby_compile is off"
    if t.parallelism.strategy not in ("fsdp2", "none"):
        return f"parallelism.strategy {t.parallelism.strategy} wraps the model otherwise"
    if t.finetune is not None:
        return "fine-tuning loads its frozen base from disk at every build"
    if t.precision.fp8:
        return "FP8 linears are converted against the real process group"
    if t.parallelism.offload != "none":
        return "CPU offload keeps the shards in host memory"
    return None


def copy_settings(settings: Any) -> Any:
    """``settings`` with the model cut to :data:`COPY_BLOCKS` blocks (or fewer)."""
    from trainer.presets import resolve_model_args

    t = settings.trainer
    layers = min(COPY_BLOCKS, resolve_model_args(t.model).n_layers)
    model = t.model.model_copy(update={"n_layers": layers})
    return dataclasses.replace(settings, trainer=t.model_copy(update={"model": model}))


def compile_ahead(settings: Any, local_rank: int, rank: int, world_size: int) -> dict[str, Any]:
    """Compile the job's step in this process on a copy of the model (see the module);
    what it did: seconds, compiled graphs, the copy's peak GPU memory."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import _random

    from trainer.distributed import DistContext, configure_process, pick_device

    if dist.is_initialized():
        raise RuntimeError("compile ahead needs a process without process groups")
    t0 = time.perf_counter()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    configure_process(settings.trainer, local_world)  # the guards see the rank's settings
    device = pick_device(settings.trainer, local_rank)
    limited = _limit_memory(device)
    graphs = counters["stats"]["unique_graphs"]
    tracker = getattr(_random, "_rng_tracker", None)
    dist.init_process_group(_fake_backend(), store=dist.HashStore(), rank=rank,
                            world_size=world_size)
    try:
        _step_on_copy(settings, DistContext(rank, local_rank, world_size, device, "fake", None))
    finally:
        dist.destroy_process_group()
        _random._rng_tracker = tracker
        # FSDP2's modules and hooks refer to each other: the copy is freed by a collection,
        # not when its last name goes (a standby held up to 7 GB of it on an H200 without).
        gc.collect()
        peak, held = _release_memory(device, limited)
    return {"compile_ahead_s": round(time.perf_counter() - t0, 3),
            "compile_ahead_graphs": counters["stats"]["unique_graphs"] - graphs,
            "compile_ahead_peak_mib": peak, "compile_ahead_held_mib": held}


def _step_on_copy(settings: Any, dctx: Any) -> None:
    """Build the copy as the job's backend builds a rank's model and run one micro-batch's
    forward, loss and backward through the job's own step."""
    from trainer.backends import backend_for

    small = copy_settings(settings)
    backend = backend_for(small.trainer.parallelism.strategy)
    backend.setup(small, dctx)
    model = backend.build_model(small, dctx)
    stepper = backend.build_stepper(model, None, None, small, dctx)
    inputs, targets = random_batch(small, dctx.device)
    stepper.forward_backward(inputs, targets, True, 1.0)
    if dctx.device.type == "cuda":
        torch.cuda.synchronize(dctx.device)


def _fake_backend() -> str:
    """The name of torch.distributed's fake backend (built in to recent releases; older
    ones register it in their testing module)."""
    import torch.distributed as dist

    if getattr(dist.Backend, "FAKE", None) is None:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"
    return "fake"


def random_batch(settings: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of random tokens, shaped and typed as the loader's."""
    from trainer.presets import resolve_model_args

    data = settings.trainer.data
    vocab = resolve_model_args(settings.trainer.model).vocab_size
    shape = (data.micro_batch_size, data.seq_len)
    return (torch.randint(0, vocab, shape, device=device),
            torch.randint(0, vocab, shape, device=device))


def _limit_memory(device: torch.device) -> bool:
    """Cap this process's GPU memory at :data:`MEMORY_SHARE` of what is free now."""
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.set_per_process_memory_fraction(MEMORY_SHARE * free / total, device)
    torch.cuda.reset_peak_memory_stats(device)
    return True


def _release_memory(device: torch.device, limited: bool) -> tuple[int | None, int | None]:
    """Give the copy's memory back to the driver and lift the cap (the rank this becomes
    needs all of it); the copy's peak and what this process's allocator still reserves,
    in MiB."""
    if not limited:
        return None, None
    peak = torch.cuda.max_memory_allocated(device) // 2**20
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(peak), int(torch.cuda.memory_reserved(device) // 2**20)
