"""The tensor-parallel sharding plan of the Neuron backend, checked against the full model on
the CPU: every rank's shards, emulated with plain matmuls and the same attention code the TP
model runs, must add up to the full model's output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.backends.neuron_tp import COLS, QKV, REPLICATED, ROWS, W13, TPPlan
from trainer.model import attention_core, build_model, swiglu
from trainer.presets import ModelArgs

GQA = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=98,
                max_seq_len=32)
MHA = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=64,
                max_seq_len=32)


def test_fused_qkv_rows_are_each_ranks_own_heads() -> None:
    plan = TPPlan(GQA, 2)  # head_dim 16: rows 0-63 q heads, 64-95 k heads, 96-127 v heads
    rows = plan.qkv_rows(1).tolist()
    assert rows == list(range(32, 64)) + list(range(80, 96)) + list(range(112, 128))
    assert plan.w13_rows(1).tolist() == list(range(48, 96)) + list(range(144, 192))
    assert (plan.q_heads, plan.kv_heads) == (2, 1)


def test_split_kinds() -> None:
    kinds = {n: TPPlan.kind(n) for n in TPPlan(GQA, 2).shapes}
    assert kinds["tok_embeddings.weight"] == ROWS and kinds["output.weight"] == ROWS
    assert kinds["layers.1.attention.wqkv.weight"] == QKV
    assert kinds["layers.1.feed_forward.w13.weight"] == W13
    assert kinds["layers.0.attention.wo.weight"] == COLS
    assert kinds["layers.0.feed_forward.w2.weight"] == COLS
    assert kinds["layers.0.ffn_norm.weight"] == REPLICATED and kinds["norm.weight"] == REPLICATED


@pytest.mark.parametrize("args,tp", [(GQA, 1), (GQA, 2), (MHA, 4)])
def test_shards_cover_every_parameter_once(args: ModelArgs, tp: int) -> None:
    plan = TPPlan(args, tp)
    torch.manual_seed(0)
    model = build_model(args)
    for name, full in model.state_dict().items():
        shards = [plan.shard(name, full, r) for r in range(tp)]
        if plan.kind(name) != REPLICATED:
            assert sum(s.numel() for s in shards) == full.numel(), name
        assert torch.equal(plan.unshard(name, shards), full), name


@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_init_is_the_seeds_model(tp: int) -> None:
    plan = TPPlan(GQA, tp)
    ranks = [plan.sharded_init(seed=7, rank=r) for r in range(tp)]
    torch.manual_seed(7)
    model = build_model(GQA)
    for name, full in model.state_dict().items():
        assert torch.equal(plan.unshard(name, [r[name] for r in ranks]), full), name
    bf16 = plan.sharded_init(seed=7, rank=0, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def _tp_forward(plan: TPPlan, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The TP model's forward emulated for all ranks in one process: what ParallelEmbedding,
    ColumnParallelLinear (gather_output=False) and RowParallelLinear (input_is_parallel,
    all-reduced output) compute, with the plan's shards and the model's own attention code."""
    sd, a, tp = model.state_dict(), plan.args, plan.tp
    shard = {n: [plan.shard(n, t, r) for r in range(tp)] for n, t in sd.items()}
    per_rank = a.vocab_size // tp
    h = 0
    for r in range(tp):  # vocabulary-parallel lookup: each rank embeds the ids it owns
        mine = (tokens >= r * per_rank) & (tokens < (r + 1) * per_rank)
        local = F.embedding((tokens - r * per_rank) * mine, shard["tok_embeddings.weight"][r])
        h = h + local * mine.unsqueeze(-1)
    cos, sin = model.rope_cos[:tokens.shape[1]], model.rope_sin[:tokens.shape[1]]
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        x = layer.attention_norm(h)
        h = h + sum(F.linear(attention_core(F.linear(x, shard[p + "attention.wqkv.weight"][r]),
                                            plan.q_heads, plan.kv_heads, a.head_dim, cos, sin),
                             shard[p + "attention.wo.weight"][r]) for r in range(tp))
        x = layer.ffn_norm(h)
        h = h + sum(F.linear(swiglu(F.linear(x, shard[p + "feed_forward.w13.weight"][r])),
                             shard[p + "feed_forward.w2.weight"][r]) for r in range(tp))
    x = model.norm(h)
    return torch.cat([F.linear(x, shard["output.weight"][r]) for r in range(tp)], dim=-1)


@pytest.mark.parametrize("args,tp", [(GQA, 2), (MHA, 4), (MHA, 2)])
def test_tensor_parallel_forward_equals_the_full_model(args: ModelArgs, tp: int) -> None:
    torch.manual_seed(3)
    model = build_model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(tokens)
        got = _tp_forward(TPPlan(args, tp), model, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_wrong_row_order_would_be_caught() -> None:
    """The emulation is sensitive to the plan: contiguous wqkv blocks (what a plain
    ColumnParallelLinear would hold) give rank 0 only query heads and a different output."""
    torch.manual_seed(3)
    model = build_model(GQA)
    tokens = torch.randint(0, GQA.vocab_size, (2, 16))

    class Contiguous(TPPlan):
        def qkv_rows(self, rank: int) -> torch.Tensor:
            n = self.shapes["layers.0.attention.wqkv.weight"][0] // self.tp
            return torch.arange(rank * n, (rank + 1) * n)

    with torch.no_grad():
        wrong = _tp_forward(Contiguous(GQA, 2), model, tokens)
    assert not torch.allclose(wrong, model(tokens), atol=1e-3)


def test_plan_refuses_what_does_not_divide() -> None:
    with pytest.raises(ValueError, match="does not divide n_kv_heads"):
        TPPlan(GQA, 4)
