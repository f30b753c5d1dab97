"""In-job recovery for a user's own training script, through the worker SDK.

A script that registers its state here gets what our trainer gets when a peer rank dies or
hangs: this rank's process stays alive, rolls back to the newest step every rank holds in
the node's memory tier, and trains on beside the replacement, with its imports, device
context and compiled graphs kept. A script that does not gets today's full restart.

    import orchestrator.worker as ow

    dist.init_process_group("nccl")
    ddp = DDP(net)                                 # the script's own process groups...
    state = ow.recoverable(model=net, optimizer=opt, loader=sampler,
                           regroup=lambda: rewrap())  # ...made again after a recovery
    step = state.restore()                         # 0, or the step every rank holds
    while step < steps:
        try:
            train_one_step(step)
            step += 1
            state.step_done(step, loss=loss.item())  # reports, saves every N steps
        except Exception as exc:
            step = state.recover(exc)              # re-raises what is not a peer's failure

What is kept: the model and optimizer (``torch.distributed.checkpoint``'s state-dict helpers,
so FSDP2 and DDP-wrapped models alike), the step, every RNG state of the rank (Python, numpy,
torch, CUDA), the loader's ``state_dict()`` when one is given, and any ``extra`` stateful
objects. Every ``checkpoint.memory_interval_steps`` steps each rank copies them into its
node's memory tier (``trainer.checkpoint.memory``: the agent's shared memory, signed, digested,
partnered to the next node); a recovery never overwrites the newest step every rank has
committed. Non-tensor values travel through ``torch.load(weights_only=True)``: plain numbers,
strings, lists and dicts.

The collectives meet in the same order on a survivor and on the replacement: the survivor
(``recover``) makes the default process group from the agent's order, runs ``regroup`` (the
script's own groups: a DDP wrapper, a device mesh), then this module's two gloo groups, then
the restore's plan and agreement; a starting rank (the replacement, or every rank after a
full restart) has made the default group and its own groups before it builds this object,
which makes the same two groups, and calls :meth:`restore`.

With ``restart.in_job`` off the state still goes to the memory tier and :meth:`restore`
reads it (a full restart resumes from memory); only :meth:`recover` re-raises. Outside the
orchestrator (plain torchrun), or with the memory tier off, :meth:`restore` returns 0,
:meth:`step_done` only reports, and :meth:`recover` re-raises: the script runs unchanged,
with whatever resume it does on its own.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from orchestrator.worker.sdk import Worker

# The parts this module names itself; ``extra`` may not take them.
_OWN_PARTS = ("app", "progress", "data")
_PART_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
_MAX_EXTRA = 64
# How long the memory tier's commit in flight gets to end after the abort.
_DRAIN_S = 10.0


def _log(message: str) -> None:
    print(f"[orchestrator.worker.recoverable] {message}", file=sys.stderr, flush=True)


def _stateful(name: str, obj: Any) -> Any:
    if not (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"recoverable: {name} must have state_dict() and load_state_dict(), "
                        f"not {type(obj).__name__}")
    return obj


class Recoverable:
    """One rank's state in the memory tier and its in-job recovery (see the module)."""

    def __init__(self, worker: Worker, *, model: Any, optimizer: Any, loader: Any = None,
                 extra: Mapping[str, Any] | None = None,
                 regroup: Callable[[], None] | None = None,
                 log: Callable[[str], None] = _log, trust: Any = None) -> None:
        from trainer.state import ModelOptimState, Progress, RngState, rng_key

        self.worker = worker
        self.log = log
        self.regroup = regroup
        self._trust = trust  # a signing.Trust; by default the job's (the agent signs)
        ctx = worker.ctx
        self.progress = Progress()
        self.parts: dict[str, Any] = {"app": ModelOptimState(model, optimizer),
                                      "progress": self.progress,
                                      rng_key(ctx.rank): RngState()}
        if loader is not None:
            self.parts["data"] = _stateful("loader", loader)
        extra = dict(extra or {})
        if len(extra) > _MAX_EXTRA:
            raise ValueError(f"recoverable: at most {_MAX_EXTRA} extra parts, not {len(extra)}")
        for name, obj in extra.items():
            if not isinstance(name, str) or not _PART_NAME.match(name) \
                    or name in _OWN_PARTS or name.startswith("rng_rank"):
                raise ValueError(f"recoverable: {str(name)[:80]!r} is not a name for an extra "
                                 f"part (letters, digits, _; not {', '.join(_OWN_PARTS)} or "
                                 "rng_rank*)")
            self.parts[name] = _stateful(f"extra[{name!r}]", obj)
        self.memory: Any = None
        self.control: Any = None  # this module's gloo group for its own agreements
        self.interval = 0
        self.wait_s = ctx.in_job_wait_s or 0.0
        self._prepared = False
        self.off_reason = self._why_off()  # why the memory tier is not used (None: it is)
        self.in_job_off = self.off_reason or (
            "restart.in_job is off" if ctx.in_job_wait_s is None else None)
        if self.off_reason is None:
            self._start_tier()
        if self.in_job_off is None:
            worker.injob.enable(self._abort)
            worker.beat_now()  # the supervisor learns at once that this rank can rejoin
        elif self.off_reason is None:
            log(f"in-job recovery off ({self.in_job_off}): a failure restarts every rank, "
                "which resumes from the memory tier")
        else:
            log(f"in-job recovery and the memory tier off: {self.off_reason}")

    # -- set-up ----------------------------------------------------------------------------
    def _why_off(self) -> str | None:
        import torch.distributed as dist

        ctx = self.worker.ctx
        if not ctx.managed:
            return "not running under the orchestrator"
        if not ctx.memory_dir:
            return "the memory tier is off (checkpoint.memory_interval_steps)"
        if not dist.is_initialized():
            return "the script made no default process group before this object"
        return None

    def _start_tier(self) -> None:
        import torch.distributed as dist

        from trainer.checkpoint.memory import MemoryTier
        from trainer.checkpoint.store import default_trust
        from trainer.config import CheckpointConfig

        ctx = self.worker.ctx
        cfg = CheckpointConfig.model_validate(ctx.job_config().get("checkpoint") or {})
        self.interval = int(cfg.memory_interval_steps or 0)
        self.backend = dist.get_backend()
        trust = default_trust(cfg, ctx.checkpoint_root or ctx.run_dir or ".")
        held: list[Any] = [] if self._trust is None else [self._trust]

        def job_trust() -> Any:
            if not held:
                held.append(trust())
            return held[0]

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or ctx.world_size
        device = "cuda" if self.backend == "nccl" else "cpu"
        self.control, group = self._groups()
        self.memory = MemoryTier(Path(ctx.memory_dir or ""), rank=ctx.rank,
                                 world_size=ctx.world_size, procs_per_node=per_node,
                                 job=ctx.job, config_hash=None, generation=ctx.generation,
                                 partner=cfg.memory_partner, group=group, trust=job_trust,
                                 log=self.log, device_type=device)

    @staticmethod
    def _groups() -> tuple[Any, Any]:
        """This module's two gloo groups, made in the same order by every rank: one for
        its agreements (the training thread), one for the memory tier's partner copies
        (its commit thread); two threads never share a group."""
        import torch.distributed as dist

        from trainer.distributed import collective_timeout_s

        timeout = datetime.timedelta(seconds=collective_timeout_s())
        return (dist.new_group(backend="gloo", timeout=timeout),
                dist.new_group(backend="gloo", timeout=timeout))

    @staticmethod
    def _abort() -> None:
        from trainer.pgabort import abort_groups

        abort_groups()

    @property
    def enabled(self) -> bool:
        return self.memory is not None

    # -- restoring -------------------------------------------------------------------------
    def restore(self) -> int:
        """Collective: load the newest step every rank holds in the memory tier into the
        registered state; that step (0: nothing held, the script starts or resumes on its
        own)."""
        if self.memory is None:
            return 0
        step, _tier = self._restore()
        return step

    def _restore(self) -> tuple[int, str]:
        import torch.distributed as dist

        t0 = time.perf_counter()
        ctx = self.worker.ctx
        plan = self.memory.plan(None, ctx.resume_max_step)
        if not plan.use:
            self.log(f"restore: nothing in the memory tier ({plan.reason})")
            self._announce(plan, 0.0, loaded=False)
            return 0, "none"
        problem = None
        try:
            self.memory.load(plan, self.parts)
        except (ValueError, RuntimeError) as exc:
            problem = f"rank {ctx.rank}: {exc}"[:500]
        problems: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(problems, problem, group=self.control)
        bad = [p for p in problems if p]
        if bad:
            raise RestoreFailed("the memory copy did not load on every rank: "
                                + "; ".join(bad[:4]))
        self.memory.invalidate_after(self.progress.step)
        self._announce(plan, time.perf_counter() - t0, loaded=True)
        tier = "memory_partner" if plan.partner_ranks else "memory"
        self.log(f"restored step {self.progress.step} from the {tier} tier")
        return self.progress.step, tier

    def _announce(self, plan: Any, seconds: float, *, loaded: bool) -> None:
        """Rank 0's ``restore_tier`` and ``resumed`` events, as our trainer's."""
        if self.worker.ctx.rank != 0:
            return
        from trainer.restore import tier_note

        note = tier_note(plan, None, seconds)
        self.worker.event("restore_tier", **note)
        if loaded:
            self.worker.event("resumed", step=self.progress.step, path=None,
                              load_s=round(seconds, 6), tier=note["tier"], fetched_from=None)

    # -- training --------------------------------------------------------------------------
    def step_done(self, step: int, **metrics: Any) -> None:
        """Step ``step`` is done: report it (``Worker.step_done``) and, every
        ``checkpoint.memory_interval_steps`` steps, copy the state into the memory tier
        (training waits for the copy only). Collective (one small all-reduce) when the
        tier is on."""
        self.progress.step = int(step)
        tokens = metrics.get("tokens")
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
            self.progress.tokens += tokens
        if self.memory is None:
            self.worker.step_done(step, **metrics)
            return
        common = self._common_step()
        if common is not None:
            metrics.setdefault("memory_step", common)
        self.worker.step_done(step, **metrics)
        if not self._prepared:
            self._prepared = True
            self.memory.prepare_saves(self.parts)
        if self.interval and step % self.interval == 0:
            self.memory.save(step, self.progress.tokens, self.parts, keep=common)

    def _common_step(self) -> int | None:
        """The newest step every rank has committed to the memory tier (MAX of the
        negatives), which no save may overwrite."""
        import torch
        import torch.distributed as dist

        newest = self.memory.last_step
        flag = torch.tensor([-(newest if newest is not None else -1)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        common = -int(flag[0].item())
        return common if common >= 0 else None

    # -- recovering ------------------------------------------------------------------------
    def recover(self, exc: BaseException) -> int:
        """After ``exc`` from a training step: when it is a peer's failure (or the agent's
        recover order came), rejoin the next generation in place and return the step every
        rank restored; the script continues from there. Re-raises ``exc`` otherwise, and
        raises :class:`RecoveryFailed` (the rank exits, the job restarts in full) when the
        recovery cannot be done."""
        from trainer.pgabort import epoch
        from trainer.rejoin import peer_failure, report_recovered, survivor_detail

        injob = self.worker.injob
        if self.in_job_off is not None or not injob.enabled or not (
                injob.pending() is not None or peer_failure(exc)):
            raise exc
        worker = self.worker
        t0 = time.perf_counter()
        groups_epoch = epoch()
        abandoned = self.progress.step
        from_generation = worker.ctx.generation
        self.log(f"collective failed after step {abandoned} ({type(exc).__name__}: "
                 f"{str(exc)[:200]}); waiting for the in-job recovery order")
        worker.set_phase("loading")  # until the new generation's first step
        try:
            order = injob.wait(self.wait_s)
            if order is None:
                raise RecoveryFailed(f"no recover order within {self.wait_s:.0f} s "
                                     "(restart.in_job_wait_s)")
            t_wait = time.perf_counter()
            self._abort()
            if not self.memory.abandon(_DRAIN_S):
                raise RecoveryFailed(f"the memory tier's commit did not end within "
                                     f"{_DRAIN_S} s of the abort")
            t_abort = time.perf_counter()
            self._rejoin(injob.take() or order)
            t_group = time.perf_counter()
            step, tier = self._restore()
            if tier == "none":
                raise RecoveryFailed("no state to roll back to: the memory tier holds no "
                                     "step every rank has")
        except RecoveryFailed as failed:
            worker.event("recovery_failed", error=str(failed)[:4000])
            raise
        except Exception as other:  # any other error: the same fallback
            worker.event("recovery_failed", error=f"{type(other).__name__}: {other}"[:4000])
            raise RecoveryFailed(f"in-place recovery failed: {other}") from other
        aborts, at = survivor_detail(injob, t0, groups_epoch)
        report_recovered(worker, self.log, step, abandoned, from_generation, tier,
                         (t0, t_wait, t_abort, t_group, time.perf_counter()), aborts, at)
        return step

    def _rejoin(self, order: Any) -> None:
        """The new generation's default group from the order, the script's own groups
        (``regroup``), then this module's, in a starting rank's order."""
        import torch.distributed as dist

        from trainer.distributed import collective_timeout_s
        from trainer.pgabort import leave_groups

        leave_groups(overlap=False)  # the script's own thread may still use the old groups
        self.worker.join_generation(order)
        ctx = self.worker.ctx
        self.log(f"joining generation {order.generation} at {order.env.get('MASTER_ADDR')}:"
                 f"{order.env.get('MASTER_PORT')}")
        dist.init_process_group(backend=self.backend,
                                timeout=datetime.timedelta(seconds=collective_timeout_s()))
        if (dist.get_rank(), dist.get_world_size()) != (ctx.rank, ctx.world_size):
            raise RecoveryFailed(f"the order makes this rank {dist.get_rank()} of "
                                 f"{dist.get_world_size()}, not {ctx.rank} of "
                                 f"{ctx.world_size}")
        if self.regroup is not None:
            self.regroup()
        self.control, self.memory.group = self._groups()
        self.memory.generation = ctx.generation

    def close(self) -> None:
        """Wait for the memory tier's commit in flight (call before the process groups
        are destroyed at the end)."""
        if self.memory is not None:
            self.memory.wait()
            self.memory.close()


class RecoveryFailed(RuntimeError):
    """This rank could not rejoin in place (the job falls back to a full restart)."""


class RestoreFailed(RecoveryFailed):
    """The chosen memory copy did not load on every rank."""
