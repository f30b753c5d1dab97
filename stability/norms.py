"""Gradient and parameter norms for the step records, at the cost of one reduction each.

Only the worker imports this module (it needs torch); the rest of ``stability`` is pure Python.
Both functions are collectives when the parameters are DTensors (FSDP2): every rank must call
them at the same point, and every rank gets the same global value back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]


def clip_grad_norm_(
    parameters: TensorOrTensors, max_norm: float, foreach: bool = True, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients in place to ``max_norm``; return the total norm before clipping.

    This is ``torch.nn.utils.clip_grad_norm_`` cut at the one place it differs: that function is
    ``get_total_norm`` followed by ``clip_grads_with_norm_``, and under FSDP2 its total norm is a
    DTensor with a pending (Partial) reduction, which the clip and the caller's ``.item()`` would
    each resolve again. Here the norm is materialised once with ``.full_tensor()`` (one
    all-reduce), the clip uses that plain tensor, and the same tensor is returned: the grad norm
    of the step record comes from the clipping itself, with no extra pass over the gradients.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _replicas(p: DTensor) -> int:
    """How many ranks of ``p``'s mesh hold each of its local elements."""
    count = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_partial():
            # A partial value's squares do not sum to the square of its sum.
            raise ValueError("param_norm: parameters with Partial placements are not supported")
        if placement.is_replicate():
            count *= p.device_mesh.size(dim)
    return count


def _same_mesh(a: object | None, b: object | None) -> bool:
    return a is b if a is None or b is None else a == b


@torch.no_grad()
def param_norm(parameters: TensorOrTensors) -> torch.Tensor:
    """Total L2 norm of ``parameters`` as a 0-d float32 tensor.

    Plain tensors: the norm of all of them, no communication (in a distributed run a plain
    parameter is taken to be the same on every rank and counted once). DTensors (FSDP2 shards):
    per-tensor norms of the local shards with ``torch._foreach_norm``, their squares summed, and
    ONE all-reduce of that sum per mesh dimension (one for FSDP2's 1-D mesh). Replicated mesh
    dimensions are divided out before the sum so replicated elements are counted once.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not params:
        return torch.zeros((), dtype=torch.float32)
    locals_: list[torch.Tensor] = []
    weights: list[float] = []
    meshes: list[object | None] = []
    for p in params:
        if isinstance(p, DTensor):
            locals_.append(p.to_local().detach())
            weights.append(1.0 / _replicas(p))
            meshes.append(p.device_mesh)
        else:
            locals_.append(p.detach())
            weights.append(1.0)
            meshes.append(None)
    device = locals_[0].device
    # float32 norms: a bf16 norm keeps ~3 significant digits, too few to see a jump.
    norms = torch._foreach_norm(locals_, 2, dtype=torch.float32)
    squares = torch.stack([n.to(device) for n in norms]).square()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for mesh in dict.fromkeys(meshes):  # distinct meshes, first-seen order on every rank
        idx = [i for i, m in enumerate(meshes) if _same_mesh(m, mesh)]
        w = torch.tensor([weights[i] for i in idx], dtype=torch.float32, device=device)
        part = (squares[idx] * w).sum()
        if mesh is not None:
            for dim in range(mesh.ndim):
                dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total + part
    return total.sqrt()

