"""Export of LoRA / QLoRA checkpoints: merged into the base, or the adapter alone (peft).

A fine-tuning checkpoint holds the adapters only; its manifest's ``finetune`` record names the
base (the Hugging Face directory the run started from) and the adapter shape. Export rebuilds
our adapted model on the CPU with no process group, loads the base and the checkpoint's
adapters, and then either

- merges them with peft's own ``LoraLayer.merge`` (W + alpha / r * B @ A) into a plain
  Llama directory (``trainer.hf.write_hf_dir``). A QLoRA base is merged in its NF4 round trip
  (what the run computed with), so the export computes what was trained; or
- writes the adapter in peft's format for ``LlamaForCausalLM`` (``adapter_config.json`` +
  ``adapter_model.safetensors``). Our fused ``wqkv`` and ``w13`` adapters become one adapter
  per Hugging Face projection: B's rows split exactly as the weight's do, A shared, since
  ``B @ A`` split by rows is ``B_q @ A``, ``B_k @ A``, ``B_v @ A``. Nothing is approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.presets import ModelArgs

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.config import FinetuneConfig

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
# ours -> the LlamaForCausalLM projections it maps to (split by rows in this order).
HF_TARGETS = {"wqkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
              "wo": ("self_attn", ("o_proj",)),
              "w13": ("mlp", ("gate_proj", "up_proj")),
              "w2": ("mlp", ("down_proj",))}
_PATHS = {"wqkv": "attention.wqkv", "wo": "attention.wo", "w13": "feed_forward.w13",
          "w2": "feed_forward.w2"}


def finetune_config(manifest: dict[str, Any]) -> FinetuneConfig:
    """The manifest's ``finetune`` record, parsed and checked like the run's config."""
    from trainer.config import FinetuneConfig

    record = dict(manifest["finetune"])
    record.pop("base", None)
    return FinetuneConfig.model_validate(record)


def adapter_weights(step_url: str, manifest: dict[str, Any], model: nn.Module,
                    ) -> dict[str, torch.Tensor]:
    """The checkpoint's adapter tensors for ``model``'s adapter keys (DCP, no process group),
    each file checked against the verified ``manifest`` as it is read."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.checkpointer import SafeLoadPlanner
    from trainer.checkpoint.verified_reader import VerifiedReader
    from trainer.finetune import is_adapter_key

    sd = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    state = {"app": {"model": sd}}
    dcp.load(state, storage_reader=VerifiedReader(step_url, manifest), no_dist=True,
             planner=SafeLoadPlanner())
    return state["app"]["model"]


def load_adapted(step_url: str, manifest: dict[str, Any]) -> nn.Module:
    """Our Transformer with the checkpoint's adapters on its base, on the CPU.

    The base comes from the manifest's ``finetune.base`` directory; under QLoRA its wrapped
    weights are replaced by their NF4 round trip (``trainer.finetune.dequantized``), which is
    what the adapters were trained against.
    """
    import torch

    from trainer.finetune import add_adapters, base_state_dict, dequantized, lora_layers
    from trainer.hf import check_shape, read_hf_dir
    from trainer.model import Transformer

    ft = finetune_config(manifest)
    args = ModelArgs(**manifest["model"])
    base = manifest["finetune"].get("base")
    if not base or not Path(base).expanduser().is_dir():
        raise ValueError(f"{step_url}: the base {base!r} the adapters were trained on is not a "
                         "directory here (export --adapter-only needs no base)")
    hf_args, sd = read_hf_dir(base)
    mismatch = check_shape(args, hf_args)
    if mismatch:
        raise ValueError(f"{base}: differs from the checkpoint's model: {'; '.join(mismatch)}")
    with torch.device("meta"):
        model = Transformer(args)
    model = add_adapters(model, ft)
    model.to_empty(device="cpu")
    model.init_weights()  # the RoPE tables; every weight is overwritten below
    sd = base_state_dict(model, sd)
    if ft.method == "qlora":
        wrapped = {f"{name}.base_layer.weight" for name, _ in lora_layers(model)}
        sd = {k: dequantized(v.float(), ft) if k in wrapped else v for k, v in sd.items()}
    sd.update(adapter_weights(step_url, manifest, model))
    model.load_state_dict(sd, strict=True)
    return model


