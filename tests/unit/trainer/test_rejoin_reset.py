"""A step cut short inside FSDP2's backward leaves nothing behind: after ``reset_iteration``
the next step's gradients are exactly those of a model that never saw the cut step (a
survivor of an in-job recovery redoes steps from a checkpoint; a stale gradient once made
its first step's grad norm 1.96 where the uninterrupted run had 1.43)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from orchestrator.worker.exitgc import collect_released_groups
from trainer.parallel import reset_iteration


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


def test_a_backward_cut_short_leaves_no_gradient_behind(pg,
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



def _checked_worker(rank: int, out: str) -> None:
    import json

    from trainer.parallel import check_before_collectives

    dist.init_process_group("gloo", init_method=f"file://{out}/pg-store", rank=rank,
                            world_size=2)
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1 + rank))
        want = _grads(_model(), x)
        model = _model()
        calls: list[int] = []
        stop_at: list[int] = []

        def check() -> None:
            calls.append(1)
            if len(calls) in stop_at:
                raise _Cut(f"collective {len(calls)}")

        res: dict = {"wrapped": check_before_collectives(model, check)}
        model(x).sum().backward()
        res["per_step"] = per_step = len(calls)
        res["cuts"] = []
        for cut in (1, per_step):  # the forward's first collective, the backward's last
            calls.clear()
            stop_at[:] = [cut]
            try:
                model(x).sum().backward()
                res["cuts"].append(None)
            except _Cut:
                res["cuts"].append(len(calls))  # no collective issued after the cut
            reset_iteration(model)
        stop_at.clear()
        got = _grads(model, x)
        res["clean"] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()
        # As every rank does (orchestrator.worker.exitgc): freed at the interpreter's
        # finalization, a gloo work of a backward aborts the process.
        collect_released_groups()


def test_each_collective_of_a_step_checks_the_order_first(tmp_path) -> None:
    """An in-job recovery's order stops a step before its next FSDP2 collective, in the
    forward (all-gather) and in the backward (reduce-scatter, in autograd's thread): a
    collective issued on a group whose abort is running waits for the whole abort. Both
    ranks cut at the same collective (as both see the order); after the reset, the next
    step's gradients are a clean model's."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_checked_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["wrapped"] == 3  # the three layers (the root holds no parameter)
        assert res["per_step"] >= 6  # each layer's all-gather and reduce-scatter
        assert res["cuts"] == [1, res["per_step"]]
        assert res["clean"]
