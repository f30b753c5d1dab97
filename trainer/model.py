"""A Llama-style decoder in plain torch.

The layout is chosen for the parallelism backends and for export:

- ``Transformer.layers`` is an ``nn.ModuleList`` of ``TransformerBlock`` so callers can
  ``fully_shard``, ``torch.compile`` or activation-checkpoint each block on its own.
- Attention uses one fused ``wqkv`` projection (rows: all query heads, then all key heads,
  then all value heads, each head-major) and the feed-forward one fused ``w13`` (rows: gate,
  then up). Splitting these row blocks gives Hugging Face's ``q_proj``/``k_proj``/``v_proj``
  and ``gate_proj``/``up_proj`` directly.
- RoPE uses the Hugging Face / GPT-NeoX "rotate_half" convention (the two halves of a head are
  rotated as pairs), not Meta's interleaved complex form, so exported q/k weights need no
  permutation for ``LlamaForCausalLM``.
- The model keeps no Python-side state beyond its modules and two non-persistent buffers, so
  FSDP2 and per-block compilation see plain modules.

Build on the meta device, shard, ``to_empty(device=...)``, then ``init_weights()``:
``build_model`` does exactly that for a single device, so both paths give the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.presets import ModelArgs

__all__ = ["RMSNorm", "Attention", "FeedForward", "TransformerBlock", "Transformer",
           "rope_tables", "apply_rope", "attention_core", "swiglu", "init_specs", "build_model"]


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32 for bf16 stability, output in input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Same order as HF LlamaRMSNorm: cast back first, then scale by the weight.
        return self.weight * xf.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_seq_len, head_dim] in float32 (rotate_half layout).

    Frequency j (0 <= j < head_dim/2) is theta^(-2j/head_dim); the table repeats the
    frequencies for the second half of the head, as in HF's LlamaRotaryEmbedding.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                             dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, head_dim] by tables [T, head_dim] (cast to x's dtype, like HF)."""
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def attention_core(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention from a fused projection's output.

    ``qkv`` [B, T, (n_heads + 2 * n_kv_heads) * head_dim] holds the query heads, then the key
    heads, then the value heads; returns [B, T, n_heads * head_dim], before the output
    projection. A tensor-parallel rank calls it with its own heads only (``n_heads / tp``
    and ``n_kv_heads / tp``, see ``trainer.backends.neuron_tp``): query head h reads kv head
    h // (n_heads / n_kv_heads) globally and locally alike.
    """
    bsz, seqlen, _ = qkv.shape
    q_size = n_heads * head_dim
    kv_size = n_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(bsz, seqlen, n_heads, head_dim).transpose(1, 2)
    k = k.view(bsz, seqlen, n_kv_heads, head_dim).transpose(1, 2)
    v = v.view(bsz, seqlen, n_kv_heads, head_dim).transpose(1, 2)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    gqa = {}
    if n_kv_heads != n_heads:
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            # The flash and cuDNN kernels read shared K/V heads directly: no copies.
            gqa = {"enable_gqa": True}
        else:
            # Elsewhere (fp32, CPU) expand K/V: on torch 2.11 only the half-precision flash
            # and cuDNN kernels accept enable_gqa, the rest fall back to the slow math kernel.
            # Query head h reads kv head h // n_rep, as in HF's repeat_kv.
            n_rep = n_heads // n_kv_heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    return out.transpose(1, 2).reshape(bsz, seqlen, q_size)


def swiglu(h13: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` from a fused projection whose first half is the gate."""
    gate, up = h13.chunk(2, dim=-1)
    return F.silu(gate) * up


class Attention(nn.Module):
    """Causal grouped-query attention with a fused qkv projection."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_out, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.wo(attention_core(self.wqkv(x), self.n_heads, self.n_kv_heads,
                                      self.head_dim, cos, sin))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(gate) * up)`` with ``w13`` rows [0, ffn_dim) = gate, the rest = up."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.ffn_dim = args.ffn_dim
        self.w13 = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w13(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init_std: float, out_std: float) -> None:
        """Normal(0, init_std) on the input projections, out_std on the residual outputs."""
        self.attention_norm.reset_parameters()
        nn.init.normal_(self.attention.wqkv.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.attention.wo.weight, mean=0.0, std=out_std)
        self.ffn_norm.reset_parameters()
        nn.init.normal_(self.feed_forward.w13.weight, mean=0.0, std=init_std)
        nn.init.normal_(self.feed_forward.w2.weight, mean=0.0, std=out_std)


class Transformer(nn.Module):
    """Decoder-only transformer: ``forward(tokens[B, T]) -> float32 logits[B, T, vocab]``.

    Constructing it leaves torch's default layer init; call ``init_weights()`` (or use
    ``build_model``) for the documented init.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.head_dim % 2:
            raise ValueError(f"head_dim {args.head_dim} must be even for RoPE")
        if args.n_heads % args.n_kv_heads:
            raise ValueError(f"n_heads {args.n_heads} not divisible by n_kv_heads "
                             f"{args.n_kv_heads}")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so kept out of the state dict (checkpoints stay weight-only and
        # a changed max_seq_len does not break loading).
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta,
                               device=self.output.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The RoPE tables (derived from the model's shape, kept out of checkpoints): what a
        model whose weights a checkpoint restores still needs computed."""
        args = self.args
        # Computed on the CPU on every device so the tables are bit-identical everywhere;
        # copy_ keeps the buffer objects, which FSDP or compiled graphs may already reference.
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, device="cpu")
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE buffers from the current RNG state.

        The draw order is fixed (embedding, then each block's wqkv, wo, w13, w2, then the
        output head), so the same seed gives the same weights however the model was built.
        Residual output projections use init_std / sqrt(2 * n_layers) so the residual stream's
        variance does not grow with depth (GPT-2's scaled init). FSDP2's DTensor parameters
        (initialised after sharding) draw through DTensor's random ops: the same numbers for
        the same seed and world size run after run (bit-exact resume relies on that), but not
        the numbers an unsharded model draws (on torch 2.13 CPU too: its first loss is 5.624
        where DDP's is 5.565).
        """
        args = self.args
        self.init_buffers()
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=args.init_std)
        out_std = args.init_std / math.sqrt(2 * args.n_layers)
        for layer in self.layers:
            layer.init_weights(args.init_std, out_std)
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, mean=0.0, std=args.init_std)
        # LoRA adapters (trainer.finetune, peft's layers) draw after the whole base, so adding
        # them leaves the base weights of a seed unchanged.
        for module in self.modules():
            reset = getattr(module, "reset_lora_parameters", None)
            if reset is not None:
                for name in module.lora_A:
                    reset(name, True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len "
                             f"{self.args.max_seq_len}")
        cos = self.rope_cos[:seqlen]
        sin = self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        # Logits in the compute dtype: the loss upcasts them (inside a compiled function when
        # compile is on, so the fp32 copy of a vocab-sized tensor is never materialised).
        return self.output(h)

    def num_params(self) -> int:
        """Number of parameters (global counts, also for sharded DTensor parameters)."""
        return sum(p.numel() for p in self.parameters())


