"""One builder per component; ``build_parts`` wires them and restores the newest checkpoint.

What differs between strategies (the model, the optimizer, the step, the checkpoint format)
comes from the strategy's backend (``trainer.backends``); the wiring here is the same for all.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from orchestrator.contracts import chaos
from orchestrator.contracts import env as ec
from orchestrator.worker import Worker, WorkerContext
from trainer import restore
from trainer.backends import Backend, backend_for
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.fence import Fence
from trainer.checkpoint.retry import retrying
from trainer.checkpoint.store import open_store
from trainer.checkpoint.upload import Uploader
from trainer.distributed import DistContext, new_memory_group
from trainer.loop import Parts
from trainer.settings import WorkerSettings
from trainer.state import GuardState, Progress


def build_loader(settings: WorkerSettings, dctx: DistContext, ctx: WorkerContext,
                 backend: Backend) -> Any:
    """The resumable loader, sharded over the data-parallel ranks (tensor-parallel peers
    read the same samples)."""
    from trainer.data.dataset import ResumableLoader, TokenShards, ensure_dataset

    data = settings.trainer.data
    windows = [tuple(w) for w in data.skip_windows] + list(ctx.skip_windows)
    dp_rank, dp_world = backend.data_parallel(dctx)
    if data.format == "arrow":
        from trainer.data.arrow import ArrowLoader, ArrowTexts
        from trainer.tokenizer import load_tokenizer

        return ArrowLoader(ArrowTexts(data.path, data.text_column),
                           load_tokenizer(data.tokenizer), data.seq_len, data.micro_batch_size,
                           data.grad_accum_steps, dp_rank=dp_rank, dp_world=dp_world,
                           seed=data.seed, skip_windows=windows)
    shards = TokenShards(ensure_dataset(data))
    return ResumableLoader(shards, data.seq_len, data.micro_batch_size, data.grad_accum_steps,
                           dp_rank=dp_rank, dp_world=dp_world, seed=data.seed,
                           skip_windows=windows)


def apply_endpoint(settings: WorkerSettings) -> None:
    """Point every S3 client of this process at ``checkpoint.endpoint_url`` (botocore reads
    AWS_ENDPOINT_URL_S3), unless the environment already names one. Done before anything
    opens S3: data shards, checkpoints and DCP's fsspec reader all go through botocore."""
    if settings.checkpoint.endpoint_url:
        os.environ.setdefault("AWS_ENDPOINT_URL_S3", settings.checkpoint.endpoint_url)


def build_checkpointer(settings: WorkerSettings, dctx: DistContext, worker: Worker,
                       log: Callable[[str], None], backend: Backend) -> Checkpointer:
    """The store (one or two tiers), rank 0's uploader when tiering, and the backend's
    checkpointer."""
    from trainer.presets import resolve_model_args

    cfg = settings.checkpoint
    retry = retrying(cfg.upload_attempts, cfg.upload_backoff_s, cfg.upload_backoff_max_s)
    ctx = worker.ctx  # its generation fences checkpoints (``trainer.checkpoint.fence``)
    store = open_store(cfg, settings.job, settings.checkpoint_root, retry,
                       fence=Fence(ctx.generation, tuple(ctx.lineage), ctx.run_id))
    uploader = None
    if store.remote is not None and dctx.rank == 0:
        uploader = Uploader(store.primary, store.remote,
                            keep_last=cfg.keep_last_remote or cfg.keep_last,
                            keep_every=cfg.keep_every, attempts=cfg.upload_attempts,
                            backoff_s=cfg.upload_backoff_s,
                            backoff_max_s=cfg.upload_backoff_max_s, report=worker.event, log=log)
    data = settings.trainer.data
    # The model's shape and the tokenizer make a checkpoint exportable on its own.
    meta = {"job": settings.job, "config_hash": settings.config_hash,
            "model": asdict(resolve_model_args(settings.trainer.model)),
            "tokenizer": data.tokenizer, "dataset": data.path, **backend.checkpoint_meta()}
    return backend.checkpointer_class(cfg, store, rank=dctx.rank, world_size=dctx.world_size,
                        group=dctx.ckpt_group, meta=meta, report=worker.event, log=log,
                        device_type=dctx.device.type, uploader=uploader)


