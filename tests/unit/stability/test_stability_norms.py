"""Gradient and parameter norms, on plain tensors and on FSDP2 shards over a real gloo group."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from orchestrator.worker.exitgc import collect_released_groups
from stability.norms import clip_grad_norm_, param_norm


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Odd sizes so FSDP2's dim-0 shards are uneven (and one bias shard is small).
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _batch() -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1))


def test_param_norm_plain_tensors():
    model = _model()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(param_norm(model.parameters()), flat.norm())
    assert param_norm(model[0].weight).item() == pytest.approx(model[0].weight.norm().item())
    assert param_norm([]).item() == 0.0


def test_param_norm_mixed_dtypes_is_float32():
    tensors = [torch.ones(4, dtype=torch.bfloat16), torch.full((9,), 2.0)]
    norm = param_norm(tensors)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx((4 + 36) ** 0.5)


def test_clip_grad_norm_matches_torch():
    ours, ref = _model(), _model()
    for m in (ours, ref):
        (m(_batch()) ** 2).sum().backward()
    total = clip_grad_norm_(ours.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert torch.equal(total, expected)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def _fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-store", rank=rank,
                            world_size=world)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        calls = []
        real_all_reduce = dist.all_reduce

        def counting_all_reduce(*args, **kwargs):
            calls.append(1)
            return real_all_reduce(*args, **kwargs)

        with mock.patch.object(dist, "all_reduce", counting_all_reduce):
            pnorm = param_norm(model.parameters())
        # Every rank sees the same batch, so the averaged gradient is the single-process one.
        (model(_batch()) ** 2).sum().backward()
        gnorm = clip_grad_norm_(model.parameters(), 0.5)
        grads = {n: p.grad.full_tensor().flatten().tolist() for n, p in model.named_parameters()}
        result = {
            "param_norm": pnorm.item(),
            "param_norm_type": type(pnorm).__name__,
            "all_reduces": len(calls),
            "grad_norm": gnorm.item(),
            "grad_norm_type": type(gnorm).__name__,
            "clipped": grads,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
        # As every rank does (orchestrator.worker.exitgc): freed at the interpreter's
        # finalization, a gloo work of a backward aborts the process.
        collect_released_groups()


def test_param_and_grad_norm_under_fsdp2_match_the_unsharded_model(tmp_path):
    world = 2
    mp.spawn(_fsdp_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]

    ref = _model()
    ref_pnorm = torch.cat([p.detach().flatten() for p in ref.parameters()]).norm().item()
    (ref(_batch()) ** 2).sum().backward()
    ref_gnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
    assert ref_gnorm > 0.5  # the clip did scale the gradients

    for res in results:
        assert res["param_norm_type"] == "Tensor" and res["grad_norm_type"] == "Tensor"
        assert res["all_reduces"] == 1
        assert res["param_norm"] == pytest.approx(ref_pnorm, rel=1e-6)
        assert res["grad_norm"] == pytest.approx(ref_gnorm, rel=1e-5)
        for name, p in ref.named_parameters():
            assert res["clipped"][name] == pytest.approx(p.grad.flatten().tolist(), rel=1e-5)
