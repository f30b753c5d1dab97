"""The training loop. It receives built parts; it builds nothing itself.

``train_step`` owns what every backend shares: the batch (and its loss scale), the
learning rate, the skip-step verdict's inputs, progress and the step record. The backend's
``Stepper`` (``trainer.backends``) owns forward, backward, the gradient norm and the update.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from trainer.backends.base import Decide, Stepper
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import TrainerConfig
from trainer.distributed import DistContext
from trainer.state import tensors_digest
from trainer.steptime import OptimizerTimer


@dataclass
class Parts:
    cfg: TrainerConfig
    dctx: DistContext
    stepper: Stepper
    scheduler: Any
    loader: Any
    progress: Any  # trainer.state.Progress
    checkpointer: Checkpointer
    checkpoint_state: dict[str, Any]
    worker: Any  # orchestrator.worker.Worker (or a stand-in with the same methods)
    checkpoint_interval: int
    log: Callable[[str], None]
    skip_guard: Any = None  # stability.SkipStepGuard when a rule asks for skip_step
    startup: dict[str, float | None] | None = None  # wall times of start-up milestones
    optimizer_timer: OptimizerTimer | None = None  # the breakdown's optimizer share
    memory: Any = None  # trainer.checkpoint.memory.MemoryTier when the memory tier is on
    memory_interval: int = 0
    rejoin: Any = None  # trainer.rejoin.Rejoin when a failed peer is recovered in place
    # Where this node keeps the job's compile artifacts (compiled runs; local rank 0 writes
    # them once, after a few steps) for later ranks and warm standbys to load.
    compile_cache: Any = None
    steps_run: int = 0  # steps this process has trained (its compiled graphs are warm)
    replacement: bool = False  # this rank replaced a failed one in an in-job recovery
    peers_preparing: bool = False  # some rank still prepares its saves' buffers
    watching_peers: bool = False  # the worker SDK counts this rank's steps as disturbed

    @property
    def model(self) -> nn.Module:
        return self.stepper.model


def train_step(p: Parts) -> dict[str, Any]:
    """One optimizer step over one global batch; returns the step record's figures."""
    t0 = time.perf_counter()
    batch = p.loader.next_batch()
    data_s = time.perf_counter() - t0
    scale = batch.loss_scale
    next_step = p.progress.step + 1
    lr = p.scheduler.get_last_lr()[0]  # the LR this step's update uses
    decide: Decide | None = None
    if p.skip_guard is not None and p.skip_guard.active:
        guard = p.skip_guard

        def decide(loss: float, grad_norm: float) -> bool:
            return guard.should_skip(next_step, loss, grad_norm)

    t1 = time.perf_counter()
    out = p.stepper.step(batch.micro_batches, scale, decide)
    compute_s = time.perf_counter() - t1
    optim_s = p.optimizer_timer.take() if p.optimizer_timer is not None else None
    p.progress.step = next_step
    # Ranks that share a batch (tensor-parallel peers) count its tokens once.
    p.progress.tokens += batch.tokens * p.loader.dp_world
    record: dict[str, Any] = {"loss": out.loss, "grad_norm": out.grad_norm, "lr": lr,
                              "tokens": p.progress.tokens, "batch": batch.index,
                              "data_s": round(data_s, 6),
                              "fwd_bwd_s": round(compute_s - (optim_s or 0.0), 6)}
    if optim_s is not None:
        record["optim_s"] = round(optim_s, 6)
    if out.skipped:
        record["skipped"] = True
    if next_step % p.cfg.param_norm_every == 0:
        record["param_norm"] = p.stepper.param_norm()
    record["step_time"] = time.perf_counter() - t0
    return record


@dataclass(frozen=True)
class Agreement:
    """What every rank decides alike after a step: whether to stop (an operator's stop
    reaches the ranks a few milliseconds apart), and the newest step every rank has
    committed to the memory tier (None: not one yet), which no memory save may overwrite."""

    stop: bool
    memory_common: int | None
    # Some rank is still preparing its saves' buffers (page-locking in the background, which
    # slows its steps, and so everyone's: the collectives wait for it).
    preparing: bool = False


def _preparing(p: Parts) -> bool:
    return p.checkpointer.preparing() or (p.memory is not None and p.memory.preparing())