def digest_ahead(settings: WorkerSettings, ctx: WorkerContext) -> Any:
    """Start digesting this rank's newest memory copy (``memory_slots.DigestAhead``) when
    the tier is on: called before the process groups are set up, which it overlaps."""
    if settings.checkpoint.memory_interval_steps is None or not ctx.memory_dir:
        return None
    from pathlib import Path

    from trainer.checkpoint.memory_slots import DigestAhead

    return DigestAhead(Path(ctx.memory_dir), ctx.rank, ctx.resume_max_step)


def persistent_buffers(model: Any) -> list[str]:
    """The names in ``model``'s state dict that are not parameters (persistent buffers)."""
    params = {name for name, _ in model.named_parameters()}
    return [k for k in model.state_dict() if k not in params]


def build_memory_tier(settings: WorkerSettings, dctx: DistContext, ctx: WorkerContext,
                      checkpointer: Checkpointer, backend: Backend,
                      log: Callable[[str], None], ahead: Any = None) -> Any:
    """The memory tier (``trainer.checkpoint.memory``) when the config turns it on and the
    agent made this node's slots; None otherwise (said once in the log)."""
    cfg = settings.checkpoint
    if cfg.memory_interval_steps is None:
        return None
    why = None
    if not ctx.memory_dir:
        why = "no node agent keeps the memory (run under orchestrator up)"
    elif backend.checkpointer_class is not Checkpointer:
        why = f"the {settings.trainer.parallelism.strategy} backend saves its own format"
    if why is not None:
        if dctx.is_main:
            log(f"memory tier off: {why}")
        return None
    from pathlib import Path

    from trainer.checkpoint.memory import MemoryTier

    return MemoryTier(Path(ctx.memory_dir), rank=dctx.rank, world_size=dctx.world_size,
                      procs_per_node=ec.get_int(os.environ, "LOCAL_WORLD_SIZE", 1,
                                                minimum=1) or 1,
                      job=settings.job, config_hash=settings.config_hash,
                      generation=ctx.generation, partner=cfg.memory_partner,
                      group=new_memory_group(dctx), trust=lambda: checkpointer.store.trust,
                      log=log, device_type=dctx.device.type, ahead=ahead, overlap=True,
                      copier=cfg.memory_copier)


