"""The trainer's own config sections (pydantic, no torch).

The orchestrator's root config composes these; a worker started on its own (under torchrun)
validates the same sections from the same YAML file, so both sides agree on every field.
Field descriptions feed ``orchestrator validate`` and ``--help``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from orchestrator.contracts.rundir import is_remote
from trainer.config_base import FieldError, _Section
from trainer.config_finetune import LORA_TARGETS, FinetuneConfig, nf4_shard_problem
from trainer.presets import PRESETS, resolve_model_args

__all__ = [
    "LORA_TARGETS",
    "FieldError",
    "FinetuneConfig",
    "_Section",
    "nf4_shard_problem",
]  # re-exported: importers of trainer.config find them here


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
        None,
        description=(
            "Local Hugging Face Llama directory (config.json + safetensors) to start from when "
            "the job has no checkpoint yet (fine-tuning). The model's shape is taken from its "
            "config.json; a shape field set here must agree with it."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _shape_from_hf(cls, data: Any) -> Any:
        """Fill the shape from the HF directory's config.json (read where the config is
        validated: the directory must be on shared storage or on every machine)."""
        if not isinstance(data, dict) or not data.get("init_from_hf"):
            return data
        from trainer.hf_config import CONFIG, args_from_hf_config

        # A relative path is taken from where the config is validated (the checkout, for
        # the examples in configs/) and kept absolute, so ranks find it from any directory.
        root = Path(str(data["init_from_hf"])).expanduser().absolute()
        path = root / CONFIG
        try:
            hf_args = args_from_hf_config(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FieldError("init_from_hf", f"cannot use {path}: {exc}") from None
        out = dict(data)
        out["init_from_hf"] = str(root)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                     "rope_theta", "norm_eps", "max_seq_len"):
            theirs = getattr(hf_args, name)
            if out.get(name) is None:
                out[name] = theirs
            elif name != "max_seq_len" and out[name] != theirs:
                raise FieldError(name, f"{out[name]} differs from {theirs} in {path}")
        return out

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
    """Token shards (or Arrow tables tokenized online), the sample order and the batch shape."""

    format: Literal["shards", "arrow"] = Field(
        "shards",
        description=(
            "shards: prepared token shards (index.json). arrow: Arrow IPC files, or a Hugging "
            "Face `datasets` directory saved with save_to_disk, memory-mapped and tokenized and "
            "packed online with data.tokenizer (trainer.data.arrow)."
        ),
    )
    path: str = Field(
        "~/.cache/orchestrator/datasets/stdlib-byte",
        description=(
            "Directory or fsspec URL holding prepared token shards (index.json); with format "
            "arrow, an .arrow file, a directory of them, or a save_to_disk directory (local or "
            "s3://)."
        ),
    )
    text_column: str = Field(
        "text", min_length=1, description="format arrow: the string column to tokenize."
    )
    prepare_from: Literal["stdlib"] | list[str] | None = Field(
        "stdlib",
        description=(
            "Where `up` builds the shards from when `path` has none: 'stdlib' (the Python "
            "standard library's own source, on every machine), a list of text/jsonl files or "
            "globs, or null to require prepared shards."
        ),
    )
    prepare_max_bytes: int | None = Field(
        None, gt=0, description="Cap on the bytes of source text read when preparing "
        "(default: 8 MiB of the stdlib, every byte of a list of files)."
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
        if self.format == "arrow" and "prepare_from" in self.model_fields_set and \
                self.prepare_from is not None:
            raise FieldError("prepare_from", "format arrow reads the Arrow files as they are: "
                                             "leave prepare_from unset or null")
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
    fp8: bool = Field(
        False,
        description=(
            "FP8 matmuls in the transformer blocks' linear layers (torchao float8, dynamic "
            "tensorwise scaling; FSDP2 all-gathers the weights in float8). Needs CUDA compute "
            "capability 8.9+ (H100/H200/L40S) and param_dtype bf16; refused elsewhere."
        ),
    )


class ParallelismConfig(_Section):
    """How the model is spread over ranks."""

    strategy: Literal["fsdp2", "ddp", "deepspeed", "neuron", "none"] = Field(
        "fsdp2", description="fsdp2 (fully_shard), ddp, deepspeed (ZeRO), neuron, or none."
    )
    backend: Literal["auto", "gloo", "nccl", "xla", "neuron"] = Field(
        "auto", description="torch.distributed backend (auto: nccl on CUDA, gloo on CPU, xla "
                            "with device xla, neuron with device neuron)."
    )
    activation_checkpointing: Literal["none", "selective", "full"] = Field(
        "none", description="Recompute activations: none, selective (every other block), full."
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    standby_compile: bool = Field(
        True, description="With compile and warm standbys (restart.standby): each standby "
        "compiles the step ahead on a two-block copy of the model (a few GB of GPU memory "
        "for a few seconds), so the rank it becomes compiles nothing at its first step.")
    standby_nccl: bool = Field(
        True, description="With NCCL and warm standbys (restart.standby): each standby "
        "sets NCCL up ahead on a one-rank communicator it then shuts down (NCCL's "
        "once-per-process set-up: its network and topology probes), so the rank it becomes "
        "pays only for its own communicator.")
    overlap_abort: bool = Field(
        True, description="A rank recovering in place (restart.in_job) makes the next "
        "generation's process groups while its old NCCL communicator's abort finishes in "
        "the background (NCCL's abort takes about 0.5 s); false: it waits for the abort "
        "first.")
    zero_stage: int = Field(
        1, ge=0, le=3, description="ZeRO stage: deepspeed 0-3; neuron 0 or 1 (NxD ZeRO-1)."
    )
    tensor_parallel: int = Field(
        1, ge=1, description="Tensor-parallel degree (neuron strategy: neuronx-distributed TP)."
    )
    reshard_after_forward: bool = Field(
        True, description="FSDP2: free gathered parameters after forward (ZeRO-3 style)."
    )
    offload: Literal["none", "optimizer", "params"] = Field(
        "none",
        description=(
            "CPU offload. fsdp2: params (CPUOffloadPolicy: parameters, gradients and the "
            "optimizer step live on the CPU). deepspeed: optimizer (ZeRO-Offload: optimizer "
            "state and step on the CPU, stages 1-3) or params (also the parameters, stage 3)."
        ),
    )


def check_finetune(cfg: TrainerConfig) -> None:
    """Fields LoRA/QLoRA cannot honour (raises ``FieldError``)."""
    ft = cfg.finetune
    if ft is None:
        return
    if cfg.parallelism.strategy not in ("fsdp2", "ddp", "none"):
        raise FieldError("finetune", f"adapters train with strategy fsdp2, ddp or none, not "
                                     f"{cfg.parallelism.strategy!r}")
    if not cfg.model.init_from_hf:
        raise FieldError("finetune", "fine-tuning needs a base: set model.init_from_hf (the "
                                     "checkpoints hold the adapters only)")
    if cfg.precision.fp8:
        raise FieldError("precision.fp8", "fp8 and LoRA/QLoRA adapters do not combine here: "
                                          "peft's layers wrap plain linears")
    if ft.method != "qlora":
        return
    args = resolve_model_args(cfg.model)
    q = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    shapes = {"wqkv": (q, args.dim), "wo": (args.dim, args.n_heads * args.head_dim),
              "w13": (2 * args.ffn_dim, args.dim), "w2": (args.dim, args.ffn_dim)}
    for name in ft.target_modules:
        # The FSDP2 world size is known at start only: the trainer checks the shards then.
        problem = nf4_shard_problem(shapes[name], ft, 1)
        if problem:
            raise FieldError("finetune.nf4_scaler_block_size", f"{name}: {problem}")


def check_memory(cfg: TrainerConfig) -> None:
    """Offload and FP8 against the strategy and the device (raises ``FieldError``)."""
    par, prec = cfg.parallelism, cfg.precision
    if par.offload != "none":
        if par.strategy == "fsdp2" and par.offload != "params":
            raise FieldError("parallelism.offload", "FSDP2 offloads parameters, gradients and "
                                                    "the optimizer step together: use params")
        if par.strategy == "deepspeed" and par.offload == "params" and par.zero_stage != 3:
            raise FieldError("parallelism.offload", "DeepSpeed offloads parameters at ZeRO "
                                                    "stage 3 only (set zero_stage: 3)")
        if par.strategy == "deepspeed" and par.zero_stage == 0:
            raise FieldError("parallelism.offload", "ZeRO-Offload needs zero_stage 1-3")
        if par.strategy not in ("fsdp2", "deepspeed"):
            raise FieldError("parallelism.offload", f"offload is implemented for fsdp2 and "
                                                    f"deepspeed, not {par.strategy!r}")
    if prec.fp8:
        if cfg.device in ("cpu", "xla", "neuron"):
            raise FieldError("precision.fp8", f"FP8 training needs an H100/H200-class CUDA "
                                              f"GPU; trainer.device is {cfg.device}")
        if par.strategy not in ("fsdp2", "ddp", "none"):
            raise FieldError("precision.fp8", f"fp8 is implemented for fsdp2, ddp and none, "
                                              f"not {par.strategy!r}")
        if prec.param_dtype != "bf16":
            raise FieldError("precision.fp8", "fp8 runs the rest of the model in bf16: set "
                                              "precision.param_dtype: bf16")


# Strategies whose optimizer step computes the gradient norm and applies the update in one
# call, so a skip_step verdict (which needs the norm) cannot come between the two.
NO_SKIP_STEP = {
    "deepspeed": "DeepSpeed computes the gradient norm inside engine.step(), the call that "
                 "also applies the update, and has no supported API to decide in between",
    "neuron": "neuronx-distributed's optimizer computes the gradient norm inside "
              "optimizer.step(), which also applies the update",
}


# The two Trainium paths: which SDK each needs, for the errors that name the other one.
NXD_PATH = ("the NxD backend (trainer.device: xla, parallelism.strategy: neuron) is "
            "neuronx-distributed on torch-xla, for Neuron SDK 2.31 or earlier")
NATIVE_PATH = ("TorchNeuron (trainer.device: neuron with parallelism.strategy fsdp2, ddp or "
               "none) is the native neuron device, Neuron SDK 2.33 or later on trn2/trn3")


def check_device(cfg: TrainerConfig) -> None:
    """The device against the strategy and the process-group backend (raises ``FieldError``):
    the NxD path and the TorchNeuron path each refuse the other's settings with a hint."""
    par = cfg.parallelism
    if cfg.device == "neuron":
        if par.strategy == "neuron":
            raise FieldError("parallelism.strategy",
                             f"strategy neuron with trainer.device neuron mixes the two "
                             f"Trainium paths: {NXD_PATH}; {NATIVE_PATH}. To migrate, use "
                             f"strategy fsdp2 (it shards parameters, gradients and optimizer "
                             f"state: set tensor_parallel 1, zero_stage is not used)")
        if par.strategy == "deepspeed":
            raise FieldError("parallelism.strategy", f"DeepSpeed does not run on the neuron "
                                                     f"device: {NATIVE_PATH}")
        if par.backend not in ("auto", "neuron"):
            raise FieldError("parallelism.backend", f"trainer.device neuron uses TorchNeuron's "
                                                    f"neuron process-group backend (auto), "
                                                    f"not {par.backend}")
    elif par.backend == "neuron":
        raise FieldError("parallelism.backend", f"the neuron process-group backend drives "
                                                f"TorchNeuron's device: {NATIVE_PATH}")
    if cfg.device == "xla" and par.strategy != "neuron":
        raise FieldError("device", f"trainer.device xla serves strategy neuron only: "
                                   f"{NXD_PATH}. AWS ended the torch-xla training flow with "
                                   f"Neuron 2.32; for strategy {par.strategy} on Trainium, "
                                   f"{NATIVE_PATH}: set trainer.device: neuron")