def _agree(p: Parts) -> Agreement:
    """One MAX all-reduce of three integers over the loop's own gloo group, a CPU collective
    that never waits on the accelerator: the stop flag, minus each rank's newest committed
    memory step (the MAX of the negatives is the minimum), and whether it is preparing."""
    asked = bool(getattr(p.worker, "checkpoint_requested", False))
    newest = p.memory.last_step if p.memory is not None else None
    preparing = _preparing(p)
    group = getattr(p.dctx, "control_group", None)
    if group is None:
        return Agreement(asked, newest, preparing)
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if asked else 0, -(newest if newest is not None else -1),
                         1 if preparing else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    common = -int(flag[1].item())
    return Agreement(bool(flag[0].item()), common if common >= 0 else None,
                     bool(flag[2].item()))


def train(p: Parts) -> None:
    """Steps until ``cfg.steps``; checkpoints every interval and always at the last step."""
    p.optimizer_timer = p.optimizer_timer or OptimizerTimer().install()
    try:
        _train(p)
    finally:
        p.optimizer_timer.remove()


def _train(p: Parts) -> None:
    first = True
    while p.progress.step < p.cfg.steps:
        try:
            stop = _one_step(p, first)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is recovered in place
            if p.rejoin is None or not p.rejoin.recover(p, exc):
                raise
            continue
        first = False
        if stop:
            break
    _finish(p)


def memory_copy_due(step: int, memory_interval: int, durable: bool,
                    last_step: int) -> str | None:
    """How ``step`` copies its state into the memory tier: ``"commit"`` every
    ``memory_interval`` steps and at every step that saves durably (that save takes its
    tensors from this copy: one device-to-host copy for both tiers), ``"source"`` at the
    last step (the durable save's source only: no recovery rolls back to it, a resume reads
    that durable save), else None. A function of the step and of the ranks' agreed stop
    alone, so a survivor and its replacement copy at the same steps (the partner copies are
    collectives)."""
    if step >= last_step:
        return "source" if durable else None
    if durable or (memory_interval > 0 and step % memory_interval == 0):
        return "commit"
    return None


def _one_step(p: Parts, first: bool) -> bool:
    """Train one step, save when due, report it; True when the ranks agreed to stop."""
    cfg = p.cfg
    rec = train_step(p)
    if first and p.startup is not None and (p.dctx.is_main or p.replacement):
        # Where a (re)start's seconds went: process start, imports, process group,
        # build + restore, first step (the recovery benchmark reads this).
        p.worker.event("startup", first_step_done=time.time(), **p.startup,
                       **first_compile_seconds())
    if first:  # the optimizer's state exists now: the saves' staging can be allocated
        p.checkpointer.prepare_staging(p.checkpoint_state)
        if p.memory is not None:
            # And the memory tier's slots faulted in and page-locked, in the background,
            # now: page-locking gigabytes holds the CUDA driver for seconds, and at the
            # first memory save (a fresh run's step 50) it stalled a step past a
            # calibrated 3.7 s timeout.
            p.memory.prepare_saves(p.checkpoint_state)
    p.steps_run += 1
    if p.compile_cache is not None and p.steps_run == _COMPILE_CACHE_AFTER:
        _keep_compile_cache(p)
    step = p.progress.step
    agreed = _agree(p)
    p.peers_preparing = agreed.preparing
    if agreed.preparing and not p.watching_peers:
        # Page-locking holds the CUDA driver: steps run slow until it is done, on every rank
        # (an in-job replacement's slow steps hold up the survivors' collectives too). The
        # SDK keeps them out of the calibrated training timeout and reports the ``loading``
        # phase meanwhile, until the ranks agree that none is preparing any more.
        p.watching_peers = True

        def busy() -> bool:
            p.watching_peers = p.peers_preparing
            return p.peers_preparing

        p.worker.disturbed_while(busy)
    stop = agreed.stop
    durable = step % p.checkpoint_interval == 0 or step == cfg.steps or stop
    copy = memory_copy_due(step, p.memory_interval, durable, cfg.steps) \
        if p.memory is not None else None
    if copy is not None:
        with p.worker.phase("checkpointing"):
            rec["mem_block_s"] = p.memory.save(step, p.progress.tokens, p.checkpoint_state,
                                               keep=agreed.memory_common,
                                               commit=copy == "commit")
    if durable:
        with p.worker.phase("checkpointing"):
            source = p.memory.copy_of(step) if p.memory is not None else None
            blocked = p.checkpointer.save_from(step, p.progress.tokens, source) \
                if source is not None else None
            rec["ckpt_block_s"] = blocked if blocked is not None else p.checkpointer.save(
                step, p.checkpoint_state, p.progress.tokens)
    if copy is not None:  # the books count both as the save's blocking time
        rec["ckpt_block_s"] = rec.get("ckpt_block_s", 0.0) + rec["mem_block_s"]
    p.checkpointer.poll()
    if p.memory is not None and p.dctx.is_main and p.memory.report_due():  # what it holds
        p.worker.event("memory_tier", **p.memory.report())
    if p.memory is not None and agreed.memory_common is not None:
        # The newest step every rank can restore from memory: the supervisor's measure of
        # progress between failures when recoveries roll back to the memory tier.
        rec["memory_step"] = agreed.memory_common
    p.worker.step_done(step, **rec)
    if p.dctx.is_main and (step % cfg.log_every == 0 or step == cfg.steps or step == 1):
        loss = rec["loss"]
        p.log(f"step {step}/{cfg.steps} loss {loss:.4f} grad_norm {rec['grad_norm']:.3f} "
              f"lr {rec['lr']:.2e} tokens {rec['tokens']} "
              f"step_time {rec['step_time'] * 1000:.0f} ms"
              + (" (update skipped)" if rec.get("skipped") else "")
              + ("" if math.isfinite(loss) else " NON-FINITE LOSS"))
    if stop and p.dctx.is_main:
        p.log(f"stopping after step {step}: the operator's stop asked for a checkpoint")
    return stop