def build_parts(settings: WorkerSettings, dctx: DistContext, ctx: WorkerContext,
                worker: Worker, log: Callable[[str], None],
                marks: dict[str, float] | None = None, ahead: Any = None) -> Parts:
    """Every part of the run, with the newest checkpoint (or the HF weights) loaded.

    The checkpoint is chosen before the model is built: with none, Hugging Face weights go
    into the model before the optimizer and the backend's wrapping exist (DeepSpeed's ZeRO
    optimizer copies the weights it is given into its own partitions at initialisation).
    """
    from trainer.optim import build_scheduler
    from trainer.presets import resolve_model_args

    cfg = settings.trainer
    # Wall-clock marks of each part's end (the startup event: where a restart's seconds go).
    mark = (lambda name: marks.__setitem__(name, time.time())) if marks is not None \
        else (lambda name: None)
    apply_endpoint(settings)
    backend = backend_for(cfg.parallelism.strategy)
    backend.setup(settings, dctx)
    loader = build_loader(settings, dctx, ctx, backend)
    vocab = loader.vocab_size if hasattr(loader, "vocab_size") else \
        loader.shards.tokenizer["vocab_size"]
    if vocab > resolve_model_args(cfg.model).vocab_size:
        raise ValueError(f"the dataset's tokenizer has {vocab} ids, more than the model's "
                         f"vocab_size {resolve_model_args(cfg.model).vocab_size}")
    mark("built_loader")
    checkpointer = build_checkpointer(settings, dctx, worker, log, backend)
    memory = build_memory_tier(settings, dctx, ctx, checkpointer, backend, log, ahead)
    if memory is not None:
        checkpointer.stage_from_memory()
    mark("built_checkpointer")
    with worker.phase("loading"):
        found = restore.choose(memory, checkpointer, dctx, ctx.resume_max_step, log)
    choice = found.choice
    if marks is not None:
        marks.update(found.at)
    mark("chose_checkpoint")
    # Fine-tuning: the backend loads the frozen base (model.init_from_hf) while it builds.
    with worker.phase("loading") if cfg.finetune is not None else contextlib.nullcontext():
        model = backend.build_model(settings, dctx)
    mark("built_model")
    if cfg.finetune is not None:
        from trainer.finetune import summary

        log(summary(model, cfg.finetune, str(cfg.model.init_from_hf)))
    elif choice is None and cfg.model.init_from_hf:
        with worker.phase("loading"):
            backend.load_pretrained(model, cfg.model.init_from_hf)
        log(f"no checkpoint found: starting from the Hugging Face weights in "
            f"{cfg.model.init_from_hf}")
    elif choice is None:
        log("no checkpoint found: starting from scratch")
    if memory is not None and memory.overlap and persistent_buffers(model):
        # A buffer the forward may change in place (batch-norm statistics, DDP's buffer
        # broadcast): only an optimizer step may change what the copies read beside it.
        memory.overlap = False
        log(f"memory tier: the model has persistent buffers ({persistent_buffers(model)[:3]}"
            "): its copies land before the next step")
    optimizer = backend.build_optimizer(model, settings, dctx)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.steps, lr_scale=ctx.lr_scale)
    stepper = backend.build_stepper(model, optimizer, scheduler, settings, dctx)
    progress = Progress()
    state = backend.checkpoint_state(stepper, scheduler, progress, loader, dctx.rank)
    mark("built_optimizer")
    guard = None
    if "skip_step" in settings.stability.rule_actions().values():
        from stability import SkipStepGuard

        guard = SkipStepGuard(settings.stability)
        state["stability"] = GuardState(guard)
    with worker.phase("loading"):
        manifest = restore.load(found, memory, checkpointer, state, dctx, ctx.resume_max_step,
                                progress, settings.config_hash)
    if marks is not None:
        marks.update(found.at)  # and the load's own parts
    mark("loaded_state")
    # The memory tier's slots are prepared after the first step (the loop), not here:
    # page-locking them beside the first compiled step slowed it from 2.9-3.3 s to 5.5-5.8 s
    # on an H200, and the first memory save comes memory_interval_steps later.
    restore.announce(found, manifest, checkpointer, dctx, worker, log, progress,
                     settings.config_hash)
    # Fault injection wraps the parts the loop drives (the state above keeps the real ones).
    chaos_plan = ctx.chaos
    parts = Parts(cfg, dctx, chaos.wrap_stepper(stepper, chaos_plan, dctx.rank), scheduler,
                  chaos.wrap_loader(loader, chaos_plan), progress,
                  chaos.wrap_checkpointer(checkpointer, chaos_plan, dctx.rank), state,
                  worker, settings.checkpoint.interval_steps, log, guard)
    parts.memory = memory
    parts.memory_interval = settings.checkpoint.memory_interval_steps or 0
    parts.replacement = ec.is_replacement(os.environ)
    parts.rejoin = build_rejoin(settings, dctx, ctx, worker, backend, checkpointer, stepper,
                                log, memory)
    if cfg.parallelism.compile and ctx.managed and dctx.local_rank == 0:
        from trainer.standby import compile_cache_path

        parts.compile_cache = compile_cache_path(os.environ)
    return parts


def build_rejoin(settings: WorkerSettings, dctx: DistContext, ctx: WorkerContext,
                 worker: Worker, backend: Backend, checkpointer: Checkpointer, stepper: Any,
                 log: Callable[[str], None], memory: Any = None) -> Any:
    """In-job recovery (``trainer.rejoin``) when the supervisor turned it on for this
    generation and the strategy can rejoin in place; None otherwise (said once)."""
    if ctx.in_job_wait_s is None or not ctx.managed or not dctx.distributed:
        return None
    why = backend.rejoin_unsupported(settings)
    if why is not None:
        if dctx.is_main:
            log(f"in-job recovery off: {why}; a failure restarts every rank")
        return None
    from trainer.rejoin import Rejoin

    rejoin = Rejoin(settings, backend, checkpointer, stepper, ctx.in_job_wait_s, log,
                    memory=memory)
    rejoin.enable(worker)
    return rejoin
