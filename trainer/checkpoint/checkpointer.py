"""Saving and restoring with torch.distributed.checkpoint (DCP), committed by a manifest.

A save stages the state (a copy, so training can go on mutating it) and writes it in DCP's
background thread over a dedicated gloo group into the primary tier (the local tier when
tiering, else the only one); training blocks only for the staging. When rank 0's future
completes, every rank's files and DCP's ``.metadata`` are written (DCP gathers all ranks'
write results before finishing), so rank 0 then digests the files (BLAKE3), signs the
manifest with the job's key and writes ``manifest.json`` last: the commit. Digests and
signature are computed in the commit thread, never on the training thread. With a remote
tier, the commit then queues the step for the background uploader (``upload``). At most one
save is in flight. With the memory tier on, a save stages nothing from the device: its
tensors come from the memory tier's copy of the same step (``save_from``, ``slot_source``).

A failed save (disk full, ...) is reported, its partial directory removed, and training goes
on from the previous checkpoint; ``max_save_failures`` failures in a row end the worker with
``CheckpointSaveError`` so the supervisor's restart policy decides.

A restore loads nothing that rank 0 has not verified first: the manifest's signature, every
entry contained in its step directory, every size and digest. Each rank then reads its files
through ``VerifiedReader``: opened once, checked against that manifest, and only those bytes
deserialized; DCP's ``.metadata`` with an allow-list of DCP's types, byte items with
``weights_only=True`` (``SafeLoadPlanner``). A copy that still fails to load is rejected and
the next candidate loaded (``load``).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from trainer.checkpoint import fence, layout, signing, slot_source
from trainer.checkpoint.save_errors import (
    CheckpointLoadError,
    CheckpointSaveError,
    CheckpointTrustError,
    LoadErrors,
    SaveErrors,
    explain_failure,
)
from trainer.checkpoint.slot_source import SlotCopy
from trainer.checkpoint.staging import StagingBuffers, StagingWriter, fitting
from trainer.checkpoint.store import CheckpointStore, Choice, same_checkpoint, trust_refusals
from trainer.checkpoint.upload import Uploader
from trainer.checkpoint.verified_reader import VerifiedReader, changed_since_verified
from trainer.config import CheckpointConfig
from trainer.state import STATE_FORMAT

# How long a save waits for an abandoned save of the same step to end: its threads fail at
# their next collective, after the file they are writing.
_ORPHAN_WAIT_S = 600.0
Report = Callable[..., None]  # report(event_name, **data): the worker SDK's event()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with its byte items (the non-tensor values of a state dict: our
    counters, JSON strings, the optimizer's hyperparameters) read with ``weights_only=True``:
    plain containers and numbers only, never an arbitrary object."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@dataclass
class _Pending:
    step: int
    url: str
    tokens: int
    started: float
    blocking_s: float
    future: concurrent.futures.Future
    finalized: concurrent.futures.Future | None = None
    abandoned: bool = False  # an in-job recovery left it behind (``Checkpointer.abandon``)


def _written_files(metadata: Any) -> set[str]:
    """Files DCP's metadata says the save wrote (every rank's), plus ``.metadata`` itself."""
    storage = getattr(metadata, "storage_data", None) or {}
    names = {getattr(v, "relative_path", None) for v in storage.values()}
    return {n for n in names if n} | ({".metadata"} if storage else set())


class Checkpointer:
    """One rank's side of checkpointing: ``save`` (async, committed by rank 0), ``poll`` and
    ``wait``, ``restore`` (rank 0 chooses, every rank loads), ``finish`` and ``close``."""

    def __init__(self, cfg: CheckpointConfig, store: CheckpointStore, *, rank: int,
                 world_size: int, group: dist.ProcessGroup | None, meta: dict[str, Any],
                 report: Report, log: Callable[[str], None], device_type: str = "cpu",
                 uploader: Uploader | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.uploader = uploader if rank == 0 else None
        if self.uploader is not None:
            self.uploader.use_trust(lambda: store.trust)
            self.uploader.fence = store.fence
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.meta = meta
        self.report = report
        self.log = log
        self.device_type = device_type
        self._pending: _Pending | None = None
        self._staging_writer: Any = None  # one writer whose staging buffers are reused
        # Allocated in the background before the first save (``prepare_staging``).
        # (The rank's own device, read here on the training thread: a new thread's current
        # CUDA device is device 0.)
        self.staging = StagingBuffers(
            torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
            else None, log) if cfg.stage_ahead else None
        self.last_wait_s = 0.0  # of the last save's blocking time, waiting for the one before
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "ckpt-commit")
        # With the memory tier on (``stage_from_memory``): saves copy their tensors out of
        # its copies into host buffers of plain memory, then write them.
        self.from_memory = False
        self._buffers: dict[str, Any] | None = None
        self._buffers_taken = False  # the ones allocated ahead (``staging``) were taken
        self._orphans: list[_Pending] = []  # saves an in-job recovery abandoned
        self.failures_in_a_row = 0
        self.last_committed: int | None = None
        self.restored: Choice | None = None

    @property
    def restored_url(self) -> str | None:
        return self.restored.url if self.restored is not None else None

    # -- saving ----------------------------------------------------------------------------
    def _writer(self, url: str) -> tuple[Any, str | None]:
        """The storage writer for ``url``, and the checkpoint id to hand DCP with it."""
        if layout.is_remote(url):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(url, sync_files=False), None
        path = layout.filesystem(url)[1]
        if self._staging_writer is None:
            buffers = self._take_buffers()
            pinned = self.device_type == "cuda" and not self.from_memory
            if not pinned and buffers is None:
                # Pinning needs an accelerator (and with the memory tier on, a rank pins
                # nothing of its own): with no buffers, a save stages into a fresh plain
                # copy each time.
                return dcp.FileSystemWriter(path, thread_count=self.cfg.write_threads), None
            # One writer for the whole run, re-pointed at each step directory through DCP's
            # checkpoint_id: its staging buffers are allocated once and reused, so the
            # blocking part of a save is a device-to-host copy (0.28 s for a 13.65 GB state
            # on an H100, against 11.8 s with a fresh stager each save). Buffers allocated
            # ahead spare the first save the allocation too.
            self._staging_writer = StagingWriter(
                path, buffers=buffers, pinned=pinned, log=self.log,
                thread_count=self.cfg.write_threads)
        return self._staging_writer, path

    def _take_buffers(self) -> dict[str, Any] | None:
        """The host buffers allocated ahead (waiting for them), kept for every later save."""
        if self._buffers is None and self.staging is not None and self.staging.started \
                and not self._buffers_taken:
            self._buffers_taken = True
            self._buffers = self.staging.take()
        return self._buffers

    def stage_from_memory(self) -> None:
        """The memory tier is on: a save takes its tensors from the memory tier's copy of
        its step (``save_from``), so the buffers it writes from are plain memory."""
        self.from_memory = True
        if self.staging is not None and not self.staging.started:
            self.staging = StagingBuffers(self.staging.device, self.log, pinned=False)

    def prepare_staging(self, state: dict[str, Any]) -> None:
        """Start allocating the staging buffers in the background (after a generation's
        first step: the state's structure is final then). Only for asynchronous saves into
        a filesystem that stage from the device (from the memory tier, see ``_write_from``)."""
        if self.staging is not None and self.cfg.async_save and self._staging_writer is None \
                and not self.from_memory and not layout.is_remote(self.store.primary.root):
            self.staging.prepare(state)

    def preparing(self) -> bool:
        """Whether staging buffers are still being allocated in the background."""
        return self.staging is not None and self.staging.preparing

    def _begin(self, step: int, barrier: bool = True) -> str:
        """Before a save's files: the previous save committed, no leftovers of this step
        (every rank waits for rank 0's removal in the barrier); the step's URL."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight: the previous one must be committed first
        self.last_wait_s = time.perf_counter() - t0
        url = self.store.primary.step_url(step)
        self._await_orphans(url)
        if self.rank == 0:
            # A save killed midway may have left files for this step: never mix them in.
            layout.remove(url, self.store.primary.fs)
        if self.group is not None and barrier:
            dist.barrier(group=self.group)
        return url

    def save(self, step: int, state: dict[str, Any], tokens: int) -> float:
        """Start saving ``state`` as step ``step``; returns the seconds training was blocked."""
        t0 = time.perf_counter()
        url = self._begin(step)
        writer, checkpoint_id = self._writer(url)
        if self.cfg.async_save:
            future = dcp.async_save(state, checkpoint_id=checkpoint_id, storage_writer=writer,
                                    process_group=self.group)
        else:
            future = concurrent.futures.Future()
            try:
                future.set_result(dcp.save(state, checkpoint_id=checkpoint_id,
                                           storage_writer=writer, process_group=self.group))
            except SaveErrors as exc:
                future.set_exception(exc)
        return self._start(step, url, tokens, t0, future)

    def save_from(self, step: int, tokens: int, copy: SlotCopy) -> float | None:
        """Start saving the memory tier's copy of step ``step`` (``slot_source``: its
        tensors copied out of the slot, the rest from the state dicts it was made from);
        returns the seconds training was blocked, or None, having done nothing, when the
        copy cannot serve (``save`` then)."""
        if not self.cfg.async_save or copy.step != step:
            return None
        t0 = time.perf_counter()
        problem = slot_source.check(copy)
        if problem is not None:
            self.log(f"checkpoint step {step}: the memory tier's copy cannot serve the save "
                     f"({problem}); staging from the device")
            return None
        url = self._begin(step, barrier=False)  # the copy-out thread meets the others
        copied: concurrent.futures.Future = concurrent.futures.Future()
        copy.hold(copied)
        # A thread per save, as DCP's: one that ``abandon`` left never holds up the next.
        pool = concurrent.futures.ThreadPoolExecutor(1, "ckpt-from-memory")
        future = pool.submit(self._write_from, copy, url, copied)
        pool.shutdown(wait=False)
        return self._start(step, url, tokens, t0, future)

    def _write_from(self, copy: SlotCopy, url: str, copied: concurrent.futures.Future) -> Any:
        """The copy's bytes into host buffers (then its slot is free), then DCP's save. The
        buffers are allocated by the first save (here, never beside a first step, which
        recoveries are timed by), kept for the later ones."""
        try:
            if self._buffers is None and self.staging is not None:
                self.staging.prepare(copy.plain)
            self._buffers = buffers = fitting(copy.plain, self._take_buffers(), self.log)
            staged, pairs = slot_source.pair(copy, buffers)
            slot_source.fill(copy.buf, pairs)
        finally:
            copied.set_result(None)
        if self.group is not None:  # after rank 0 removed what a killed save left
            dist.barrier(group=self.group)
        writer = self._writer(url)[0] if layout.is_remote(url) else dcp.FileSystemWriter(
            layout.filesystem(url)[1], thread_count=self.cfg.write_threads)
        return dcp.save(staged, storage_writer=writer, process_group=self.group)

    def _start(self, step: int, url: str, tokens: int, t0: float,
               future: concurrent.futures.Future) -> float:
        """Track a save whose files are written once ``future`` completes; rank 0 then
        commits it off the training thread. Returns the seconds training was blocked."""
        blocking = time.perf_counter() - t0
        pending = _Pending(step, url, tokens, t0, blocking, future)
        if self.rank == 0:
            finalized: concurrent.futures.Future = concurrent.futures.Future()
            pending.finalized = finalized
            future.add_done_callback(
                lambda f: self._executor.submit(self._finalize, pending, finalized))
        self._pending = pending
        return blocking

    def _expected_files(self, result: Any) -> set[str]:
        """The files the finished save wrote, from its future's result (DCP's metadata)."""
        return _written_files(result)

    def _finalize(self, p: _Pending, done: concurrent.futures.Future) -> None:
        """Rank 0, off the training thread: checksum, write the manifest, prune, upload."""
        primary = self.store.primary
        try:
            expected = self._expected_files(p.future.result())
            save_s = time.perf_counter() - p.started
            trust = self.store.trust
            token = self.store.fence  # the fencing token readers check
            manifest = layout.build_manifest(
                p.url, expected, fs=primary.fs, trust=trust,
                step=p.step, tokens=p.tokens, state_format=STATE_FORMAT,
                world_size=self.world_size, wall_time_s=round(save_s, 4),
                blocking_s=round(p.blocking_s, 4), state=self.meta.get("state_layout", {}),
                **({"generation": token.generation, "run": token.run}
                   if token.generation is not None and token.run is not None else {}),
                **{k: v for k, v in self.meta.items() if k != "state_layout"})
            fence.check_claim(primary.fs, primary.root, token)
            layout.write_manifest(p.url, manifest, primary.fs)
        except fence.Fenced as exc:  # a newer generation owns the root: never commit here
            self._fenced(p, exc)
            done.set_result(None)
            return
        except SaveErrors as exc:
            self._failed(p, exc)
            done.set_result(None)
            return
        self.failures_in_a_row = 0
        self.last_committed = p.step
        size = sum(f["size"] for f in manifest["files"].values())
        self.report("checkpoint_committed", tier=primary.name, step=p.step, path=p.url,
                    tokens=p.tokens, blocking_s=round(p.blocking_s, 4),
                    save_s=round(save_s, 4), bytes=size)
        self.log(f"checkpoint step {p.step} committed ({primary.name}): "
                 f"{size / 2**20:.1f} MiB in {save_s:.2f} s (training blocked "
                 f"{p.blocking_s * 1000:.0f} ms)")
        if self.uploader is not None:
            self.uploader.submit(p.step)
        self._prune_primary(p.step)
        done.set_result(p.step)

    def _failed(self, p: _Pending, exc: BaseException) -> None:
        reason = explain_failure(exc, p.url)
        if p.abandoned:  # the recovery's abort, not the storage
            reason = f"abandoned by an in-job recovery ({reason})"
        else:
            self.failures_in_a_row += 1
        try:  # free what the failed save wrote: on a full disk the next one needs the room
            layout.remove(p.url, self.store.primary.fs)
        except Exception as cleanup:  # noqa: BLE001 - reported below with the failure
            reason += f" (removing the partial directory failed too: {cleanup})"
        previous = self.last_committed
        self.report("checkpoint_failed", step=p.step, path=p.url, error=reason,
                    failures_in_a_row=self.failures_in_a_row, previous_step=previous)
        self.log(f"checkpoint step {p.step} FAILED: {reason}; the previous checkpoint "
                 f"(step {previous}) stays the restore point "
                 f"({self.failures_in_a_row}/{self.cfg.max_save_failures} failures in a row)")

    def _fenced(self, p: _Pending, exc: fence.Fenced) -> None:
        """A deposed generation's save: its files go, nothing is committed, no failure is
        counted (the worker is about to be stopped by its agent's lease anyway)."""
        try:
            layout.remove(p.url, self.store.primary.fs)
        except Exception:  # noqa: BLE001 - the files are never read without a manifest
            pass
        self.report("checkpoint_fenced", step=p.step, path=p.url, error=str(exc)[:500])
        self.log(f"checkpoint step {p.step} NOT committed: {exc}")

    def _prune_primary(self, step: int) -> None:
        """Retention after a commit: only checkpoints that verify (sizes, containment, the
        signature) count toward ``keep_last``; one that fails is reported and left alone."""
        keep_every = None if self.store.tiered else self.cfg.keep_every
        protect = {step} | (self.uploader.pending if self.uploader is not None else set())
        primary = self.store.primary
        try:
            plan = layout.plan_prune(primary.root, self.cfg.keep_last, keep_every,
                                     protect=protect, fs=primary.fs, trust=self.store.trust)
            removed = layout.execute_prune(plan, primary.fs)
        except Exception as exc:  # noqa: BLE001 - pruning is retried after the next commit
            self.log(f"pruning {primary.root} failed: {exc}")
            return
        if plan.failing:
            self.log(f"{primary.root}: checkpoint(s) {sorted(plan.failing)} fail verification: "
                     "not counted toward keep_last, left in place: "
                     + "; ".join(f"step {s}: {p[0]}" for s, p in sorted(plan.failing.items())))
        if removed or plan.failing:
            self.report("checkpoint_pruned", tier=primary.name, steps=removed,
                        failing=sorted(plan.failing))

    def poll(self) -> None:
        """Forget a save once it has finished (cheap; call every step). Raises
        ``CheckpointSaveError`` once ``max_save_failures`` saves in a row have failed."""
        p = self._pending
        if p is not None and p.future.done() and (p.finalized is None or p.finalized.done()):
            self._note_rank_failure(p)
            self._pending = None
        self._raise_if_failing()

    def wait(self, raise_on_failures: bool = True) -> None:
        """Block until the in-flight save (if any) is written and committed."""
        p = self._pending
        if p is not None:
            try:
                p.future.result()
            except SaveErrors:
                pass
            if p.finalized is not None:
                p.finalized.result()
            self._note_rank_failure(p)
            self._pending = None
        if raise_on_failures:
            self._raise_if_failing()

    def _raise_if_failing(self) -> None:
        if self.failures_in_a_row >= self.cfg.max_save_failures:
            raise CheckpointSaveError(
                f"{self.failures_in_a_row} checkpoint saves in a row failed (checkpoint."
                f"max_save_failures); the newest committed one is step {self.last_committed}")

    def _note_rank_failure(self, p: _Pending) -> None:
        exc = p.future.exception()
        if exc is not None and p.finalized is None:  # rank != 0: nothing else reports it
            print(f"checkpoint step {p.step}: write failed on this rank: "
                  f"{explain_failure(exc, p.url)}", flush=True)

    def abandon(self) -> None:
        """Forget the save in flight when an in-job recovery aborted the process groups.
        Its threads end on their own (its collectives fail; files it is writing are written
        first, seconds for gigabytes, which the recovery does not wait for); its failure is
        reported, not counted toward ``max_save_failures``. A later save of the same step
        waits for them before it writes (their clean-up removes that step's directory)."""
        p, self._pending = self._pending, None
        if p is not None:
            p.abandoned = True
            self._orphans.append(p)

    def _await_orphans(self, url: str) -> None:
        """Before a save into ``url``: an abandoned save of the same step has ended (bounded
        by the collective timeout; its threads fail as soon as they meet a collective)."""
        kept = []
        for o in self._orphans:
            if o.url == url:
                for future in (o.future, o.finalized):
                    if future is not None:
                        concurrent.futures.wait([future], timeout=_ORPHAN_WAIT_S)
            if not (o.future.done() and (o.finalized is None or o.finalized.done())):
                kept.append(o)
        self._orphans = kept

    def finish(self) -> None:
        """End of training: commit the last save and wait (bounded) for its upload, so the
        remote tier holds the final checkpoint when the job completes."""
        self.wait()
        if self.uploader is None:
            return
        if not self.uploader.wait(timeout=self.cfg.final_upload_timeout_s):
            self.log(f"uploads still running after {self.cfg.final_upload_timeout_s:.0f} s: "
                     "the remote tier lags the local one")
        if self.last_committed is not None:
            # Retention once more, now that the uploads are done: a step still uploading
            # when the last one committed was protected then, and an older one beyond
            # keep_last could stay with it (the local tier ended a job with 3 of 2).
            self._prune_primary(self.last_committed)

    def close(self) -> None:
        """Finish the in-flight save and stop the threads (after ``finish``, or on an error:
        then uploads still queued are dropped, their local copies stay committed)."""
        self.wait(raise_on_failures=False)
        self._executor.shutdown(wait=True)
        if self.uploader is not None:
            self.uploader.close(timeout=0)

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, state: dict[str, Any], max_step: int | None = None) -> dict[str, Any] | None:
        """Load the newest committed, verified checkpoint (<= ``max_step``) into ``state``:
        ``choose`` then ``load``. Returns its manifest, or None for a fresh start."""
        return self.load(state, self.choose(max_step))

    def choose(self, max_step: int | None = None) -> Choice | None:
        """The checkpoint every rank will load (None: a fresh start), before anything is built.

        Rank 0 chooses, verifies (fetching a remote copy into the local tier), then tells
        the others, so every rank loads the same one. Collective over the checkpoint group.
        """
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                choice = [self._select(max_step)]
            except (CheckpointTrustError, signing.SigningKeyError) as exc:
                choice = [exc]
        if self.group is not None:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        if isinstance(choice[0], BaseException):
            raise CheckpointTrustError(str(choice[0]))  # every rank stops, not only rank 0
        return choice[0]

    def _select(self, max_step: int | None) -> Choice | None:
        """Rank 0: the newest checkpoint that verifies, each refusal journaled."""
        _ = self.store.trust  # the job's key, read (or created) now: a bad one stops the start
        def skipped(tier: str, info: layout.CheckpointInfo, problems: list[str]) -> None:
            self.log(f"checkpoint step {info.step} ({tier}) at {info.url} fails "
                     f"verification, skipped: {'; '.join(problems)}")
            refusal = self.store.refused[-1] if self.store.refused else None
            self.report("checkpoint_skipped", step=info.step, path=info.url, tier=tier,
                        reason=problems[0] if problems else "fails verification",
                        problems=problems,
                        signature=refusal.signature if refusal is not None else None)

        found = self.store.select(max_step, checksums=True, on_skip=skipped, log=self.log)
        self._claim(found)
        if found is not None and found.fetched_from is not None:
            self.report("checkpoint_fetched", step=found.step, source=found.fetched_from,
                        path=found.url)
        if found is None:
            keyed = trust_refusals(self.store.refused, self.store.trust)
            if keyed:
                trust = self.store.trust
                steps = sorted({r.step for r in keyed})
                raise CheckpointTrustError(
                    f"no checkpoint verifies, and step(s) {steps} were refused for their "
                    f"signature ({keyed[0].problems[0]}); this job's key is "
                    f"{trust.key_id if trust else None} from {trust.source if trust else '-'}. "
                    f"Give the job the key that signed them ({signing.KEY_FILE_ENV} or "
                    f"{signing.KEY_ENV}), accept unsigned ones with checkpoint.trust_unsigned, "
                    f"or move them away to start afresh")
        return found

    def _claim(self, found: Choice | None) -> None:
        """Rank 0 of a new generation claims every tier's job root (``fence.json``), so a
        deposed generation's rank 0 and uploader refuse to commit there from now on."""
        token = self.store.fence
        if token.generation is None or token.run is None:
            return
        for tier in self.store.tiers:
            try:
                if not fence.claim(tier.fs, tier.root, token,
                                   found.step if found is not None else None):
                    self.log(f"{tier.root} is claimed by a generation newer than "
                             f"{token.generation}")
            except Exception as exc:  # noqa: BLE001 - readers still check the lineage
                self.log(f"could not claim {tier.root} for generation {token.generation}: "
                         f"{exc}")

    def load(self, state: dict[str, Any], found: Choice | None) -> dict[str, Any] | None:
        """Load the chosen checkpoint into ``state``; returns its manifest (None: nothing
        chosen). A checkpoint that exists only locally is queued for upload again.

        A copy that verified but does not load (its files changed since, a pickle the
        allow-list refuses, a layout this model cannot take) is rejected (``store.reject``:
        uncommitted, so no restart picks it again), journaled as ``checkpoint_skipped``, and
        the next candidate is loaded (an older step, or the other tier's copy). Collective.
        Raises ``CheckpointLoadError`` when none is left: the state is partly overwritten,
        so the rank must not train from it; the next start finds the rejected copies gone.
        """
        tried: list[str] = []
        while found is not None:
            problem = self._agree(self._try_read(state, found))
            if problem is None:
                break
            tried.append(f"step {found.step}: {problem}")
            self._reject(found, problem)
            found = self.choose(max_step=found.step - 1)
        if found is None:
            if tried:
                raise CheckpointLoadError("no checkpoint loads: " + "; ".join(tried[:4]))
            return None
        self.last_committed = found.step
        self.restored = found
        if self.uploader is not None and self.store.remote is not None:
            try:
                remote = layout.read_manifest(self.store.remote.step_url(found.step),
                                              self.store.remote.fs)
            except Exception:  # noqa: BLE001 - unreachable now: the upload retries later
                remote = None
            if not same_checkpoint(remote, found.manifest):
                self.uploader.submit(found.step)  # a local-only checkpoint: repair the remote
        return found.manifest

    def _try_read(self, state: dict[str, Any], found: Choice) -> str | None:
        """None when ``found`` loaded into ``state``, else why not (this rank's view)."""
        try:
            self._read(state, found)
        except LoadErrors as exc:
            return explain_failure(exc, found.url)
        return None

    def _agree(self, problem: str | None) -> str | None:
        """The first rank's problem, the same on every rank (all load, or all move on)."""
        if self.group is None:
            return problem
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        return next((p for p in problems if p), None)

    def _reject(self, found: Choice, problem: str) -> None:
        """Rank 0: uncommit the copy that did not load, and say why."""
        if self.rank != 0:
            return
        everywhere = not changed_since_verified(problem)
        try:
            where = self.store.reject(found, everywhere=everywhere)
        except Exception as exc:  # noqa: BLE001 - reported; the next candidate still loads
            where = [f"(could not uncommit it: {type(exc).__name__}: {exc})"]
        self.log(f"checkpoint step {found.step} at {found.url} verified but did not load, "
                 f"rejected ({', '.join(where) or 'nothing uncommitted'}): {problem}")
        self.report("checkpoint_skipped", step=found.step, path=found.url, tier=found.tier,
                    reason=f"verified but did not load: {problem}"[:4000],
                    problems=[problem[:4000]], stage="load")

    def _read(self, state: dict[str, Any], found: Choice) -> None:
        """Read the checkpoint's files into ``state`` (DCP; other writers override this):
        every file through ``VerifiedReader``, the bytes checked being the bytes loaded."""
        reader = VerifiedReader(found.url, found.manifest)
        for obj in state.values():  # format-dependent templates (``RngState``)
            if hasattr(obj, "prepare_load"):
                obj.prepare_load(found.manifest)
        dcp.load(state, storage_reader=reader, process_group=self.group,
                 planner=SafeLoadPlanner())
