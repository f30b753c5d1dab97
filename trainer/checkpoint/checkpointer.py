"""Saving and restoring with torch.distributed.checkpoint (DCP), committed by a manifest.

A save stages the state (a copy, so training can go on mutating it) and writes it in DCP's
background thread over a dedicated gloo group; training blocks only for the staging. When
rank 0's future completes, every rank's files and DCP's ``.metadata`` are written (DCP
gathers all ranks' write results before finishing), so rank 0 then checksums the files and
writes ``manifest.json`` last: the commit. At most one save is in flight.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import layout
from trainer.config import CheckpointConfig

Report = Callable[..., None]  # report(event_name, **data): the worker SDK's event()


@dataclass
class _Pending:
    step: int
    url: str
    tokens: int
    started: float
    blocking_s: float
    future: concurrent.futures.Future
    finalized: concurrent.futures.Future | None = None


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, job_root: str, *, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, meta: dict[str, Any], report: Report,
                 log: Callable[[str], None], device_type: str = "cpu") -> None:
        self.cfg = cfg
        self.job_root = job_root
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.meta = meta
        self.report = report
        self.log = log
        self.device_type = device_type
        self._pending: _Pending | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "ckpt-commit")
        self._writer_cache: dict[str, Any] = {}
        self.last_committed: int | None = None
        self.restored_url: str | None = None

    # -- saving ----------------------------------------------------------------------------
    def _writer(self, url: str) -> Any:
        if _is_remote(url):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(url, sync_files=False)
        # On CUDA, staging into cached pinned buffers makes the blocking part a memcpy
        # (pinning fails without an accelerator, so CPU runs use plain staging copies).
        return dcp.FileSystemWriter(layout.filesystem(url)[1],
                                    cache_staged_state_dict=self.device_type == "cuda")

    def save(self, step: int, state: dict[str, Any], tokens: int) -> float:
        """Start saving ``state`` as step ``step``; returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight: the previous one must be committed first
        url = layout.step_url(self.job_root, step)
        if self.rank == 0:
            self._clear_debris(url)
        if self.group is not None:
            dist.barrier(group=self.group)
        writer = self._writer(url)
        if self.cfg.async_save:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        else:
            future = concurrent.futures.Future()
            future.set_result(dcp.save(state, storage_writer=writer, process_group=self.group))
        blocking = time.perf_counter() - t0
        pending = _Pending(step, url, tokens, t0, blocking, future)
        if self.rank == 0:
            finalized: concurrent.futures.Future = concurrent.futures.Future()
            pending.finalized = finalized
            future.add_done_callback(
                lambda f: self._executor.submit(self._finalize, pending, finalized))
        self._pending = pending
        return blocking

    def _clear_debris(self, url: str) -> None:
        """A save killed midway may have left files for this step: never mix them in."""
        fs, path = layout.filesystem(url)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def _finalize(self, p: _Pending, done: concurrent.futures.Future) -> None:
        """Rank 0, off the training thread: checksum, write the manifest, prune."""
        try:
            p.future.result()
            save_s = time.perf_counter() - p.started
            manifest = layout.build_manifest(
                p.url, step=p.step, tokens=p.tokens, world_size=self.world_size,
                wall_time_s=round(save_s, 4), blocking_s=round(p.blocking_s, 4),
                state=self.meta.get("state_layout", {}),
                **{k: v for k, v in self.meta.items() if k != "state_layout"})
            layout.write_manifest(p.url, manifest)
            self.last_committed = p.step
            size = sum(f["size"] for f in manifest["files"].values())
            self.report("checkpoint_committed", step=p.step, path=p.url, tokens=p.tokens,
                        blocking_s=round(p.blocking_s, 4), save_s=round(save_s, 4),
                        bytes=size)
            self.log(f"checkpoint step {p.step} committed: {size / 2**20:.1f} MiB in "
                     f"{save_s:.2f} s (training blocked {p.blocking_s * 1000:.0f} ms)")
            removed = layout.prune(self.job_root, self.cfg.keep_last, protect={p.step})
            if removed:
                self.report("checkpoint_pruned", steps=removed)
            done.set_result(p.step)
        except Exception as exc:  # the save failed: report, keep training, keep the old ones
            self.report("checkpoint_failed", step=p.step, error=f"{type(exc).__name__}: {exc}")
            self.log(f"checkpoint step {p.step} FAILED: {type(exc).__name__}: {exc}")
            done.set_result(None)

    def poll(self) -> None:
        """Forget a save once it has finished (cheap; call every step)."""
        p = self._pending
        if p is not None and p.future.done() and (p.finalized is None or p.finalized.done()):
            self._raise_if_failed(p)
            self._pending = None

    def wait(self) -> None:
        """Block until the in-flight save (if any) is written and committed."""
        p = self._pending
        if p is None:
            return
        try:
            p.future.result()
        except Exception:
            pass  # reported by _finalize on rank 0; other ranks just go on
        if p.finalized is not None:
            p.finalized.result()
        self._pending = None

    @staticmethod
    def _raise_if_failed(p: _Pending) -> None:
        exc = p.future.exception()
        if exc is not None and p.finalized is None:  # rank != 0: nothing else reports it
            print(f"checkpoint step {p.step}: write failed on this rank: {exc}", flush=True)

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, state: dict[str, Any], max_step: int | None = None) -> dict[str, Any] | None:
        """Load the newest committed, verified checkpoint (<= ``max_step``) into ``state``.

        Rank 0 chooses and verifies, then tells the others, so every rank loads the same one.
        Returns its manifest, or None when there is none (a fresh start).
        """
        choice: list[Any] = [None]
        if self.rank == 0:
            def skipped(info: layout.CheckpointInfo, problems: list[str]) -> None:
                self.log(f"checkpoint step {info.step} at {info.url} fails verification, "
                         f"skipped: {'; '.join(problems)}")
                self.report("checkpoint_skipped", step=info.step, path=info.url,
                            problems=problems)

            found = layout.newest_verified(self.job_root, max_step=max_step,
                                           checksums=self.cfg.verify_on_load, on_skip=skipped)
            choice = [None if found is None else (found[0].url, found[1])]
        if self.group is not None:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[0] is None:
            return None
        url, manifest = choice[0]
        if _is_remote(url):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader: Any = FsspecReader(url)
        else:
            reader = dcp.FileSystemReader(layout.filesystem(url)[1])
        dcp.load(state, storage_reader=reader, process_group=self.group)
        self.last_committed = manifest["step"]
        self.restored_url = url
        return manifest

