"""Hugging Face Llama format: export a checkpoint, and start training from HF weights.

Our decoder (``trainer.model``) already uses HF's conventions: rotate_half RoPE, the fused
``wqkv`` rows are all query heads then all key heads then all value heads (head-major), and
``w13`` is the gate then the up projection. The mapping is therefore a row split on export
and a concatenation on import, with no permutation of q/k:

=====================================  ======================================================
ours                                   ``LlamaForCausalLM``
=====================================  ======================================================
tok_embeddings.weight                  model.embed_tokens.weight
layers.i.attention_norm.weight         model.layers.i.input_layernorm.weight
layers.i.attention.wqkv.weight         model.layers.i.self_attn.{q,k,v}_proj.weight (rows)
layers.i.attention.wo.weight           model.layers.i.self_attn.o_proj.weight
layers.i.ffn_norm.weight               model.layers.i.post_attention_layernorm.weight
layers.i.feed_forward.w13.weight       model.layers.i.mlp.{gate,up}_proj.weight (rows)
layers.i.feed_forward.w2.weight        model.layers.i.mlp.down_proj.weight
norm.weight                            model.norm.weight
output.weight                          lm_head.weight (embed_tokens when tied)
=====================================  ======================================================

Needs ``safetensors`` (the ``hf`` extra), not ``transformers``. torch is imported only
inside the functions that move tensors, so the config schema can read an HF config.json.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.hf_config import CONFIG, args_from_hf_config, hf_config
from trainer.presets import ModelArgs

if TYPE_CHECKING:
    import torch

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16", "float16")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model")
_SHARD_BYTES = 5 * 2**30  # the Hub's customary shard size


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> ``LlamaForCausalLM`` names (q/k/v and gate/up split by rows)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
           "model.norm.weight": sd["norm.weight"], "lm_head.weight": sd["output.weight"]}
    for i in range(args.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = sd[p + "attention.wqkv.weight"].split([q, kv, kv], dim=0)
        gate, up = sd[p + "feed_forward.w13.weight"].split([args.ffn_dim, args.ffn_dim], dim=0)
        out.update({
            h + "input_layernorm.weight": sd[p + "attention_norm.weight"],
            h + "self_attn.q_proj.weight": wq, h + "self_attn.k_proj.weight": wk,
            h + "self_attn.v_proj.weight": wv,
            h + "self_attn.o_proj.weight": sd[p + "attention.wo.weight"],
            h + "post_attention_layernorm.weight": sd[p + "ffn_norm.weight"],
            h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": sd[p + "feed_forward.w2.weight"]})
    return out


def from_hf(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` names -> our state dict (q/k/v and gate/up concatenated)."""
    import torch

    head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])  # tied: the embedding
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"],
           "norm.weight": hf["model.norm.weight"], "output.weight": head}
    for i in range(args.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out.update({
            p + "attention_norm.weight": hf[h + "input_layernorm.weight"],
            p + "attention.wqkv.weight": torch.cat([hf[h + f"self_attn.{n}_proj.weight"]
                                                    for n in "qkv"], dim=0),
            p + "attention.wo.weight": hf[h + "self_attn.o_proj.weight"],
            p + "ffn_norm.weight": hf[h + "post_attention_layernorm.weight"],
            p + "feed_forward.w13.weight": torch.cat([hf[h + "mlp.gate_proj.weight"],
                                                      hf[h + "mlp.up_proj.weight"]], dim=0),
            p + "feed_forward.w2.weight": hf[h + "mlp.down_proj.weight"]})
    return out


def write_hf_dir(out_dir: str | Path, sd: dict[str, torch.Tensor], args: ModelArgs, *,
                 dtype: str = "float32", tokenizer: str | None = None,
                 max_shard_bytes: int = _SHARD_BYTES) -> list[str]:
    """Write a Llama-format directory from our state dict; returns the files written.

    ``tokenizer`` is a ``tokenizer.json`` path (or "byte" / None: no tokenizer files); files
    of the same tokenizer that sit beside it (tokenizer_config.json, ...) are copied too.
    """
    import torch
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos = _special_ids(tokenizer)
    tensors = {k: v.detach().to(getattr(torch, dtype)).contiguous()
               for k, v in to_hf(sd, args).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    written = [CONFIG]
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS), metadata=meta)
        written.append(WEIGHTS)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=meta)
            weight_map.update({k: name for k in shard})
            written.append(name)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=2))
        written.append(INDEX)
    (out / CONFIG).write_text(json.dumps(hf_config(args, dtype, bos, eos), indent=2))
    if tokenizer and tokenizer != "byte" and Path(tokenizer).expanduser().is_file():
        src = Path(tokenizer).expanduser()
        for name in _TOKENIZER_FILES:
            candidate = src if name == "tokenizer.json" else src.parent / name
            if candidate.is_file():
                shutil.copyfile(candidate, out / name)
                written.append(name)
    return written


def _special_ids(tokenizer: str | None) -> tuple[int | None, int | None]:
    if not tokenizer:
        return None, None
    from trainer.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(tokenizer)
    except (OSError, ValueError):
        return None, None
    return tok.bos_id, tok.eos_id