def merged_weights(step_url: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our plain state dict with the adapters merged in (peft's ``merge``)."""
    from trainer.finetune import lora_layers

    model = load_adapted(step_url, manifest)
    for name, layer in lora_layers(model):
        layer.merge(safe_merge=True)  # raises on a non-finite merged weight
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer.get_base_layer())
    return {k: v.detach() for k, v in model.state_dict().items()}


def peft_adapter(adapters: dict[str, torch.Tensor], args: ModelArgs,
                 ft: FinetuneConfig) -> dict[str, torch.Tensor]:
    """Our adapter tensors -> peft's saved names on ``LlamaForCausalLM`` (rows split)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    rows = {"wqkv": [q, kv, kv], "wo": [args.dim], "w13": [args.ffn_dim, args.ffn_dim],
            "w2": [args.dim]}
    out = {}
    for i in range(args.n_layers):
        for target in ft.target_modules:
            ours = f"layers.{i}.{_PATHS[target]}"
            a = adapters[f"{ours}.lora_A.default.weight"]
            b = adapters[f"{ours}.lora_B.default.weight"]
            block, names = HF_TARGETS[target]
            for name, b_rows in zip(names, b.split(rows[target], dim=0)):
                theirs = f"base_model.model.model.layers.{i}.{block}.{name}"
                out[f"{theirs}.lora_A.weight"] = a.clone().contiguous()
                out[f"{theirs}.lora_B.weight"] = b_rows.clone().contiguous()
    return out


def write_peft_adapter(out_dir: str | Path, step_url: str, manifest: dict[str, Any], *,
                       dtype: str = "float32") -> list[str]:
    """Write the checkpoint's adapter in peft's format; returns the files written."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    from trainer.finetune import add_adapters
    from trainer.model import Transformer

    ft = finetune_config(manifest)
    args = ModelArgs(**manifest["model"])
    with torch.device("meta"):
        model = add_adapters(Transformer(args), ft)
    model.to_empty(device="cpu")
    tensors = peft_adapter(adapter_weights(step_url, manifest, model), args, ft)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()},
              str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    targets = sorted(n for t in ft.target_modules for n in HF_TARGETS[t][1])
    LoraConfig(r=ft.rank, lora_alpha=ft.alpha, lora_dropout=ft.dropout, target_modules=targets,
               bias="none", task_type="CAUSAL_LM",
               base_model_name_or_path=manifest["finetune"].get("base")).save_pretrained(out)
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def export_adapted(step_url: str, manifest: dict[str, Any], out_dir: str | Path, *,
                   dtype: str = "float32", tokenizer: str | None = None,
                   log: Callable[[str], None] = print, adapter_only: bool = False) -> list[str]:
    """``export --to-hf`` of a LoRA/QLoRA checkpoint: the merged model as a Llama directory,
    or with ``adapter_only`` the adapter in peft's format. Returns the files written."""
    from trainer.hf import write_hf_dir

    ft = manifest.get("finetune")
    if not ft:
        raise ValueError(f"{step_url}: not a LoRA/QLoRA checkpoint: it has no adapter")
    if adapter_only:
        written = write_peft_adapter(out_dir, step_url, manifest, dtype=dtype)
        log(f"exported the {ft['method']} adapter of step {manifest.get('step')} (peft "
            f"format, base {ft.get('base')}) to {out_dir}: {', '.join(written)}")
        return written
    sd = merged_weights(step_url, manifest)
    tok = tokenizer if tokenizer is not None else manifest.get("tokenizer")
    written = write_hf_dir(out_dir, sd, ModelArgs(**manifest["model"]), dtype=dtype,
                           tokenizer=tok)
    log(f"merged {ft['method']} adapters (rank {ft['rank']}) of step {manifest.get('step')} "
        f"into the base {ft.get('base')}; exported to {out_dir}: {', '.join(written)}")
    return written