def check_strategy(cfg: TrainerConfig) -> None:
    """Fields the chosen parallelism strategy cannot honour (raises ``FieldError``)."""
    check_device(cfg)
    par = cfg.parallelism
    if par.tensor_parallel > 1 and par.strategy != "neuron":
        raise FieldError("parallelism.tensor_parallel",
                         f"tensor parallelism is implemented for strategy neuron only, not "
                         f"{par.strategy!r}")
    if par.strategy != "neuron":
        return
    if cfg.device != "xla":
        raise FieldError("device", f"strategy neuron runs on NeuronCores through torch-xla: "
                                   f"set trainer.device: xla ({NXD_PATH})")
    if par.backend not in ("auto", "xla"):
        raise FieldError("parallelism.backend", "strategy neuron uses the xla backend")
    if par.zero_stage > 1:
        raise FieldError("parallelism.zero_stage",
                         "neuronx-distributed shards optimizer state (ZeRO-1) only: use 0 or 1")
    if par.compile:
        raise FieldError("parallelism.compile", "Neuron compiles XLA graphs itself "
                                                "(neuronx-cc): leave compile false")
    if par.activation_checkpointing == "selective":
        raise FieldError("parallelism.activation_checkpointing",
                         "strategy neuron checkpoints whole blocks: use none or full")
    args = resolve_model_args(cfg.model)
    tp = par.tensor_parallel
    for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(args, name) % tp:
            raise FieldError("parallelism.tensor_parallel",
                             f"{tp} does not divide the model's {name} ({getattr(args, name)})")


