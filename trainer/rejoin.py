"""In-job recovery in our trainer: a surviving rank rejoins the next generation in place.

When a peer dies (or hangs and is killed), this rank's next collective fails. Instead of
exiting, the training loop hands the error to :meth:`Rejoin.recover`, which

1. waits (bounded) for the agent's ``recover`` order (``orchestrator.worker.injob``); the
   order's arrival already started the abort of this process's process groups
   (``trainer.pgabort``, from the SDK's order thread), which unblocks a collective waiting
   on a peer that will never answer (NCCL); on gloo the peer's death fails it at once. A
   step past its blocked host sync stops at its next safe point (:class:`RecoveryOrdered`)
   instead of queueing on the aborting communicator;
2. lets the save threads end (their collectives fail with the abort) and forgets their saves;
3. leaves the old process groups (to their abort, if it still runs:
   ``trainer.parallelism.overlap_abort``) and makes the new generation's, from the order's
   environment (a fresh rendezvous store), in the order a starting rank makes them, and
   points the model's FSDP2 state and our checkpoint and memory-tier parts at them;
4. restores the newest state every rank holds (``trainer.restore``: the same collectives a
   starting replacement runs, so the two meet in each), rolling model, optimizer, schedule,
   data position and every RNG state back together;
5. goes on training in the same interpreter: imports, the device context, the compiled
   graphs and the page-locked memory-tier slots stay.

Anything unexpected (no order in time, a thread that does not end, no state to roll back to,
a restore that fails) raises :class:`RejoinFailed`: the rank says why (``recovery_failed``)
and exits, and the supervisor falls back to a full restart.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.contracts import chaos
from trainer import pgabort

# An error of a collective whose peer is gone, as gloo and NCCL word it (their errors are
# RuntimeErrors, or torch's DistError family in newer releases).
_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                "Read error", "Write error", "Socket Timeout", "aborted", "Aborted",
                "NCCL communicator", "ncclRemoteError", "ncclSystemError",
                "ProcessGroupGloo", "ProcessGroupNCCL", "gloo", "Timed out waiting")
# How long the save threads get to end once the groups are aborted (they fail at once; a
# thread past this is stuck, and a stuck thread would stall the new generation's groups).
_DRAIN_S = 10.0

Log = Callable[[str], None]


class RejoinFailed(RuntimeError):
    """The rank could not rejoin in place (the job falls back to a full restart)."""


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer is gone (or the groups were
    aborted for a recovery), not this rank's own error."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_ERRORS)


def survivor_detail(injob: Any, t0: float, groups_epoch: int, overlapped: bool = False
                    ) -> tuple[dict[str, Any], dict[str, float]]:
    """Where a survivor's time went around its recovery's start (``t0``), taken when it
    reports: the order's lag and each old group's abort (``trainer.pgabort.record`` of
    ``groups_epoch``), and their wall-clock marks. ``overlapped``: it left the old groups
    while their abort ran."""
    rec = pgabort.record(groups_epoch)
    aborts: dict[str, Any] = {k: rec[k] for k in ("group_aborts", "aborts_running") if k in rec}
    at = {k: rec[k] for k in ("abort_start", "abort_end") if k in rec}
    if injob.delivered_at is not None:
        aborts["order_lag_s"] = round(t0 - injob.delivered_at, 6)
        at["order"] = time.time() - (time.perf_counter() - injob.delivered_at)
    if overlapped:
        aborts["overlapped"] = True
    return aborts, at


def report_recovered(worker: Any, log: Log, step: int, abandoned: int, from_generation: int,
                     tier: str, marks: tuple[float, float, float, float, float],
                     aborts: dict[str, Any] | None = None,
                     at: dict[str, float] | None = None) -> None:
    """The ``recovered`` event and log line of a rank back in place at ``step``. ``marks``:
    the recovery's start, the order's arrival, the abort done, the groups made, the restore
    done (``time.perf_counter``); ``aborts``: :func:`survivor_detail`'s fields; ``at``: the
    wall-clock end of each finer part (``at_<part>`` fields: a bench lays them on the
    kill's time line)."""
    t0, t_wait, t_abort, t_group, done = marks
    worker.event("recovered", step=step, abandoned_step=abandoned,
                 from_generation=from_generation, tier=tier,
                 wait_s=round(t_wait - t0, 6), abort_s=round(t_abort - t_wait, 6),
                 group_s=round(t_group - t_abort, 6), restore_s=round(done - t_group, 6),
                 total_s=round(done - t0, 6), **(aborts or {}),
                 **{f"at_{k}": round(v, 6) for k, v in (at or {}).items()})
    log(f"recovered in place: generation {worker.ctx.generation}, back to step {step} from "
        f"{abandoned} ({tier} tier) in {done - t0:.2f} s")


class RecoveryOrdered(RuntimeError):
    """Raised in the training thread at a safe point of a step when the in-job recovery's
    order has come: the process groups are being aborted."""


def interrupt_if_ordered(injob: Any) -> None:
    """Raise :class:`RecoveryOrdered` when a recover order is pending (a step's hook)."""
    if injob.pending() is not None:
        raise RecoveryOrdered("the in-job recovery's order came: the process groups are "
                              "aborted")


@dataclass
class Rejoin:
    """What a survivor needs beyond the loop's parts to rejoin in place: the settings (the
    process groups' spec, the config hash), the backend (its model's process-group state),
    and the real checkpointer and stepper (the loop's may be fault-injection proxies)."""

    settings: Any
    backend: Any
    checkpointer: Any
    stepper: Any
    wait_s: float
    log: Log
    # Wall-clock ends of the current recovery's parts (``report_recovered``'s ``at``).
    _at: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    # Whether the current recovery left its old groups while their abort still ran.
    _overlapped: bool = field(default=False, init=False, repr=False)
    # The memory tier (None: off): its own copies are digested from the order's arrival.
    memory: Any = None
    # The next generation's rendezvous store, served from the order's arrival when this
    # rank hosts it (``trainer.distributed.host_store_ahead``), until its groups are made.
    _store: Any = field(default=None, init=False, repr=False)
    # The generation whose order started the memory copies' digest (order thread).
    _digest_for: int | None = field(default=None, init=False, repr=False)

    def _digest_early(self, injob: Any) -> None:
        """Order thread: start digesting this rank's memory copies now, before the abort
        (0.5-1.7 s on NCCL) and the next groups: the restore's verification waits for it,
        and with the next group made in half a second it was on the recovery's path."""
        order = injob.pending()
        if order is not None and self.memory is not None:
            self.memory.digest_ahead()
            self._digest_for = order.generation

    def _host_store(self, injob: Any) -> None:
        """Order thread: serve the ordered generation's store now if this rank hosts it."""
        from trainer.distributed import host_store_ahead

        order = injob.pending()
        if order is not None:
            self._store = host_store_ahead(order.env)

    def enable(self, worker: Any) -> None:
        injob = worker.injob
        # The order's callbacks run in registration order: the next generation's store is
        # served before the old groups' abort (half a second on NCCL) begins.
        injob.enable(functools.partial(self._host_store, injob))
        injob.enable(functools.partial(self._digest_early, injob))
        injob.enable(functools.partial(pgabort.abort_groups,
                                       slow_s=worker.ctx.chaos.slow_abort_s))
        if hasattr(self.stepper, "interrupt"):
            # A step past its blocked host sync (the abort stopped the collective's
            # kernels) stops there, before the next collective of the aborting groups.
            self.stepper.interrupt = functools.partial(interrupt_if_ordered, injob)

    def recover(self, p: Any, exc: BaseException) -> bool:
        """Rejoin the next generation after ``exc``; False when ``exc`` is not a peer's
        failure (the caller raises it). Raises :class:`RejoinFailed` when it cannot."""
        worker = p.worker
        injob = worker.injob
        if not injob.enabled or not (injob.pending() is not None or peer_failure(exc)):
            return False
        t0 = time.perf_counter()
        at: dict[str, float] = {"caught": time.time()}
        self._at = at
        groups_epoch = pgabort.epoch()
        abandoned = p.progress.step
        from_generation = worker.ctx.generation
        self.log(f"collective failed at step {abandoned + 1} ({type(exc).__name__}: "
                 f"{str(exc)[:200]}); waiting for the in-job recovery order")
        # ``loading`` until the first step of the new generation: that step waits for the
        # replacement's first one (its compile), which the training timeout, a few step
        # intervals, must not judge. The step's report returns the rank to ``training``.
        worker.set_phase("loading")
        try:
            order = injob.wait(self.wait_s)
            if order is None:
                raise RejoinFailed(f"no recover order within {self.wait_s:.0f} s "
                                   "(restart.in_job_wait_s)") from exc
            t_wait = time.perf_counter()
            self.log(f"recover order for generation {order.generation}: aborting the "
                     "process groups, ending the save threads")
            # What the order thread has not claimed yet (its callbacks may still be
            # running): aborted in a thread, as the order thread's own would be.
            pgabort.abort_groups(slow_s=worker.ctx.chaos.slow_abort_s, wait=False)
            self._drain(p)
            at["drained"] = time.time()
            if p.memory is not None and self._digest_for != order.generation:
                p.memory.digest_ahead()  # verified while the new groups meet
            t_abort = time.perf_counter()
            self._new_groups(p, injob.take() or order)
            t_group = time.perf_counter()
            if chaos.fails_rejoin(worker.ctx.chaos, p.dctx.rank):
                raise RejoinFailed(chaos.REJOIN_FAILURE)
            tier = self._restore(p)
        except RejoinFailed as failed:
            worker.event("recovery_failed", error=str(failed)[:4000])
            raise
        except Exception as other:
            worker.event("recovery_failed", error=f"{type(other).__name__}: {other}"[:4000])
            raise RejoinFailed(f"in-place recovery failed: {other}") from other
        aborts, marks = survivor_detail(injob, t0, groups_epoch, self._overlapped)
        at.update(marks)
        report_recovered(worker, self.log, p.progress.step, abandoned, from_generation, tier,
                         (t0, t_wait, t_abort, t_group, time.perf_counter()), aborts, at)
        return True

    def _drain(self, p: Any) -> None:
        """The saves in flight are forgotten. The durable tier's threads end on their own
        (their collectives fail with the abort; a later save of the same step waits for
        them). The memory tier's commit is cancelled and waited for: it must not commit a
        copy of the abandoned steps while the new generation restores; one still running
        after ``_DRAIN_S`` makes the recovery give up."""
        self.checkpointer.abandon()
        if p.memory is not None and not p.memory.abandon(_DRAIN_S):
            raise RejoinFailed(f"the memory tier's commit did not end within {_DRAIN_S} s of "
                               "the abort")

    def _new_groups(self, p: Any, order: Any) -> None:
        """The new generation's process groups, made in the order a starting rank makes
        them (the replacement's, which meets ours in each rendezvous), and every holder of
        the old ones pointed at them."""
        from trainer.distributed import init_distributed, new_memory_group

        self._overlapped = pgabort.leave_groups(self.settings.trainer.parallelism.overlap_abort)
        self._at["left"] = time.time()
        p.worker.join_generation(order)
        self.log(f"joining generation {order.generation}'s process groups at "
                 f"{order.env.get('MASTER_ADDR')}:{order.env.get('MASTER_PORT')}")
        fresh = init_distributed(self.settings.trainer, marks=self._at)
        self._store = None  # the default group holds the server now
        if (fresh.rank, fresh.world_size) != (p.dctx.rank, p.dctx.world_size):
            raise RejoinFailed(f"the order makes this rank {fresh.rank} of {fresh.world_size}"
                               f", not {p.dctx.rank} of {p.dctx.world_size}")
        dctx = p.dctx
        dctx.ckpt_group, dctx.control_group = fresh.ckpt_group, fresh.control_group
        self.checkpointer.group = dctx.ckpt_group
        # The fencing token: this process now writes and reads as the new generation.
        from trainer.checkpoint.fence import Fence

        ctx = p.worker.ctx
        fence = Fence(ctx.generation, tuple(ctx.lineage), ctx.run_id)
        self.checkpointer.store.fence = fence
        if self.checkpointer.uploader is not None:
            self.checkpointer.uploader.fence = fence
        if p.memory is not None:
            p.memory.group = new_memory_group(dctx)
            p.memory.generation = p.worker.ctx.generation
        self._at["groups_ready"] = time.time()
        self.backend.rejoin(self.stepper, dctx)
        self._at["backend_rejoined"] = time.time()
        self.log("process groups made; restoring the newest state every rank holds")

    def _restore(self, p: Any) -> str:
        """Collective: the newest state every rank holds, into this rank's live parts."""
        from trainer import restore

        found = restore.choose(p.memory, self.checkpointer, p.dctx, None, self.log)
        self._at.update(found.at)
        self._at["chose_checkpoint"] = time.time()
        if found.empty:
            raise RejoinFailed("no checkpoint to roll back to (the memory tier and the "
                               "durable tier hold none)")
        self.backend.reset_step_state(self.stepper)
        manifest = restore.load(found, p.memory, self.checkpointer, p.checkpoint_state,
                                p.dctx, None, p.progress, self.settings.config_hash)
        self._at.update(found.at)  # and the load's own parts
        self._at["loaded_state"] = time.time()
        if manifest is None:
            raise RejoinFailed("the chosen checkpoint did not load")
        restore.announce(found, manifest, self.checkpointer, p.dctx, p.worker, self.log,
                         p.progress, self.settings.config_hash)
        note = found.tier_note
        return note["tier"] if note is not None else "durable"
