"""In-job recovery in our trainer: a surviving rank rejoins the next generation in place.

When a peer dies (or hangs and is killed), this rank's next collective fails. Instead of
exiting, the training loop hands the error to :meth:`Rejoin.recover`, which

1. waits (bounded) for the agent's ``recover`` order (``orchestrator.worker.injob``); the
   order's arrival already aborted this process's process groups (:func:`abort_groups`, from
   the SDK's order thread), which unblocks a collective waiting on a peer that will never
   answer (NCCL); on gloo the peer's death fails it at once;
2. lets the save threads end (their collectives fail with the abort) and forgets their saves;
3. destroys the old process groups and makes the new generation's, from the order's
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

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.contracts import chaos

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


_ABORT_LOCK = threading.Lock()
_ABORTED: set[int] = set()  # ids of the process groups this process has aborted
# Each aborted group's backend and the seconds its abort took, until the groups are left:
# an NCCL communicator's abort takes about half a second on a Hopper host.
ABORT_TIMES: list[tuple[str, float]] = []


def abort_groups() -> None:
    """Abort every process group of this process, without a collective: a thread blocked in
    one of their operations gets an error. Safe from any thread (NVRx's in-process restart
    aborts from its monitor thread the same way); the order thread and the training thread
    may both call it, and each group is aborted once (two concurrent aborts of one NCCL
    communicator are undefined)."""
    import torch.distributed.distributed_c10d as c10d

    with _ABORT_LOCK:
        for pg in list(c10d._world.pg_map):
            if id(pg) in _ABORTED:
                continue
            _ABORTED.add(id(pg))
            t0 = time.perf_counter()
            with contextlib.suppress(Exception):  # a backend without abort
                pg.abort()
            backend = c10d._world.pg_map.get(pg, ("?",))[0]
            ABORT_TIMES.append((str(backend), round(time.perf_counter() - t0, 4)))


def report_recovered(worker: Any, log: Log, step: int, abandoned: int, from_generation: int,
                     tier: str, marks: tuple[float, float, float, float, float],
                     aborts: dict[str, Any] | None = None) -> None:
    """The ``recovered`` event and log line of a rank back in place at ``step``. ``marks``:
    the recovery's start, the order's arrival, the abort done, the groups made, the restore
    done (``time.perf_counter``); ``aborts``: :func:`abort_detail`'s fields."""
    t0, t_wait, t_abort, t_group, done = marks
    worker.event("recovered", step=step, abandoned_step=abandoned,
                 from_generation=from_generation, tier=tier,
                 wait_s=round(t_wait - t0, 6), abort_s=round(t_abort - t_wait, 6),
                 group_s=round(t_group - t_abort, 6), restore_s=round(done - t_group, 6),
                 total_s=round(done - t0, 6), **(aborts or {}))
    log(f"recovered in place: generation {worker.ctx.generation}, back to step {step} from "
        f"{abandoned} ({tier} tier) in {done - t0:.2f} s")


def abort_detail(injob: Any, t0: float) -> dict[str, Any]:
    """Where a survivor's time went around its recovery's start (``t0``): the order's
    arrival and each group's abort, whichever thread ran it (taken once the aborts are done,
    before the groups are left, which forgets them)."""
    out: dict[str, Any] = {}
    if injob.delivered_at is not None:
        out["order_lag_s"] = round(t0 - injob.delivered_at, 6)
    with _ABORT_LOCK:
        if ABORT_TIMES:
            out["group_aborts"] = " ".join(f"{b}:{s:.3f}" for b, s in ABORT_TIMES)[:256]
    return out


def leave_groups() -> None:
    """Destroy this process's (aborted) process groups before the next generation's are
    made; the ids of the aborted ones may be reused by the new ones."""
    import torch.distributed as dist

    dist.destroy_process_group()
    with _ABORT_LOCK:
        _ABORTED.clear()
        ABORT_TIMES.clear()


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

    def enable(self, worker: Any) -> None:
        worker.injob.enable(abort_groups)

    def recover(self, p: Any, exc: BaseException) -> bool:
        """Rejoin the next generation after ``exc``; False when ``exc`` is not a peer's
        failure (the caller raises it). Raises :class:`RejoinFailed` when it cannot."""
        worker = p.worker
        injob = worker.injob
        if not injob.enabled or not (injob.pending() is not None or peer_failure(exc)):
            return False
        t0 = time.perf_counter()
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
            abort_groups()
            aborts = abort_detail(injob, t0)
            self._drain(p)
            if p.memory is not None:  # verified while the new groups meet
                p.memory.digest_ahead()
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
        report_recovered(worker, self.log, p.progress.step, abandoned, from_generation, tier,
                         (t0, t_wait, t_abort, t_group, time.perf_counter()), aborts)
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

        leave_groups()
        p.worker.join_generation(order)
        self.log(f"joining generation {order.generation}'s process groups at "
                 f"{order.env.get('MASTER_ADDR')}:{order.env.get('MASTER_PORT')}")
        fresh = init_distributed(self.settings.trainer)
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
        self.backend.rejoin(self.stepper, dctx)
        self.log("process groups made; restoring the newest state every rank holds")

    def _restore(self, p: Any) -> str:
        """Collective: the newest state every rank holds, into this rank's live parts."""
        from trainer import restore

        found = restore.choose(p.memory, self.checkpointer, p.dctx, None, self.log)
        if found.empty:
            raise RejoinFailed("no checkpoint to roll back to (the memory tier and the "
                               "durable tier hold none)")
        self.backend.reset_step_state(self.stepper)
        manifest = restore.load(found, p.memory, self.checkpointer, p.checkpoint_state,
                                p.dctx, None, p.progress, self.settings.config_hash)
        if manifest is None:
            raise RejoinFailed("the chosen checkpoint did not load")
        restore.announce(found, manifest, self.checkpointer, p.dctx, p.worker, self.log,
                         p.progress, self.settings.config_hash)
        note = found.tier_note
        return note["tier"] if note is not None else "durable"
