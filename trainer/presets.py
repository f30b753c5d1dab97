"""Model shapes, from a test-sized model to the 7B/8B shapes of real runs (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama-style decoder."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count (embedding and output projection are untied)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attn = self.dim * (self.dim + 2 * kv_dim) + self.dim * self.dim
        ffn = 3 * self.dim * self.ffn_dim
        block = attn + ffn + 2 * self.dim
        emb = self.vocab_size * self.dim
        total = self.n_layers * block + self.dim + emb  # blocks, final norm, output head
        return total + (emb if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N over the non-embedding weights plus attention.

        6N counts forward (2N) and backward (4N) matmul FLOPs (the output head included, the
        input embedding, a lookup, not). Attention adds 12 * layers * seq_len * dim: QK^T and
        AV, 2 * 2 * s * d forward, times 3 for forward + backward, counted without the causal
        halving, as PaLM's appendix B and torchtitan count it. The reference figures our GPU
        benchmark compares against (71.4k tokens/s = 52.2 % MFU for the 1.14B model) use this
        convention, so our MFU reads on the same scale.
        """
        n = self.num_params(include_embedding=False)
        return 6.0 * n + 12.0 * self.n_layers * seq_len * self.dim


PRESETS: dict[str, ModelArgs] = {
    # Fits a CPU test in seconds: byte-level vocab (256 bytes + BOS/EOS, padded to 264).
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                      vocab_size=264, max_seq_len=512),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768,
                       vocab_size=264, max_seq_len=1024),
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048,
                      vocab_size=32000, max_seq_len=2048),
    # The 1.14B benchmark model of the GPU issue.
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=8192,
                    vocab_size=32000, max_seq_len=2048),
    "llama2-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                           vocab_size=32000, max_seq_len=4096),
    "llama3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                           vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
}

_OVERRIDABLE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                "max_seq_len", "rope_theta", "norm_eps", "init_std")


def resolve_model_args(model_cfg: Any) -> ModelArgs:
    """The preset named by ``model_cfg.preset`` with every non-null field of it applied."""
    base = PRESETS[model_cfg.preset]
    overrides = {k: getattr(model_cfg, k) for k in _OVERRIDABLE if getattr(model_cfg, k, None)
                 is not None}
    return replace(base, **overrides)