def check_sections(trainer: TrainerConfig, checkpoint: CheckpointConfig,
                   rule_actions: dict[str, str]) -> None:
    """Cross-section rules of the strategy; field names are relative to the root config.

    ``rule_actions`` is ``StabilityConfig.rule_actions()`` (enabled rule -> action).
    """
    strategy = trainer.parallelism.strategy
    if strategy in NO_SKIP_STEP:
        for rule, action in sorted(rule_actions.items()):
            if action == "skip_step":
                raise FieldError(f"stability.{rule}.action",
                                 f"skip_step cannot be honoured with trainer.parallelism."
                                 f"strategy {strategy}: {NO_SKIP_STEP[strategy]}; use "
                                 "record, rollback or lower_lr")
    if strategy == "deepspeed" and checkpoint.local_url is None and is_remote(checkpoint.url):
        raise FieldError("checkpoint.url",
                         "DeepSpeed writes checkpoints into a directory (torch.save): with an "
                         "object store url, set checkpoint.local_url (saves commit there and "
                         "upload in the background)")


class TrainerConfig(_Section):
    """The training worker."""

    steps: int = Field(200, gt=0, description="Optimizer steps of the whole run.")
    seed: int = Field(0, description="Seed of weight init and of every RNG.")
    device: Literal["auto", "cpu", "cuda", "xla", "neuron"] = Field(
        "auto", description=(
            "Where ranks compute (auto: cuda when present, else cpu). neuron: Trainium's "
            "native PyTorch device (TorchNeuron, Neuron SDK 2.33+, trn2/trn3) with strategy "
            "fsdp2, ddp or none. xla: Trainium through torch-xla, for strategy neuron (NxD, "
            "Neuron SDK 2.31 or earlier)."),
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
    finetune: FinetuneConfig | None = Field(
        None, description="LoRA/QLoRA fine-tuning (null: full-parameter training).")

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainerConfig:
        check_strategy(self)
        check_finetune(self)
        check_memory(self)
        if self.data.format == "arrow" and self.parallelism.strategy not in ("fsdp2", "ddp",
                                                                             "none"):
            raise FieldError("data.format", f"arrow sources are read by strategies fsdp2, ddp "
                                            f"and none, not {self.parallelism.strategy!r}")
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
    """Where and how often checkpoints are written, how many are kept, and the S3 tier.

    One tier: ``url`` (a path, a shared filesystem or ``s3://``). Two tiers: ``local_url``
    (NVMe or FSx, shared by the ranks) takes every save and commits it first; a background
    thread then uploads it to ``url`` (``s3://``), manifest last. A restart loads the newest
    checkpoint committed in either tier that verifies. S3 credentials come from the standard
    AWS chain (environment, profile, instance role), never from this file.

    Every manifest is signed (HMAC-SHA256) with the job's key, which never comes from this
    file either: ``ORCH_CHECKPOINT_KEY`` or ``ORCH_CHECKPOINT_KEY_FILE`` in the environment,
    else a key generated into the run directory (``trainer.checkpoint.signing``).
    """

    url: str | None = Field(
        None,
        description=(
            "Checkpoint root: a path or fsspec URL (s3://bucket/prefix); with local_url, the "
            "remote tier. Default: <run dir>/checkpoints. Checkpoints go to "
            "<url>/<job name>/step-XXXXXXXX/."
        ),
    )
    local_url: str | None = Field(
        None,
        description=(
            "Local tier (a path every rank sees: local NVMe on one node, FSx, NFS). Saves "
            "commit here first and upload to url in the background. Null: one tier."
        ),
    )
    mode: Literal["private", "group", "world"] = Field(
        "private", description="Who may read the checkpoint files a rank writes: private "
        "(directories 0700, files 0600, as the whole run directory), group (0750 / 0640: "
        "a shared filesystem read by the group) or world (0755 / 0644).")
    interval_steps: int = Field(50, gt=0, description="Save every N steps (and the last step).")

    keep_last: int = Field(
        3, gt=0, description="Committed checkpoints kept in the tier saves land in (local_url "
                             "when set, else url); older ones are pruned."
    )
    keep_last_remote: int | None = Field(
        None, gt=0, description="Committed checkpoints kept in the remote tier (needs "
                                "local_url; default: keep_last)."
    )
    keep_every: int | None = Field(
        None, gt=0, description="Also keep every checkpoint whose step is a multiple of N, "
                                "forever (in url: the remote tier when tiering)."
    )
    endpoint_url: str | None = Field(
        None, description="S3 endpoint for S3-compatible stores (MinIO, ...); AWS needs none. "
                          "Ranks get it as AWS_ENDPOINT_URL_S3, so it applies to all their S3 "
                          "access (checkpoints and data)."
    )
    upload_attempts: int = Field(
        8, ge=1, description="Tries per S3 request of an upload (throttling, 5xx, timeouts)."
    )
    upload_backoff_s: float = Field(
        1.0, gt=0, description="First wait between upload tries (doubles, with jitter)."
    )
    upload_backoff_max_s: float = Field(30.0, gt=0, description="Longest wait between tries.")
    final_upload_timeout_s: float = Field(
        600.0, gt=0, description="At the end of the job, wait this long for uploads to finish "
                                 "(in the checkpointing phase: keep it below "
                                 "timeouts.checkpointing)."
    )
    max_save_failures: int = Field(
        3, ge=1, description="Consecutive failed saves (disk full, ...) before the worker "
                             "exits with an error and the restart policy takes over."
    )
    async_save: bool = Field(
        True, description="Asynchronous saves: the step waits only for staging (DCP, NxD). "
                          "DeepSpeed's saves are always synchronous."
    )
    stage_ahead: bool = Field(
        True, description="Allocate the async save's staging buffers ahead and keep them, so no "
                          "save blocks for it: pinned, after each generation's first step (with "
                          "the memory tier on: plain memory, in the first save's thread). Costs "
                          "one host copy of the rank's state. False: allocated by the first "
                          "save (CUDA, the memory tier) or by every save (CPU).")
    write_threads: int = Field(
        4, ge=1, le=64,
        description="Threads each rank writes its DCP files with (one file per thread); "
                    "fast NVMe needs several to reach its bandwidth.")
    verify_on_load: bool = Field(
        True, description="Verify the manifest's signature and every digest before loading. "
        "Always on: a restore that skipped them could unpickle a forged file (false is refused).")
    trust_unsigned: bool = Field(
        False, description="Also restore unsigned checkpoints (written before checkpoints were "
        "signed, or imported) when their files verify. Signed ones must match the job's key.")

    memory_interval_steps: int | None = Field(
        None, gt=0,
        description="Memory tier: every N steps each rank also copies its state into its "
                    "node's shared memory (and its partner node's), from which a restart "
                    "restores at copy speed. Null: the memory tier is off. Needs the node "
                    "agent (orchestrator up); may be shorter than interval_steps. A step the "
                    "durable tier saves at hands its copy to the next step.")
    memory_max_bytes: int = Field(
        8 * 2**30, gt=0,
        description="Shared memory one node's memory tier may use in all (its ranks' two "
                    "slots each, and as many for the partner copies it holds); a state "
                    "that does not fit is not kept in memory (reported).")
    memory_root: str = Field(
        "/dev/shm", description="Where the agent makes the memory tier's files: a tmpfs, "
        "best mounted huge=within_size (2 MiB pages; the agent warns on 4 KiB ones).")
    memory_partner: bool = Field(
        True, description="Also keep each rank's copy on the next node (one lost node loses "
                          "no state; doubles the memory used). Needs two nodes or more.")
    memory_copier: bool = Field(
        False, description="On a GPU, the rank's warm standby makes its memory-tier copies by "
        "CUDA IPC: the rank page-locks no slot, its death holds the driver less. Experimental.")

    @model_validator(mode="after")
    def _check_tiers(self) -> CheckpointConfig:
        for name in ("url", "local_url", "endpoint_url"):
            value = getattr(self, name)
            if value and re.match(r"^[a-z0-9+.-]+://[^/]*@", value):
                raise FieldError(name, "credentials never go in the config: use the AWS "
                                       "environment, profile or instance role")
        if self.local_url is not None:
            if is_remote(self.local_url):
                raise FieldError("local_url", f"{self.local_url!r} is not a local path")
            if self.url is None:
                raise FieldError("url", "local_url needs url, the remote tier to upload to")
            if self.url.rstrip("/") == self.local_url.rstrip("/"):
                raise FieldError("local_url", "the local and remote tiers are the same place")
        elif "keep_last_remote" in self.model_fields_set and self.keep_last_remote is not None:
            raise FieldError("keep_last_remote", "only used with local_url (two tiers)")
        if not self.verify_on_load:
            raise FieldError("verify_on_load", "a restore always verifies the signature and "
                                               "every digest before it loads anything")
        if self.endpoint_url is not None:
            if not re.match(r"^https?://[^/\s]+", self.endpoint_url):
                raise FieldError("endpoint_url", "must be an http:// or https:// URL")
        if self.upload_backoff_max_s < self.upload_backoff_s:
            raise FieldError("upload_backoff_max_s", "is below upload_backoff_s")
        return self

    @property
    def umask(self) -> int:
        """The process umask that gives the checkpoint files ``mode``."""
        return {"private": 0o077, "group": 0o027, "world": 0o022}[self.mode]