def read_hf_dir(path: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Shape and our state dict from a local Llama-format directory (one or many shards)."""
    from safetensors.torch import load_file

    root = Path(path).expanduser()
    args = args_from_hf_config(json.loads((root / CONFIG).read_text()))
    if (root / INDEX).is_file():
        files = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
    elif (root / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{root}: neither {WEIGHTS} nor {INDEX}")
    hf: dict[str, torch.Tensor] = {}
    for name in files:
        hf.update(load_file(str(root / name)))
    return args, from_hf(hf, args)


def check_shape(args: ModelArgs, hf_args: ModelArgs) -> list[str]:
    """Fields where our configured shape and the HF directory's disagree (weights only:
    max_seq_len and init_std may differ)."""
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta",
            "norm_eps")
    ours, theirs = asdict(args), asdict(hf_args)
    return [f"{k}: {ours[k]} here, {theirs[k]} in the HF config" for k in keys
            if ours[k] != theirs[k]]


def load_into(model: torch.nn.Module, path: str | Path) -> None:
    """Load a Llama-format directory into our (possibly FSDP2-sharded) model, in place.

    Every rank reads the directory; DCP's state-dict API scatters the full tensors into
    each rank's shards. The model's own shape must match (config validation checks it).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from trainer.parallel import unwrap

    args, sd = read_hf_dir(path)
    mismatch = check_shape(unwrap(model).args, args)
    if mismatch:
        raise ValueError(f"{path}: shape differs from the model: {'; '.join(mismatch)}")
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True,
                                                             strict=True))


def export_checkpoint(step_url: str, manifest: dict[str, Any], out_dir: str | Path, *,
                      dtype: str = "float32", tokenizer: str | None = None,
                      log: Callable[[str], None] = print) -> list[str]:
    """Write a verified checkpoint's model weights as a Llama-format directory.

    The shape comes from the manifest (``model``), the tokenizer from the manifest unless
    given. Reads only the model's tensors (no optimizer state), on the CPU, no process group:
    DCP checkpoints directly, DeepSpeed ones (``writer: deepspeed``) through DeepSpeed's own
    consolidation of the ZeRO partitions. A LoRA / QLoRA checkpoint (``finetune`` in the
    manifest) is exported by ``trainer.hf_adapters.export_adapted`` instead.

    The caller must have verified the checkpoint (``layout.verify`` with the job's trust,
    as ``orchestrator export`` does): DCP's metadata and DeepSpeed's files are pickles.
    """
    import torch

    if "model" not in manifest:
        raise ValueError(f"{step_url}: the manifest records no model shape (written before "
                         "exports were supported)")
    args = ModelArgs(**manifest["model"])
    if manifest.get("finetune"):
        raise ValueError(f"{step_url}: a LoRA/QLoRA checkpoint holds adapters only: export it "
                         "with trainer.hf_adapters.export_adapted")
    if manifest.get("writer", "dcp") == "deepspeed":
        sd = _deepspeed_weights(step_url)
    elif manifest.get("writer", "dcp") == "dcp":
        sd = _dcp_weights(step_url, args, manifest)
    else:
        raise ValueError(f"{step_url}: written by {manifest.get('writer')!r}; export reads "
                         "DCP and DeepSpeed checkpoints")
    tok = tokenizer if tokenizer is not None else manifest.get("tokenizer")
    written = write_hf_dir(out_dir, sd, args, dtype=dtype, tokenizer=tok)
    numel = sum(t.numel() for t in sd.values() if isinstance(t, torch.Tensor))
    log(f"exported step {manifest.get('step')} ({numel:,} parameters, {dtype}) "
        f"to {out_dir}: {', '.join(written)}")
    return written


def _dcp_weights(step_url: str, args: ModelArgs, manifest: dict[str, Any],
                 ) -> dict[str, torch.Tensor]:
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.checkpointer import SafeLoadPlanner
    from trainer.checkpoint.verified_reader import VerifiedReader
    from trainer.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    state = {"app": {"model": model.state_dict()}}
    # Every file read once and checked against the manifest the caller verified; DCP's
    # .metadata unpickled with an allow-list of its own types, byte items weights-only.
    dcp.load(state, storage_reader=VerifiedReader(step_url, manifest), no_dist=True,
             planner=SafeLoadPlanner())
    return state["app"]["model"]


def _model_states(path: str) -> dict[str, Any]:
    """DeepSpeed's model states file, weights-only where torch allows it.

    It holds the module's tensors, our client state (numbers and JSON strings) and
    DeepSpeed's bookkeeping; when that bookkeeping holds an object the weights-only
    unpickler refuses (a DeepSpeed class), the file is read in full. That is safe only
    because the caller verified the manifest's signature and this file's BLAKE3 digest
    before (export_checkpoint's contract): the bytes are the ones our rank 0 committed.
    """
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(path, map_location="cpu", weights_only=False)


# Activation checkpointing wraps blocks; DCP's state-dict API drops this from names, a
# DeepSpeed module's own state_dict() keeps it.
_AC_PREFIX = "_checkpoint_wrapped_module."


def _deepspeed_weights(step_url: str) -> dict[str, torch.Tensor]:
    """The fp32 weights of a DeepSpeed step directory: ZeRO 1-3 consolidated from the
    optimizer's partitions (``get_fp32_state_dict_from_zero_checkpoint``), stage 0 from the
    model states file."""
    import os

    from trainer.checkpoint import layout

    if layout.is_remote(step_url):
        raise ValueError(f"{step_url}: DeepSpeed checkpoints export from a local directory "
                         "(a remote copy is fetched into the local tier by a restart)")
    path = layout.filesystem(step_url)[1].rstrip("/")
    if any(name.endswith("_optim_states.pt") for name in os.listdir(path)):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # DeepSpeed's own reader (torch.load with weights_only=False inside): its files hold
        # DeepSpeed's objects, which the weights-only unpickler refuses. Safe because the
        # caller verified the manifest's signature and every file's BLAKE3 digest first
        # (export_checkpoint's contract): these are the bytes our rank 0 committed.
        root, tag = os.path.split(path)
        sd = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    else:
        sd = _model_states(os.path.join(path, "mp_rank_00_model_states.pt"))["module"]
    return {k.replace(_AC_PREFIX, ""): v.float() for k, v in sd.items()}
