"""Restoring a rank's state: which copy every rank loads, loading it, and saying so.

Two callers run the same collectives in the same order: a starting rank (``trainer.build``,
with its model built between :func:`choose` and :func:`load`) and a survivor rejoining the
next generation in place (``trainer.rejoin``: its model exists). A replacement rank and the
survivors of an in-job recovery therefore meet in each collective: the durable tier's newest
step broadcast on the checkpoint group, the memory tier's plan on its own group, the agreement
that every rank loaded its copy on the control group, or DCP's load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.distributed import DistContext


@dataclass
class Restore:
    """What every rank restores: the memory tier's plan (None: tier off), the durable
    checkpoint (None: none, or memory wins), and the seconds choosing and loading took."""

    plan: Any
    choice: Any
    seconds: float = 0.0
    tier_note: dict[str, Any] | None = None

    @property
    def at(self) -> dict[str, float]:
        """Wall-clock ends of the memory plan's parts (empty: no plan)."""
        return dict(getattr(self.plan, "at", None) or {})

    @property
    def from_memory(self) -> bool:
        return self.plan is not None and self.plan.use

    @property
    def empty(self) -> bool:
        """Nothing to restore: a fresh start."""
        return not self.from_memory and self.choice is None


def plan_memory_restore(memory: Any, checkpointer: Checkpointer, dctx: DistContext,
                        max_step: int | None, log: Callable[[str], None]) -> Any:
    """Collective: the memory tier's restore plan against the durable tier's newest
    committed step (rank 0 lists it; no durable file is read when memory wins)."""
    import torch.distributed as dist

    newest: list[Any] = [None]
    if dctx.rank == 0:
        newest = [checkpointer.store.newest_committed(max_step, log)]
    if dctx.ckpt_group is not None:
        dist.broadcast_object_list(newest, src=0, group=dctx.ckpt_group)
    shared = time.time()
    plan = memory.plan(newest[0], max_step)
    plan.durable_step = newest[0]
    plan.at = {"durable_shared": shared, **plan.at}
    return plan


def load_from_memory(memory: Any, plan: Any, state: dict[str, Any], dctx: DistContext,
                     ) -> str | None:
    """Collective: load the planned copy on every rank; None when all did, else why not
    (then the caller loads the durable tier, which overwrites every part of the state)."""
    import torch.distributed as dist

    problem = None
    try:
        memory.load(plan, state)
    except (ValueError, RuntimeError) as exc:  # a layout that does not fit this model
        problem = f"rank {dctx.rank}: {exc}"[:500]
    if dctx.control_group is None:
        return problem
    problems: list[Any] = [None] * dctx.world_size
    dist.all_gather_object(problems, problem, group=dctx.control_group)
    bad = [p for p in problems if p]
    return "; ".join(bad[:4]) if bad else None


def choose(memory: Any, checkpointer: Checkpointer, dctx: DistContext, max_step: int | None,
           log: Callable[[str], None]) -> Restore:
    """Collective: the copy every rank will load (memory first, else the durable tier)."""
    t0 = time.perf_counter()
    plan = None if memory is None else \
        plan_memory_restore(memory, checkpointer, dctx, max_step, log)
    choice = None if plan is not None and plan.use else checkpointer.choose(max_step=max_step)
    return Restore(plan, choice, time.perf_counter() - t0)


def load(r: Restore, memory: Any, checkpointer: Checkpointer, state: dict[str, Any],
         dctx: DistContext, max_step: int | None, progress: Any,
         config_hash: str | None) -> dict[str, Any] | None:
    """Collective: load ``r``'s copy into ``state``; the durable tier when the memory copy
    fails to load on any rank. Returns the manifest (None: nothing was loaded)."""
    t0 = time.perf_counter()
    if r.from_memory:
        failed = load_from_memory(memory, r.plan, state, dctx)
        if failed is None:
            manifest: dict[str, Any] | None = {"step": r.plan.step, "tokens": progress.tokens,
                                               "config_hash": config_hash}
        else:
            r.plan.use, r.plan.reason = False, f"loading the memory copy failed: {failed}"
            r.choice = checkpointer.choose(max_step=max_step)
            manifest = checkpointer.load(state, r.choice)
    else:
        manifest = checkpointer.load(state, r.choice)
    if not r.from_memory:  # a copy that verified but did not load was passed over
        r.choice = checkpointer.restored or r.choice
    r.seconds += time.perf_counter() - t0
    if memory is not None:
        memory.invalidate_after(progress.step)  # newer copies: an abandoned future
        r.tier_note = tier_note(r.plan, r.choice, r.seconds)
    return manifest


def announce(r: Restore, manifest: dict[str, Any] | None, checkpointer: Checkpointer,
             dctx: DistContext, worker: Any, log: Callable[[str], None], progress: Any,
             config_hash: str | None) -> None:
    """Say what was restored: the log, and on rank 0 the ``restore_tier`` and ``resumed``
    events (``load_s``: the books' checkpoint_restore time for this generation)."""
    note = r.tier_note
    if note is not None:
        if dctx.is_main:
            worker.event("restore_tier", **note)
        log(f"restore: {note['tier']} tier ({note['reason']})")
    if manifest is None:
        return
    if manifest.get("config_hash") != config_hash:
        log(f"warning: checkpoint config hash {manifest.get('config_hash')} differs from "
            f"this run's {config_hash}")
    log(f"resumed from step {progress.step} ({manifest.get('tokens')} tokens)")
    if dctx.is_main:
        restored = checkpointer.restored
        from_memory = note is not None and note["tier"].startswith("memory")
        worker.event("resumed", step=progress.step,
                     path=None if from_memory else checkpointer.restored_url,
                     load_s=round(r.seconds, 6),
                     tier=note["tier"] if from_memory else
                     restored.tier if restored else None,
                     fetched_from=restored.fetched_from if restored and not from_memory
                     else None)


def tier_note(plan: Any, choice: Any, load_s: float) -> dict[str, Any]:
    """The ``restore_tier`` event: which tier this generation restored from, and why."""
    if plan is not None and plan.use:
        tier = "memory_partner" if plan.partner_ranks else "memory"
        return {"tier": tier, "step": plan.step, "reason": plan.reason,
                "durable_step": plan.durable_step, "partner_ranks": list(plan.partner_ranks),
                "load_s": round(load_s, 6), "verify_s": round(plan.verify_s, 6)}
    reason = plan.reason if plan is not None else "memory tier off"
    return {"tier": "durable" if choice is not None else "none",
            "step": choice.step if choice is not None else 0,
            "reason": reason, "durable_step": choice.step if choice is not None else None,
            "partner_ranks": [], "load_s": round(load_s, 6)}
