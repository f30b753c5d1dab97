"""A step cut short inside FSDP2's backward leaves nothing behind: after ``reset_iteration``
the next step's gradients are exactly those of a model that never saw the cut step (a
survivor of an in-job recovery redoes steps from a checkpoint; a stale gradient once made
its first step's grad norm 1.96 where the uninterrupted run had 1.43)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel import reset_iteration


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 1))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    return model


class _Cut(Exception):
    pass


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).sum().backward()
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def test_a_backward_cut_short_leaves_no_gradient_behind(one_rank_group,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut: the gradient reduction fails (the peer is gone) after autograd has computed
    a module's unsharded gradients and before FSDP2 reduced them into the sharded ones."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    want = _grads(_model(), x)

    model = _model()
    real = group_mod.foreach_reduce

    def failing(*args, **kwargs):
        raise _Cut

    monkeypatch.setattr(group_mod, "foreach_reduce", failing)
    with pytest.raises(_Cut):
        model(x).sum().backward()
    monkeypatch.setattr(group_mod, "foreach_reduce", real)
    reset_iteration(model)
    got = _grads(model, x)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
