"""LoRA and QLoRA on our Transformer through ``peft``, adapters only in checkpoints.

Why peft (and torchao only for the NF4 base): peft wraps any ``nn.Linear`` by module name,
so the fused ``wqkv`` and ``w13`` projections get one adapter each with no code of ours; its
layers merge themselves into the base (``LoraLayer.merge``) for export and its adapter files
are what every Llama tool loads. torchao has the NF4 tensor (what torchtune's QLoRA uses) but
no LoRA layer of its own: the QLoRA base is a torchao ``NF4Tensor`` inside peft's layer, whose
forward dequantizes it per matmul (``linear_nf4``).

Lifecycle (``trainer.backends.native``):

1. ``add_adapters`` on the meta-device model: peft injects ``lora_A``/``lora_B`` into every
   targeted linear of every block and everything else is frozen.
2. The backend shards / wraps and materialises the model; ``Transformer.init_weights`` draws
   the adapters after the base with peft's own init (A Kaiming-uniform, B zeros, so training
   starts exactly at the base model).
3. ``prepare_base`` loads the frozen base from ``model.init_from_hf`` on every start (fresh or
   resumed: checkpoints do not hold it) and, for QLoRA, quantizes it to NF4. QLoRA under FSDP2
   does 2 and 3 the other way round, as torchtune does: the model is materialised whole, its
   base loaded and quantized, and only then sharded: FSDP2 shards each ``NF4Tensor`` itself
   (dim-0 chunks of codes, scales and scalers) and all-gathers it as NF4 for each forward
   (torchao's ``fsdp_pre_all_gather``/``fsdp_post_all_gather``), so a rank holds a quarter of
   a bf16 base's bytes divided by the world size. The price: each rank reads the whole base
   once at start, in its own dtype, before it is quantized and sharded.
4. ``AdapterOptimState`` is the checkpoint's ``app`` entry: trainable parameters and their
   optimizer state only, through torch's distributed state-dict API (FSDP2 shards included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

if TYPE_CHECKING:
    from trainer.config import FinetuneConfig

ADAPTER = "default"  # peft's adapter name: one adapter per model
# peft puts the wrapped linear under this name: "wqkv.weight" becomes "wqkv.base_layer.weight".
BASE_LAYER = "base_layer."
_ADAPTER_KEYS = ("lora_A.", "lora_B.")


def lora_config(ft: FinetuneConfig) -> Any:
    """peft's ``LoraConfig`` for our module names (no bias adapters, plain LoRA)."""
    from peft import LoraConfig

    return LoraConfig(r=ft.rank, lora_alpha=ft.alpha, lora_dropout=ft.dropout,
                      target_modules=list(ft.target_modules), bias="none",
                      init_lora_weights=True)


def add_adapters(model: nn.Module, ft: FinetuneConfig) -> nn.Module:
    """Inject peft's LoRA layers into ``model`` (in place; meta device is fine) and freeze
    every parameter that is not an adapter's. Returns the model."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(lora_config(ft), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"no module of the model matches target_modules {ft.target_modules}")
    return model


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict name belongs to a LoRA adapter."""
    return any(k in name for k in _ADAPTER_KEYS)


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, layer) of every peft LoRA layer of ``model``."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def base_state_dict(model: nn.Module, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our plain state dict (``read_hf_dir``) renamed to the adapted model's frozen keys:
    the weight of every wrapped linear moves under ``base_layer``."""
    wrapped = {name for name, _ in lora_layers(model)}
    out = {}
    for key, value in hf_sd.items():
        module, _, leaf = key.rpartition(".")
        out[f"{module}.{BASE_LAYER}{leaf}" if module in wrapped else key] = value
    return out


def prepare_base(model: nn.Module, ft: FinetuneConfig, hf_path: str, shards: int = 1) -> None:
    """Load the frozen base from the Hugging Face directory into the adapted model (every
    rank, every start), then quantize it to NF4 for QLoRA (``shards``: the FSDP2 world it is
    sharded over next, see ``quantize_base``). Adapters are left as they are."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from trainer.hf import check_shape, read_hf_dir
    from trainer.parallel import unwrap

    args, sd = read_hf_dir(hf_path)
    inner = unwrap(model)
    mismatch = check_shape(inner.args, args)
    if mismatch:
        raise ValueError(f"{hf_path}: shape differs from the model: {'; '.join(mismatch)}")
    sd = base_state_dict(inner, sd)
    frozen = {k for k, p in inner.named_parameters() if not p.requires_grad}
    missing = sorted(frozen - set(sd))
    if missing:
        raise ValueError(f"{hf_path}: no weights for {', '.join(missing[:4])}")
    # strict=False: the adapters are not in the base (they come from init or a checkpoint).
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True,
                                                             strict=False))
    if ft.method == "qlora":
        quantize_base(inner, ft, shards)


