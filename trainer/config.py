"""The trainer's own config sections (pydantic, no torch).

The orchestrator's root config composes these; a worker started on its own (under torchrun)
validates the same sections from the same YAML file, so both sides agree on every field.
Field descriptions feed ``orchestrator validate`` and ``--help``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.presets import PRESETS, resolve_model_args


class FieldError(ValueError):
    """A cross-field validation error that names the offending field.

    ``field`` is a dotted path relative to the model whose validator raised it; the config
    loader joins it to the model's own location so every message names a full dotted path.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Model shape: a named preset, optionally with fields overridden."""

    preset: str = Field("tiny", description=f"Model preset, one of: {', '.join(PRESETS)}.")
    dim: int | None = Field(None, gt=0, description="Hidden size (overrides the preset).")
    n_layers: int | None = Field(None, gt=0, description="Number of transformer blocks.")
    n_heads: int | None = Field(None, gt=0, description="Attention heads.")
    n_kv_heads: int | None = Field(None, gt=0, description="Key/value heads (GQA).")
    ffn_dim: int | None = Field(None, gt=0, description="SwiGLU hidden size.")
    vocab_size: int | None = Field(None, gt=0, description="Vocabulary size of the embedding.")
    max_seq_len: int | None = Field(None, gt=0, description="Longest sequence RoPE covers.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")
    init_std: float | None = Field(None, gt=0, description="Std of the normal weight init.")
    init_from_hf: str | None = Field(
        None, description="Local Hugging Face Llama directory to start from (fine-tuning)."
    )

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if self.preset not in PRESETS:
            raise FieldError("preset", f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        args = resolve_model_args(self)
        if args.dim % args.n_heads:
            raise FieldError("dim", f"dim {args.dim} is not divisible by n_heads {args.n_heads}")
        if args.n_heads % args.n_kv_heads:
            raise FieldError(
                "n_kv_heads",
                f"n_heads {args.n_heads} is not divisible by n_kv_heads {args.n_kv_heads}",
            )
        if (args.dim // args.n_heads) % 2:
            raise FieldError("n_heads", "head dimension (dim / n_heads) must be even for RoPE")
        return self


class DataConfig(_Section):
    """Token shards, the sample order and the batch shape."""

    path: str = Field(
        "~/.cache/orchestrator/datasets/stdlib-byte",
        description="Directory or fsspec URL holding prepared token shards (index.json).",
    )
    prepare_from: Literal["stdlib"] | list[str] | None = Field(
        "stdlib",
        description=(
            "Where `up` builds the shards from when `path` has none: 'stdlib' (the Python "
            "standard library's own source, on every machine), a list of text/jsonl files or "
            "globs, or null to require prepared shards."
        ),
    )
    prepare_max_bytes: int = Field(
        8 * 2**20, gt=0, description="Cap on the bytes of source text read when preparing."
    )
    tokenizer: str = Field(
        "byte", description="'byte' (byte-level, no download) or a path to a HF tokenizer.json."
    )
    seq_len: int = Field(128, gt=1, description="Tokens per sample (packed, no padding).")
    micro_batch_size: int = Field(8, gt=0, description="Samples per rank per micro-batch.")
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    seed: int = Field(1234, description="Seed of the sample order (one permutation per epoch).")
    skip_windows: list[tuple[int, int]] = Field(
        default_factory=list,
        description=(
            "Global batch indices to skip, as [start, end) pairs. Rollbacks append to this; "
            "set it by hand to reproduce a run that skipped the same data."
        ),
    )

    @model_validator(mode="after")
    def _check_windows(self) -> DataConfig:
        for start, end in self.skip_windows:
            if start < 0 or end <= start:
                raise FieldError(
                    "skip_windows", f"skip window [{start}, {end}) must have 0 <= start < end"
                )
        return self


class OptimizerConfig(_Section):
    """AdamW with the seed study's defaults."""

    name: Literal["adamw"] = Field("adamw", description="Optimizer.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas.")
    eps: float = Field(1e-5, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the total gradient norm to this.")
    fused: bool | None = Field(
        None, description="Fused AdamW kernel (default: on for CUDA, off on CPU)."
    )


class ScheduleConfig(_Section):
    """Linear warmup, then cosine decay to a fraction of the peak."""

    warmup_steps: int = Field(20, ge=0, description="Steps of linear warmup from 0 to peak.")
    decay: Literal["cosine", "constant"] = Field("cosine", description="Shape after warmup.")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Final LR as a fraction of the peak (cosine)."
    )


class PrecisionConfig(_Section):
    """Compute and reduction dtypes. Master weights and optimizer state stay fp32."""

    param_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Dtype of the compute (bf16 via FSDP2 mixed precision / autocast)."
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Dtype of gradient reductions."
    )


class ParallelismConfig(_Section):
    """How the model is spread over ranks."""

    strategy: Literal["fsdp2", "ddp", "deepspeed", "neuron", "none"] = Field(
        "fsdp2", description="fsdp2 (fully_shard), ddp, deepspeed (ZeRO), neuron, or none."
    )
    backend: Literal["auto", "gloo", "nccl", "xla"] = Field(
        "auto", description="torch.distributed backend (auto: nccl on CUDA, gloo on CPU)."
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        "none", description="Recompute activations: none, selective (every other block), full."
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    zero_stage: int = Field(1, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    tensor_parallel: int = Field(
        1, ge=1, description="Tensor-parallel degree (neuron strategy: neuronx-distributed TP)."
    )
    reshard_after_forward: bool = Field(
        True, description="FSDP2: free gathered parameters after forward (ZeRO-3 style)."
    )


class TrainerConfig(_Section):
    """The training worker."""

    steps: int = Field(200, gt=0, description="Optimizer steps of the whole run.")
    seed: int = Field(0, description="Seed of weight init and of every RNG.")
    device: Literal["auto", "cpu", "cuda", "xla"] = Field(
        "auto", description="Where ranks compute (auto: cuda when present, else cpu)."
    )
    deterministic: bool = Field(
        True, description="Deterministic algorithms (bit-exact resume on CPU)."
    )
    num_threads: int | None = Field(
        None, gt=0, description="torch intra-op threads per rank (default: cores / local ranks)."
    )
    log_every: int = Field(10, gt=0, description="Log a step line every N steps.")
    param_norm_every: int = Field(
        10, gt=0, description="Compute the parameter norm every N steps (one reduction)."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainerConfig:
        if self.schedule.warmup_steps > self.steps:
            raise FieldError(
                "schedule.warmup_steps",
                f"warmup_steps ({self.schedule.warmup_steps}) exceeds steps ({self.steps})",
            )
        args = resolve_model_args(self.model)
        if self.data.seq_len > args.max_seq_len:
            raise FieldError(
                "data.seq_len",
                f"seq_len ({self.data.seq_len}) exceeds the model's max_seq_len "
                f"({args.max_seq_len})",
            )
        return self


class CheckpointConfig(_Section):
    """Where and how often checkpoints are written (layout in DESIGN: step-<8 digits>/)."""

    url: str | None = Field(
        None,
        description=(
            "Checkpoint root: a path or fsspec URL (s3://bucket/prefix). Default: "
            "<run dir>/checkpoints. Checkpoints go to <url>/<job name>/step-XXXXXXXX/."
        ),
    )
    interval_steps: int = Field(50, gt=0, description="Save every N steps (and the last step).")
    keep_last: int = Field(3, gt=0, description="Committed checkpoints kept (older pruned).")
    async_save: bool = Field(
        True, description="DCP async_save: the step waits only for staging."
    )
    verify_on_load: bool = Field(
        True, description="Verify the manifest's checksums before loading."
    )