def init_specs(args: ModelArgs) -> list[tuple[str, float | None]]:
    """Every parameter in ``Transformer.init_weights``'s draw order with its init: the std of
    its normal draw, or None for ones (norm gains, which draw nothing). Replaying it from the
    same seed gives the same weights however the parameters are laid out (tensor parallel)."""
    out_std = args.init_std / math.sqrt(2 * args.n_layers)
    specs: list[tuple[str, float | None]] = [("tok_embeddings.weight", args.init_std)]
    for i in range(args.n_layers):
        p = f"layers.{i}."
        specs += [(p + "attention_norm.weight", None), (p + "attention.wqkv.weight", args.init_std),
                  (p + "attention.wo.weight", out_std), (p + "ffn_norm.weight", None),
                  (p + "feed_forward.w13.weight", args.init_std),
                  (p + "feed_forward.w2.weight", out_std)]
    return specs + [("norm.weight", None), ("output.weight", args.init_std)]


def build_model(args: ModelArgs, device: torch.device | str = "cpu") -> Transformer:
    """A Transformer on ``device``, initialised by ``init_weights`` from the current RNG state.

    ``device="meta"`` returns the uninitialised skeleton for sharding first; the caller then
    runs ``to_empty(device=...)`` and ``init_weights()``. Other devices build on meta too and
    materialise, so no RNG draws are spent on torch's default init and both paths agree.
    """
    with torch.device("meta"):
        model = Transformer(args)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights()
    return model
