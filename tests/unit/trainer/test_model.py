"""The Llama-style decoder: shapes, counts, causality, RoPE/GQA against references, init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.model import FeedForward, Transformer, apply_rope, build_model, rope_tables
from trainer.presets import PRESETS, ModelArgs


def _ref_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (i, i + half) of x [B, T, H, hd] by angle t * theta^(-2i/hd), in float64."""
    hd = x.shape[-1]
    half = hd // 2
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _ref_attention(attn, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Causal GQA written out: query head h reads kv head h // (n_heads / n_kv_heads)."""
    bsz, seqlen, _ = x.shape
    h, kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w = attn.wqkv.weight.double()
    xd = x.double()
    q = (xd @ w[: h * hd].T).view(bsz, seqlen, h, hd)
    k = (xd @ w[h * hd: (h + kv) * hd].T).view(bsz, seqlen, kv, hd)
    v = (xd @ w[(h + kv) * hd:].T).view(bsz, seqlen, kv, hd)
    q, k = _ref_rope(q, theta), _ref_rope(k, theta)
    owner = [i // (h // kv) for i in range(h)]
    k, v = k[:, :, owner], v[:, :, owner]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
    future = torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("bhts,bshd->bthd", probs, v).reshape(bsz, seqlen, h * hd)
    return out @ attn.wo.weight.double().T


def test_forward_shape_and_dtype(small_args: ModelArgs) -> None:
    torch.manual_seed(0)
    model = build_model(small_args)
    logits = model(torch.randint(0, small_args.vocab_size, (3, 17)))
    assert logits.shape == (3, 17, small_args.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_matches_model_args(name: str) -> None:
    args = PRESETS[name]
    model = build_model(args, device="meta")  # meta: even the 8B shape costs no memory
    assert model.num_params() == args.num_params()


def test_rope_buffers_are_not_in_state_dict(small_args: ModelArgs) -> None:
    model = build_model(small_args)
    assert not any("rope" in key for key in model.state_dict())
    assert model.rope_cos.shape == (small_args.max_seq_len, small_args.head_dim)
    assert model.rope_cos.dtype == torch.float32


def test_causal_later_tokens_do_not_change_earlier_logits(small_args: ModelArgs) -> None:
    torch.manual_seed(0)
    model = build_model(small_args)
    tokens = torch.randint(0, small_args.vocab_size, (2, 24))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % small_args.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3


def test_rope_matches_rotate_half_reference() -> None:
    torch.manual_seed(0)
    hd, theta = 16, 500000.0
    cos, sin = rope_tables(hd, 40, theta)
    x = torch.randn(2, 40, 3, hd)  # [B, T, H, hd]
    got = apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)
    torch.testing.assert_close(got.double(), _ref_rope(x, theta), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_reference_with_gqa(small_args: ModelArgs, n_kv_heads: int) -> None:
    args = ModelArgs(**{**small_args.__dict__, "n_kv_heads": n_kv_heads})
    torch.manual_seed(1)
    model = build_model(args)
    attn = model.layers[0].attention
    x = torch.randn(2, 20, args.dim)
    with torch.no_grad():
        got = attn(x, model.rope_cos[:20], model.rope_sin[:20])
    torch.testing.assert_close(got.double(), _ref_attention(attn, x, args.rope_theta),
                               rtol=0, atol=1e-5)


def test_feed_forward_gate_is_the_first_half(small_args: ModelArgs) -> None:
    torch.manual_seed(0)
    ff = FeedForward(small_args)
    x = torch.randn(4, small_args.dim)
    w = ff.w13.weight
    gate, up = x @ w[: small_args.ffn_dim].T, x @ w[small_args.ffn_dim:].T
    expected = (F.silu(gate) * up) @ ff.w2.weight.T
    torch.testing.assert_close(ff(x), expected)


def test_init_std_scales_output_projections() -> None:
    args = ModelArgs(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=64,
                     max_seq_len=16, init_std=0.02)
    torch.manual_seed(0)
    model = build_model(args)
    out_std = 0.02 / math.sqrt(2 * 8)
    for layer in model.layers:
        assert layer.attention.wo.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert layer.feed_forward.w2.weight.std().item() == pytest.approx(out_std, rel=0.03)
        assert layer.attention.wqkv.weight.std().item() == pytest.approx(0.02, rel=0.03)
        assert layer.feed_forward.w13.weight.std().item() == pytest.approx(0.02, rel=0.03)
        assert torch.equal(layer.attention_norm.weight, torch.ones(256))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert abs(model.layers[0].attention.wo.weight.mean().item()) < 1e-3


def test_same_seed_builds_are_bit_identical(small_args: ModelArgs) -> None:
    torch.manual_seed(7)
    a = build_model(small_args).state_dict()
    torch.manual_seed(7)
    b = build_model(small_args).state_dict()
    torch.manual_seed(8)
    c = build_model(small_args).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["output.weight"], c["output.weight"])


def test_meta_build_then_init_equals_direct_build(small_args: ModelArgs) -> None:
    torch.manual_seed(3)
    direct = build_model(small_args)
    meta = build_model(small_args, device="meta")
    assert meta.output.weight.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for key, value in direct.state_dict().items():
        assert torch.equal(value, meta.state_dict()[key]), key
    assert torch.equal(direct.rope_cos, meta.rope_cos)
    assert torch.equal(direct.rope_sin, meta.rope_sin)


def test_too_long_sequence_is_rejected(small_args: ModelArgs) -> None:
    model = build_model(small_args)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, small_args.max_seq_len + 1, dtype=torch.long))


def test_training_on_a_repeated_batch_lowers_the_loss(small_args: ModelArgs) -> None:
    torch.manual_seed(0)
    model: Transformer = build_model(small_args)
    data = torch.randint(0, small_args.vocab_size, (4, 33))
    inputs, targets = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(small_args.vocab_size), rel=0.1)
    assert losses[-1] < 0.5 * losses[0]
