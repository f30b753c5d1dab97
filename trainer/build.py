"""One builder per component; ``build_parts`` wires them and restores the newest checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from orchestrator.worker import Worker, WorkerContext
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.layout import job_url
from trainer.distributed import DistContext
from trainer.loop import Parts
from trainer.settings import WorkerSettings
from trainer.state import STATE_LAYOUT, GuardState, Progress, checkpoint_state


def build_loader(settings: WorkerSettings, dctx: DistContext, ctx: WorkerContext) -> Any:
    from trainer.data.dataset import ResumableLoader, TokenShards, ensure_dataset

    data = settings.trainer.data
    shards = TokenShards(ensure_dataset(data))
    windows = [tuple(w) for w in data.skip_windows] + list(ctx.skip_windows)
    return ResumableLoader(shards, data.seq_len, data.micro_batch_size, data.grad_accum_steps,
                           dp_rank=dctx.rank, dp_world=dctx.world_size, seed=data.seed,
                           skip_windows=windows)


def build_model(settings: WorkerSettings, dctx: DistContext) -> Any:
    from trainer import model as model_mod
    from trainer.parallel import parallelize
    from trainer.presets import resolve_model_args

    cfg = settings.trainer
    args = resolve_model_args(cfg.model)
    model = model_mod.build_model(args, device="meta")
    return parallelize(model, cfg.parallelism, cfg.precision, dctx, seed=cfg.seed)


def build_parts(settings: WorkerSettings, dctx: DistContext, ctx: WorkerContext,
                worker: Worker, log: Callable[[str], None]) -> Parts:
    from trainer.optim import build_optimizer, build_scheduler

    cfg = settings.trainer
    loader = build_loader(settings, dctx, ctx)
    vocab = loader.shards.tokenizer["vocab_size"]
    from trainer.presets import resolve_model_args

    if vocab > resolve_model_args(cfg.model).vocab_size:
        raise ValueError(f"the dataset's tokenizer has {vocab} ids, more than the model's "
                         f"vocab_size {resolve_model_args(cfg.model).vocab_size}")
    model = build_model(settings, dctx)
    optimizer = build_optimizer(model, cfg.optimizer, dctx.device.type)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.steps, lr_scale=ctx.lr_scale)
    progress = Progress()
    state = checkpoint_state(model, optimizer, scheduler, progress, loader, dctx.rank)
    guard = None
    if "skip_step" in settings.stability.rule_actions().values():
        from stability import SkipStepGuard

        guard = SkipStepGuard(settings.stability)
        state["stability"] = GuardState(guard)
    checkpointer = Checkpointer(
        settings.checkpoint, job_url(settings.checkpoint_root, settings.job), rank=dctx.rank,
        world_size=dctx.world_size, group=dctx.ckpt_group,
        meta={"job": settings.job, "config_hash": settings.config_hash,
              "state_layout": STATE_LAYOUT},
        report=worker.event, log=log, device_type=dctx.device.type)
    with worker.phase("loading"):
        t0 = time.perf_counter()
        manifest = checkpointer.restore(state, max_step=ctx.resume_max_step)
        load_s = time.perf_counter() - t0
    if manifest is not None:
        if manifest.get("config_hash") != settings.config_hash:
            log(f"warning: checkpoint config hash {manifest.get('config_hash')} differs from "
                f"this run's {settings.config_hash}")
        log(f"resumed from step {progress.step} ({manifest.get('tokens')} tokens)")
        if dctx.is_main:
            # load_s: the books' checkpoint_restore time for this generation.
            worker.event("resumed", step=progress.step, path=checkpointer.restored_url,
                         load_s=round(load_s, 6))
    else:
        log("no checkpoint found: starting from scratch")
    chaos = ctx.chaos
    return Parts(cfg, dctx, model, optimizer, scheduler, loader, progress, checkpointer, state,
                 worker, settings.checkpoint.interval_steps, log, guard,
                 set(chaos.get("poison_batches") or []),
                 float(chaos.get("slow_checkpoint_s") or 0.0),
                 float(chaos.get("slow_first_step_s") or 0.0))