@torch.no_grad()
def quantize_base(model: nn.Module, ft: FinetuneConfig, shards: int = 1) -> int:
    """Replace the base weight of every LoRA layer by its NF4 form (torchao); returns how many.
    Deterministic: the same base gives the same NF4 codes on every rank and every start.

    ``shards``: the FSDP2 world the NF4 weights will be sharded over next (QLoRA + FSDP2 runs
    this before ``fully_shard``, as torchtune does; torchao's ``NF4Tensor`` then shards by
    dim-0 chunks of its codes, scales and scalers, and all-gathers as NF4). Every one of those
    must split evenly: checked first, naming the layer and the fix.
    """
    from torchao.quantization import to_nf4

    from trainer.config import nf4_shard_problem

    layers = lora_layers(model)
    for name, layer in layers:
        weight = layer.get_base_layer().weight
        if hasattr(weight, "to_local"):
            raise ValueError(f"{name}: qlora quantizes the full weight before FSDP2 shards it, "
                             f"this one is sharded already")
        problem = nf4_shard_problem(tuple(weight.shape), ft, shards)
        if problem:
            raise ValueError(f"{name}: {problem}")
    for _, layer in layers:
        base = layer.get_base_layer()
        base.weight = nn.Parameter(to_nf4(base.weight.detach(), ft.nf4_block_size,
                                          ft.nf4_scaler_block_size), requires_grad=False)
    return len(layers)


def dequantized(weight: torch.Tensor, ft: FinetuneConfig) -> torch.Tensor:
    """The NF4 round trip of a full-precision weight: what a QLoRA run's base computes with."""
    from torchao.quantization import to_nf4

    return to_nf4(weight, ft.nf4_block_size, ft.nf4_scaler_block_size).get_original_weight()


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (global numbers, also for DTensors)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def summary(model: nn.Module, ft: FinetuneConfig, base: str) -> str:
    """One log line: what trains, and under QLoRA what the NF4 base looks like on this rank
    (observed on the model's parameters: NF4 or not, sharded how many ways)."""
    from torchao.quantization import NF4Tensor

    from trainer.parallel import unwrap

    trainable, total = trainable_counts(model)
    line = (f"{ft.method}: base from {base}, {trainable:,} of {total:,} parameters train "
            f"(rank {ft.rank})")
    weights = [layer.get_base_layer().weight for _, layer in lora_layers(unwrap(model))]
    local = [w.to_local() if hasattr(w, "to_local") else w for w in weights]
    nf4 = sum(isinstance(t, NF4Tensor) for t in local)
    if nf4:
        ways = sorted({w.device_mesh.size() if hasattr(w, "device_mesh") else 1
                       for w in weights})
        line += (f"; NF4 base: {nf4} of {len(weights)} weights, sharded "
                 f"{'/'.join(map(str, ways))} ways")
    return line


_OPTIONS = StateDictOptions(ignore_frozen_params=True)


class AdapterOptimState(Stateful):
    """The checkpoint's ``app`` entry under LoRA: the adapters and their optimizer state.

    ``ignore_frozen_params`` leaves the base out of the model's state dict; the optimizer only
    ever held the adapters. Loading is strict about the adapters: every adapter the model has
    must be in the checkpoint, and nothing else may be.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        msd = state_dict["model"]
        expected = set(get_state_dict(self.model, self.optimizer, options=_OPTIONS)[0])
        if set(msd) != expected:
            extra, missing = sorted(set(msd) - expected), sorted(expected - set(msd))
            raise ValueError(f"adapter checkpoint does not match the model: missing "
                             f"{missing[:3]}, unexpected {extra[:3]}")
        set_state_dict(self.model, self.optimizer, model_state_dict=msd,
                       optim_state_dict=state_dict["optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))


def finetune_meta(ft: FinetuneConfig, base: str) -> dict[str, Any]:
    """The manifest's ``finetune`` record: enough to rebuild the adapted model for export."""
    return {"method": ft.method, "rank": ft.rank, "alpha": ft.alpha, "dropout": ft.dropout,
            "target_modules": list(ft.target_modules), "nf4_block_size": ft.nf4_block_size,
            "nf4_scaler_block_size": ft.nf4_scaler_block_size, "base": base}
