"""Tensor parallelism for our Transformer on Trainium: the sharding plan and the TP model.

The plan (``TPPlan``) is plain torch and says which part of every full parameter each
tensor-parallel rank holds. It mirrors how neuronx-distributed's layers split their weights
(``neuronx_distributed.parallel_layers.layers``: ``ColumnParallelLinear`` keeps rows
``[r * out / tp, (r + 1) * out / tp)`` of its weight, ``RowParallelLinear`` the same block of
columns, ``ParallelEmbedding`` the vocabulary range ``[r * V / tp, (r + 1) * V / tp)``), with
one twist for our fused projections: a contiguous row block of ``wqkv`` would give rank 0
only query heads, so rank r's local ``wqkv`` rows are ITS query heads, then its key heads,
then its value heads (GQA: n_heads / tp query and n_kv_heads / tp kv heads per rank), and its
local ``w13`` rows its block of gate rows then its block of up rows. A local projection then
splits exactly like the full model's, and ``trainer.model.attention_core`` / ``swiglu`` run
unchanged on each rank's heads. Weights are initialised full-size, one parameter at a time,
in ``Transformer.init_weights``'s draw order from ``trainer.seed`` and then sharded, so a TP
run starts from the same weights as a DDP, DeepSpeed or single-device run.

The TP modules (``TPTransformer``) keep our module names (``layers.0.attention.wqkv``, ...),
so a rank's state dict is the plan's shard of ours. They are built from neuronx-distributed's
``ColumnParallelLinear``, ``RowParallelLinear`` and ``ParallelEmbedding``, imported inside
their constructors: this module imports without the Neuron SDK, and the plan is unit-tested
on the CPU. The TP modules themselves could not run here (no torch-xla build for this
machine's torch, no neuronx-distributed wheel); they follow the NxD API as published in the
aws-neuron/neuronx-distributed repository.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from trainer.model import RMSNorm, Transformer, attention_core, init_specs, rope_tables, swiglu
from trainer.presets import ModelArgs

# How each parameter of our Transformer is split (by the last part of its name).
REPLICATED, ROWS, COLS, QKV, W13 = "replicated", "rows", "cols", "qkv", "w13"
_KINDS = {"tok_embeddings.weight": ROWS, "output.weight": ROWS, "wqkv.weight": QKV,
          "w13.weight": W13, "wo.weight": COLS, "w2.weight": COLS}


@dataclass(frozen=True)
class TPPlan:
    """Which part of each full parameter tensor-parallel rank r of ``tp`` holds."""

    args: ModelArgs
    tp: int

    def __post_init__(self) -> None:
        for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            if self.tp < 1 or getattr(self.args, name) % self.tp:
                raise ValueError(f"tensor_parallel {self.tp} does not divide {name} "
                                 f"({getattr(self.args, name)})")

    @property
    def q_heads(self) -> int:
        return self.args.n_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return self.args.n_kv_heads // self.tp

    @cached_property
    def shapes(self) -> dict[str, torch.Size]:
        with torch.device("meta"):
            return {n: p.shape for n, p in Transformer(self.args).named_parameters()}

    @staticmethod
    def kind(name: str) -> str:
        return next((k for suffix, k in _KINDS.items() if name.endswith(suffix)), REPLICATED)

    def qkv_rows(self, rank: int) -> torch.Tensor:
        """Rows of the full ``wqkv`` that rank holds: its query, key, then value heads."""
        hd, a = self.args.head_dim, self.args
        q = torch.arange(rank * self.q_heads * hd, (rank + 1) * self.q_heads * hd)
        kv = torch.arange(rank * self.kv_heads * hd, (rank + 1) * self.kv_heads * hd)
        return torch.cat([q, a.n_heads * hd + kv, (a.n_heads + a.n_kv_heads) * hd + kv])

    def w13_rows(self, rank: int) -> torch.Tensor:
        """Rows of the full ``w13`` that rank holds: its gate block, then its up block."""
        block = self.args.ffn_dim // self.tp
        gate = torch.arange(rank * block, (rank + 1) * block)
        return torch.cat([gate, self.args.ffn_dim + gate])

    def shard(self, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's part of the full parameter ``name`` (a copy for the fused ones)."""
        kind = self.kind(name)
        if kind == QKV:
            return full.index_select(0, self.qkv_rows(rank))
        if kind == W13:
            return full.index_select(0, self.w13_rows(rank))
        if kind in (ROWS, COLS):
            dim = 0 if kind == ROWS else 1
            return full.chunk(self.tp, dim=dim)[rank]
        return full

    def unshard(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full parameter from every rank's shard (rank order), e.g. to export."""
        kind = self.kind(name)
        if kind in (QKV, W13):
            full = shards[0].new_empty(self.shapes[name])
            rows = self.qkv_rows if kind == QKV else self.w13_rows
            for rank, shard in enumerate(shards):
                full.index_copy_(0, rows(rank), shard)
            return full
        if kind in (ROWS, COLS):
            return torch.cat(shards, dim=0 if kind == ROWS else 1)
        return shards[0]

    def sharded_init(self, seed: int, rank: int,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Rank's shards of the weights ``build_model`` makes from ``seed``: each full
        parameter is drawn on the CPU in ``init_specs`` order (one at a time), then sharded."""
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name, std in init_specs(self.args):
            full = torch.empty(self.shapes[name])
            if std is None:
                full.fill_(1.0)
            else:
                full.normal_(0.0, std, generator=gen)
            out[name] = self.shard(name, full, rank).to(dtype).clone()
        return out


# -- the TP model (neuronx-distributed layers; needs the Neuron SDK) --------------------------

def _skip_init(weight: torch.Tensor) -> None:
    """NxD layers initialise a full-size master weight and slice it; ours come from
    ``TPPlan.sharded_init`` (or a checkpoint) right after construction, so skip the draw."""


def _layers() -> Any:
    """``neuronx_distributed.parallel_layers.layers`` (imported when a TP module is built)."""
    from neuronx_distributed.parallel_layers import layers

    return layers


class TPAttention(nn.Module):
    """``Attention`` over this rank's heads: column-parallel ``wqkv`` (rows per
    ``TPPlan.qkv_rows``, output kept local), row-parallel ``wo`` (output all-reduced)."""

    def __init__(self, plan: TPPlan, dtype: torch.dtype) -> None:
        super().__init__()
        layers, a = _layers(), plan.args
        self.q_heads, self.kv_heads, self.head_dim = plan.q_heads, plan.kv_heads, a.head_dim
        self.wqkv = layers.ColumnParallelLinear(
            a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False,
            gather_output=False, dtype=dtype, init_method=_skip_init)
        self.wo = layers.RowParallelLinear(a.n_heads * a.head_dim, a.dim, bias=False,
                                           input_is_parallel=True, dtype=dtype,
                                           init_method=_skip_init)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.wo(attention_core(self.wqkv(x), self.q_heads, self.kv_heads,
                                      self.head_dim, cos, sin))


class TPFeedForward(nn.Module):
    """SwiGLU over this rank's block of the hidden size (``TPPlan.w13_rows``)."""

    def __init__(self, plan: TPPlan, dtype: torch.dtype) -> None:
        super().__init__()
        layers, a = _layers(), plan.args
        self.w13 = layers.ColumnParallelLinear(a.dim, 2 * a.ffn_dim, bias=False,
                                               gather_output=False, dtype=dtype,
                                               init_method=_skip_init)
        self.w2 = layers.RowParallelLinear(a.ffn_dim, a.dim, bias=False, input_is_parallel=True,
                                           dtype=dtype, init_method=_skip_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x)))