# How many of the compiler's timed phases a start-up event carries (the longest).
_COMPILE_PHASES = 16


def first_compile_seconds() -> dict[str, float]:
    """Where a (re)started rank's first compiled step went: the compiler's own timed phases
    (TorchDynamo's ``compilation_time_metrics``: tracing, AOTAutograd, Inductor, cache
    loads), summed per phase, the longest ``_COMPILE_PHASES`` as ``compile_phase_<name>``
    seconds. Empty when nothing was compiled (TorchDynamo not imported)."""
    from trainer.standby import PREPARED, compile_totals

    # What this process's warm standby compiled ahead is not the rank's first step's.
    ahead = PREPARED.get("compile_totals") or {}
    totals = {k: v - ahead.get(k, 0.0) for k, v in compile_totals().items()}
    longest = sorted(totals.items(), key=lambda kv: -kv[1])[:_COMPILE_PHASES]
    return {"compile_phase_" + re.sub(r"[^a-z0-9]+", "_", k.lower()).strip("_")[:64]: round(v, 4)
            for k, v in longest if v >= 0.0001}


# Steps after which every graph of the step is compiled (the first step compiles forward and
# backward; the optimizer's, where compiled, the next): the cache is written then.
_COMPILE_CACHE_AFTER = 3


def _keep_compile_cache(p: Parts) -> None:
    """Write the compile artifacts once per job and node (a restarted rank finds them)."""
    if p.compile_cache.exists():
        return
    from trainer.standby import save_compile_cache

    t0 = time.perf_counter()
    try:
        size = save_compile_cache(p.compile_cache)
    except (OSError, RuntimeError) as exc:  # an optimisation: never a reason to stop
        p.log(f"compile cache not written: {type(exc).__name__}: {exc}")
        return
    if size:
        p.log(f"compile cache: {size / 2**20:.1f} MiB written to {p.compile_cache} in "
              f"{time.perf_counter() - t0:.2f} s")


def _finish(p: Parts) -> None:
    # Past the last step nothing returns to ``training``: the calibrated training timeout is
    # a few step intervals, and what follows has no steps. The last save and its upload
    # (and the memory tier's last commit) wait in ``checkpointing``; the digest, closing and
    # the process-group teardown (which waits for every peer, rank 0 still committing
    # included) run in ``finishing``.
    p.worker.set_phase("checkpointing")
    p.checkpointer.finish()
    if p.memory is not None:
        p.memory.wait()
    p.worker.set_phase("finishing")
    # Every rank reports its parameters' checksum: replicas (DDP) that disagree have drifted.
    digest = tensors_digest(p.stepper.local_tensors())
    p.log(f"final parameters: crc32 {digest['crc32']} over {digest['numel']} local values")
    p.worker.event("params_digest", step=p.progress.step, **digest)
