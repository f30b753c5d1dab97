"""Preparing our Transformer for a strategy: FSDP2 (``fully_shard``), DDP, none, DeepSpeed.

FSDP2 shards each transformer block, then the root; with bf16 the compute runs in bf16 and
gradients are reduced in fp32 (master weights and optimizer state stay fp32). Activation
checkpointing and ``torch.compile`` apply per block, before sharding, as torchtitan does.
DeepSpeed gets the materialised module: ``deepspeed.initialize`` partitions it together with
the optimizer (``trainer.backends.deepspeed``). Neuron builds a tensor-parallel variant of
the model instead (``trainer.backends.neuron_tp``). ``trainer.backends`` picks per strategy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from trainer.config import ParallelismConfig, PrecisionConfig
from trainer.distributed import DistContext

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """none | full (every block) | selective (every other block: half the recompute)."""
    if mode == "none":
        return
    for i, block in enumerate(list(model.layers)):
        if mode == "full" or i % 2 == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, device_type: str) -> None:
    # In place (Module.compile): torch.compile(block) would add "_orig_mod." to every
    # state-dict key and break checkpoints made without compile. The compiler backend is the
    # device's (trainer.backends.torchneuron: "neuron" on Trainium's native device).
    from trainer.backends.torchneuron import compile_kwargs

    for block in model.layers:
        block.compile(**compile_kwargs(device_type))


def apply_fsdp(model: nn.Module, par: ParallelismConfig, prec: PrecisionConfig,
               world_size: int) -> None:
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[prec.param_dtype],
                              reduce_dtype=_DTYPES[prec.reduce_dtype])
    # Offload: sharded parameters, gradients and the optimizer step on the CPU (pinned
    # host memory for the copies where there is a GPU to copy to).
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) \
        if par.offload == "params" else OffloadPolicy()
    # On one rank resharding frees nothing (the shard is the whole tensor) and only costs a
    # re-gather in backward.
    reshard = par.reshard_after_forward and world_size > 1
    for i, block in enumerate(model.layers):
        # The last block's parameters are needed again at once by backward: keep them.
        last = i == len(model.layers) - 1
        fully_shard(block, mp_policy=mp, reshard_after_forward=reshard and not last,
                    offload_policy=offload)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)


def materialize(model: nn.Module, device: torch.device, seed: int,
                mark: Callable[[str], None] = lambda name: None) -> None:
    """Allocate a meta-device model's storage on ``device`` and initialise it from ``seed``.

    Every rank seeds identically, so replicated (DDP) weights agree and sharded (FSDP2)
    weights are the shards of one model.
    """
    model.to_empty(device=device)
    mark("model_allocated")
    torch.manual_seed(seed)
    quiet_dtensor_rng(model)
    with torch.no_grad():
        unwrap(model).init_weights()
    mark("model_initialized")


def quiet_dtensor_rng(model: nn.Module) -> None:
    """Give DTensor's random ops their generator state without a collective. Left to
    itself, DTensor's first random op (the init's) broadcasts rank 0's seed over the default
    group; every rank was just seeded alike, so each can start from its own, and a rank that
    replaces a failed one in place (the survivors keep theirs) builds without a collective
    its peers would never join. A no-op where DTensor keeps no generator (a CPU mesh)."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _random
    except ImportError:
        return
    if getattr(_random, "_rng_tracker", None) is not None:
        return
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None or not _random.is_rng_supported_mesh(mesh):
        return
    try:
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
    except TypeError:  # a release whose tracker takes other arguments: it syncs as before
        return