class TPBlock(nn.Module):
    """``TransformerBlock`` with tensor-parallel attention and feed-forward (the unit NxD's
    activation checkpointing wraps)."""

    def __init__(self, plan: TPPlan, dtype: torch.dtype) -> None:
        super().__init__()
        a = plan.args
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = TPAttention(plan, dtype)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = TPFeedForward(plan, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TPTransformer(nn.Module):
    """Our decoder with vocabulary-parallel embedding and output head: ``forward(tokens)``
    returns this rank's slice of the logits [B, T, vocab / tp] (float32), for NxD's
    ``parallel_cross_entropy``."""

    def __init__(self, plan: TPPlan, dtype: torch.dtype) -> None:
        super().__init__()
        layers, a = _layers(), plan.args
        self.args = a
        self.tok_embeddings = layers.ParallelEmbedding(a.vocab_size, a.dim, dtype=dtype,
                                                       init_method=_skip_init)
        self.layers = nn.ModuleList(TPBlock(plan, dtype) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = layers.ColumnParallelLinear(a.dim, a.vocab_size, bias=False,
                                                  gather_output=False, dtype=dtype,
                                                  init_method=_skip_init)
        for norm in self.norms():
            norm.weight.data = norm.weight.data.to(dtype)
        cos, sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, device="cpu")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def norms(self) -> list[RMSNorm]:
        return [m for m in self.modules() if isinstance(m, RMSNorm)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()


def build_tp_model(plan: TPPlan, rank: int, seed: int, dtype: torch.dtype) -> TPTransformer:
    """The TP model of ``rank`` on the CPU, holding its shards of the seed's weights (NxD's
    ``initialize_parallel_model`` then moves it to the XLA device)."""
    model = TPTransformer(plan, dtype)
    model.load_state_dict(plan.sharded_init(seed, rank, dtype), strict=True)
    return model
