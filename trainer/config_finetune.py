"""The ``trainer.finetune`` section (LoRA/QLoRA) and the rules it must meet."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from trainer.config_base import FieldError, _Section

LORA_TARGETS = ("wqkv", "wo", "w13", "w2")


class FinetuneConfig(_Section):
    """LoRA or QLoRA adapters (peft) on a frozen base loaded from ``model.init_from_hf``.

    Only the adapters train, and only they (with their optimizer state, the schedule, the
    data position and the RNGs) go into checkpoints: a resume loads the base again from
    ``model.init_from_hf``. QLoRA keeps the frozen base in NF4 (torchao's ``NF4Tensor``).
    """

    method: Literal["lora", "qlora"] = Field(
        ..., description="lora: adapters on the base in its own dtype; qlora: on an NF4 base."
    )
    rank: int = Field(8, gt=0, le=4096, description="Rank r of each adapter (A: r x in).")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: the update is "
                                                 "(alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[Literal["wqkv", "wo", "w13", "w2"]] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="Linear layers of each block that get adapters (fused wqkv and w13 "
                    "included): any of wqkv, wo, w13, w2.")
    nf4_block_size: int = Field(64, gt=0, description="qlora: values per NF4 scale block.")
    nf4_scaler_block_size: int = Field(
        256, gt=0, description="qlora: scale blocks per double-quantised scaler block.")

    @model_validator(mode="after")
    def _check_targets(self) -> FinetuneConfig:
        if len(set(self.target_modules)) != len(self.target_modules):
            raise FieldError("target_modules", "names a module twice")
        return self


def nf4_shard_problem(shape: tuple[int, ...], ft: FinetuneConfig, shards: int) -> str | None:
    """Why a weight of ``shape`` cannot be an NF4 tensor sharded ``shards`` ways (None: it can).

    torchao splits the NF4 codes, the per-block scales and the double-quantised scalers into
    ``shards`` equal dim-0 chunks (no padding), so the rows and the number of scaler blocks
    (values / (nf4_block_size x nf4_scaler_block_size)) must both divide by ``shards``.
    """
    rows, values = shape[0], math.prod(shape)
    block = ft.nf4_block_size * ft.nf4_scaler_block_size
    if values % block:
        return (f"{values} values are not a multiple of nf4_block_size x "
                f"nf4_scaler_block_size ({block})")
    if shards > 1 and (rows % shards or (values // block) % shards):
        return (f"{rows} rows and {values // block} NF4 scaler blocks do not both split into "
                f"{shards} FSDP2 shards: lower finetune.nf4_scaler_block_size (or the world "
                f"size)")
    return None
