"""A framework's own saves committed in the orchestrator's checkpoint layout.

The framework writes its files the way it always does (Lightning's ``save_checkpoint``, the
Hugging Face ``Trainer``'s ``checkpoint-N`` directory); the hook has them written into (or
moved to) ``<root>/<job>/step-<8 digits>/`` and rank 0 commits that directory as the built-in
trainer does: every file's digest in a ``manifest.json`` signed with the job's key and
written last and atomically (``trainer.checkpoint.layout``), ``checkpoint_committed``
reported (the supervisor's restart budget and resume point), retention (``keep_last``) and
the remote tier's upload. On restart the framework is pointed at the newest checkpoint that
verifies (``newest``), so it resumes from what the orchestrator committed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

# The framework's files in a step directory are its own format: the manifest says so.
STATE_FORMAT = "framework"


class FrameworkCheckpoints:
    """Rank 0 commits, every rank finds the resume point; ``None`` paths when unmanaged."""

    def __init__(self, cfg: Any, store: Any, *, rank: int, job: str, framework_meta: dict,
                 report: Callable[..., None], log: Callable[[str], None],
                 uploader: Any = None, max_step: int | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.rank = rank
        self.job = job
        self.meta = framework_meta
        self.report = report
        self.log = log
        self.uploader = uploader
        self.max_step = max_step
        self.last_committed: int | None = None

    @classmethod
    def from_job(cls, ctx: Any, job_cfg: dict[str, Any], worker: Any
                 ) -> FrameworkCheckpoints | None:
        """The job's checkpoint tiers as the supervisor handed them out; None when the rank
        is not managed (no checkpoint root)."""
        if not ctx.managed or not ctx.checkpoint_root:
            return None
        from trainer.checkpoint.store import open_store
        from trainer.checkpoint.upload import Uploader
        from trainer.config import CheckpointConfig

        cfg = CheckpointConfig.model_validate(job_cfg.get("checkpoint") or {})
        store = open_store(cfg, ctx.job, ctx.checkpoint_root)
        uploader = None
        if store.remote is not None and ctx.rank == 0:
            uploader = Uploader(store.primary, store.remote,
                                keep_last=cfg.keep_last_remote or cfg.keep_last,
                                keep_every=cfg.keep_every, attempts=cfg.upload_attempts,
                                backoff_s=cfg.upload_backoff_s,
                                backoff_max_s=cfg.upload_backoff_max_s, report=worker.event,
                                log=_log)
        return cls(cfg, store, rank=ctx.rank, job=ctx.job,
                   framework_meta={"world_size": ctx.world_size}, report=worker.event,
                   log=_log, uploader=uploader, max_step=ctx.resume_max_step)

    @property
    def interval(self) -> int:
        return int(self.cfg.interval_steps)

    def step_path(self, step: int) -> str:
        """The local directory of step ``step`` (the primary tier is a filesystem)."""
        from trainer.checkpoint import layout

        url = self.store.primary.step_url(step)
        if layout.is_remote(url):
            raise ValueError(f"{url}: a framework saves into a filesystem; set "
                             "checkpoint.local_url to commit locally and upload from there")
        return layout.filesystem(url)[1]

    def prepare(self, step: int) -> str:
        """Rank 0 clears what a save killed midway left for ``step``; returns its path. Every
        rank must then wait for rank 0 (the framework's save has a barrier of its own)."""
        from trainer.checkpoint import layout

        path = self.step_path(step)
        if self.rank == 0:
            layout.remove(self.store.primary.step_url(step), self.store.primary.fs)
            os.makedirs(path, exist_ok=True)
        return path

    def adopt(self, step: int, source: str) -> str:
        """Rank 0 moves a directory the framework wrote (``checkpoint-N``) to step ``step``'s
        place in the layout (a rename on one filesystem); returns the step path."""
        path = self.step_path(step)
        if self.rank != 0:
            return path
        from trainer.checkpoint import layout

        layout.remove(self.store.primary.step_url(step), self.store.primary.fs)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.move(source, path)
        return path

    def commit(self, step: int, *, tokens: int | None = None, blocking_s: float = 0.0,
               **meta: Any) -> bool:
        """Rank 0, once every rank's files of ``step`` are written: the signed manifest (the
        commit), the event, retention and upload. False when the commit failed (reported;
        the previous checkpoint stays the restore point)."""
        if self.rank != 0:
            return False
        from trainer.checkpoint import layout

        t0 = time.perf_counter()
        primary = self.store.primary
        url = primary.step_url(step)
        try:
            manifest = layout.build_manifest(
                url, fs=primary.fs, trust=self.store.trust, step=step,
                tokens=tokens or 0, state_format=STATE_FORMAT, job=self.job,
                blocking_s=round(blocking_s, 4), **self.meta, **meta)
            layout.write_manifest(url, manifest, primary.fs)
        except Exception as exc:  # noqa: BLE001 - reported; the previous one stays
            self.report("checkpoint_failed", step=step, path=url,
                        error=f"{type(exc).__name__}: {exc}"[:4000],
                        failures_in_a_row=1, previous_step=self.last_committed)
            self.log(f"checkpoint step {step} FAILED: {exc}")
            return False
        self.last_committed = step
        size = sum(f["size"] for f in manifest["files"].values())
        self.report("checkpoint_committed", tier=primary.name, step=step, path=url,
                    tokens=tokens or 0, blocking_s=round(blocking_s, 4),
                    save_s=round(blocking_s + time.perf_counter() - t0, 4), bytes=size)
        self.log(f"checkpoint step {step} committed ({primary.name}): {size / 2**20:.1f} MiB")
        if self.uploader is not None:
            self.uploader.submit(step)
        self._prune(step)
        return True

    def _prune(self, step: int) -> None:
        from trainer.checkpoint import layout

        primary = self.store.primary
        keep_every = None if self.store.tiered else self.cfg.keep_every
        protect = {step} | (self.uploader.pending if self.uploader is not None else set())
        try:
            plan = layout.plan_prune(primary.root, self.cfg.keep_last, keep_every,
                                     protect=protect, fs=primary.fs, trust=self.store.trust)
            removed = layout.execute_prune(plan, primary.fs)
        except Exception as exc:  # noqa: BLE001 - retried after the next commit
            self.log(f"pruning {primary.root} failed: {exc}")
            return
        if removed:
            self.report("checkpoint_pruned", tier=primary.name, steps=removed, failing=[])

    def newest(self) -> tuple[int, str] | None:
        """The newest committed checkpoint that verifies (fetched from the remote tier when
        only it holds one), as (step, local path); None to start afresh."""
        found = self.store.select(max_step=self.max_step, log=self.log)
        if found is None:
            return None
        from trainer.checkpoint import layout

        if self.rank == 0:
            self.report("resumed", step=found.step, path=found.url, tier=found.tier)
        return found.step, layout.filesystem(found.url)[1]

    def close(self) -> None:
        if self.uploader is not None:
            self.uploader.close(timeout=600)


def _log(line: str) -> None:
    print(f"[orchestrator] {line}", flush=True)