def parallelize(model: nn.Module, par: ParallelismConfig, prec: PrecisionConfig,
                dctx: DistContext, seed: int,
                before_shard: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Apply AC, compile and the sharding strategy to a meta-device model; materialise it.

    FSDP2 shards before materialising, so a 7B model never exists unsharded on a rank, unless
    ``before_shard`` is given: then the model is materialised whole, handed to it (QLoRA loads
    its base and quantizes it to NF4 there, for FSDP2 to shard the NF4 tensors as they are)
    and sharded after. DeepSpeed gets the plain materialised module (its engine partitions
    it). Returns the module to train (or to hand to the engine).
    """
    strategy = par.strategy
    if strategy not in ("fsdp2", "ddp", "none", "deepspeed"):
        # Neuron's tensor-parallel layers are a different module tree, built by NxD.
        raise ValueError(f"parallelism.strategy {strategy!r} does not use our Transformer "
                         "module as is: see trainer.backends")
    fsdp = strategy == "fsdp2" and dctx.distributed
    if before_shard is not None and not fsdp:
        raise ValueError("before_shard is for a model FSDP2 shards")
    apply_activation_checkpointing(model, par.activation_checkpointing)
    if par.compile:
        apply_compile(model, dctx.device.type)
    dctx.mark("model_wrapped")
    offload = fsdp and par.offload == "params"
    # CPU offload: the shards live in host memory; the RoPE tables (buffers, not sharded)
    # stay on the compute device.
    device = torch.device("cpu") if offload else dctx.device
    if before_shard is not None:
        materialize(model, device, seed)
        before_shard(model)
        apply_fsdp(model, par, prec, dctx.world_size)
    else:
        if fsdp:
            apply_fsdp(model, par, prec, dctx.world_size)
        dctx.mark("model_sharded")
        materialize(model, device, seed, dctx.mark)
    if offload:
        unwrap(model).rope_cos = unwrap(model).rope_cos.to(dctx.device)
        unwrap(model).rope_sin = unwrap(model).rope_sin.to(dctx.device)
    if strategy == "ddp" and dctx.distributed:
        from torch.nn.parallel import DistributedDataParallel

        ids = [dctx.device.index] if dctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def fsdp_param_groups(model: nn.Module) -> list:
    """Every FSDP2 parameter group under ``model`` (none for a model FSDP2 did not shard).
    A module's state holds a list of them (torch >= 2.12) or one (earlier releases)."""
    groups = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is not None:
            groups.extend(_own_param_groups(get_state()))
    return groups


def _own_param_groups(state: object) -> list:
    many = getattr(state, "_fsdp_param_groups", None)
    if many is not None:
        return list(many)
    one = getattr(state, "_fsdp_param_group", None)
    return [one] if one is not None else []


def rebind_process_groups(model: nn.Module) -> int:
    """Point FSDP2's cached process groups at the current ones, after the process groups
    were made anew in this process (an in-job recovery): a mesh keeps group names, which
    resolve to the new groups, but each parameter group holds the group objects it
    resolved at sharding time. Returns how many mesh infos were rebound."""
    seen: dict[int, object] = {}
    for group in fsdp_param_groups(model):
        for info in (group.mesh_info, group.post_forward_mesh_info):
            if info is not None:
                seen[id(info)] = info
    for info in seen.values():
        if getattr(info, "shard_mesh_dim", None) is not None:
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            if getattr(info, "reduce_scatter_process_group", None) is not None:
                info.reduce_scatter_process_group = info.shard_process_group
        if getattr(info, "replicate_mesh_dim", None) is not None:
            info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
    return len(seen)


def check_before_collectives(model: nn.Module, check: Callable[[], None]) -> int:
    """Make FSDP2's all-gathers and reduce-scatters call ``check`` first (it raises to stop
    the step). An in-job recovery aborts the old process groups while the training thread
    may still issue a step's collectives: ProcessGroupNCCL's abort holds the group's lock
    until NCCL's proxy thread ends (0.5-1.6 s), and a collective issued meanwhile waited
    for all of it before it failed. Returns how many parameter groups call it (0: this
    torch has no per-group collectives to wrap; the step's own safe points still check)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return 0

    class CheckedAllGather(DefaultAllGather):
        def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            check()
            return super().__call__(*args, **kwargs)

    class CheckedReduceScatter(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            check()
            return super().__call__(*args, **kwargs)

    wrapped = 0
    for group in fsdp_param_groups(model):
        # Only FSDP2's defaults: a custom or symmetric-memory collective is left as it is.
        if type(getattr(group, "_all_gather_comm", None)) is DefaultAllGather and \
                type(getattr(group, "_reduce_scatter_comm", None)) is DefaultReduceScatter:
            group._all_gather_comm = CheckedAllGather()
            group._reduce_scatter_comm = CheckedReduceScatter()
            wrapped += 1
    return wrapped


def reset_iteration(model: nn.Module) -> None:
    """Forget a step that an exception cut short inside FSDP2's forward or backward: its
    per-iteration state is reset and every parameter is sharded again
    (``FSDPModule.reset_iter_state``, torch >= 2.12; on older releases the same fields by
    hand). The model's gradients are dropped."""
    reset = getattr(model, "reset_iter_state", None)
    if callable(reset):
        reset()
    else:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        for module in model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                continue
            state = get_state()
            state._training_state = TrainingState.IDLE
            if isinstance(getattr(state, "_modules_to_run_forward", None), set):
                state._modules_to_run_forward.clear()
            ctx = getattr(state, "_state_ctx", None)
            if ctx is not None:
                ctx.iter_forward_root = None
                ctx.post_backward_final_callback_queued = False
            comm = getattr(state, "_comm_ctx", None)
            if comm is not None:
                comm.all_gather_state = None
                for name in ("reduce_scatter_states", "post_forward_order"):
                    if isinstance(getattr(comm, name, None), list):
                        getattr(comm, name).clear()
                if hasattr(comm, "reduce_scatter_state"):
                    comm.reduce_scatter_state = None
            for group in _own_param_groups(state):
                group._training_state = TrainingState.IDLE
                group._all_gather_result = None
                if hasattr(group, "_post_forward_indices"):
                    group._post_forward_indices.clear()
                group._to_sharded()
    for group in fsdp_param_groups(model):
        for fsdp_param in getattr(group, "fsdp_params", []):
            # The unsharded parameters' gradients of a backward cut short: the next
            # backward would accumulate into them (autograd adds to an existing .grad),
            # and they would be reduced into the first step after the rollback.
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            if hasattr(fsdp_param, "unsharded_accumulated_grad"):
                fsdp_param.unsharded_accumulated_grad = None
    for param in model.parameters():
        param.grad = None
