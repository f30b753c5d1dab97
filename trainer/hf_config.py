"""A Hugging Face Llama ``config.json`` and our model shape, both ways (pure: no torch).

Kept apart from ``trainer.hf`` (which moves tensors) so the config schema can read an HF
directory's shape without importing the checkpoint and parallelism code behind it.
"""

from __future__ import annotations

from typing import Any

from trainer.presets import ModelArgs

CONFIG = "config.json"


def hf_config(args: ModelArgs, dtype: str = "float32", bos_id: int | None = None,
              eos_id: int | None = None) -> dict[str, Any]:
    """A ``LlamaConfig`` dict (config.json) for our shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": args.init_std,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype,
        "use_cache": True,
    }


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """Our shape from a Llama config.json; ValueError for what our decoder cannot express."""
    if cfg.get("model_type") != "llama":
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not 'llama'")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    if kind not in (None, "default"):
        raise ValueError(f"RoPE scaling {kind!r} is not supported (only plain RoPE)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ValueError(f"{flag} is set; our decoder has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not silu")
    dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if int(cfg.get("head_dim") or dim // heads) != dim // heads:
        raise ValueError(f"head_dim {cfg['head_dim']} != hidden_size / heads ({dim // heads})")
    theta = cfg.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None)
    return ModelArgs(dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
                     n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                     ffn_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                     max_seq_len=int(cfg.get("max_position_embeddings") or 2048),
                     rope_theta=float(theta or 10000.0), norm_eps=float(cfg.get("rms_norm_eps",
                                                                                 1e-5)),
                     init_std=float(cfg.get("initializer_range", 0.02)))
