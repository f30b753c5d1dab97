"""The background uploader: local tier -> remote tier, one committed checkpoint at a time.

For each step: verify the local copy, its signature included (a file that rotted or was
changed since its commit is not copied),
clear the remote step directory (debris of an upload killed midway), copy every file, check
the remote sizes, then write the manifest: that one PUT commits the remote copy. Each request
is retried on throttling, 5xx and dropped connections (``retry``); a permanent error or spent
retries leave the remote copy uncommitted and are reported. Training never waits for this
thread; only ``close()`` at the end of the job does, bounded by the retry policy.

When saves come faster than uploads, a queued step that a newer one supersedes is skipped,
unless the retention rule keeps it forever (``keep_every``). Steps queued or in flight are
``pending``: the local tier's pruning must leave them alone.
"""

from __future__ import annotations

import concurrent.futures
import os
import posixpath
import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.checkpoint import fence, layout, signing
from trainer.checkpoint.retry import describe, retrying
from trainer.checkpoint.store import Tier

Report = Callable[..., None]


class UploadError(RuntimeError):
    """An upload that cannot succeed as things stand (a corrupt local copy, a size mismatch)."""


class Uploader:
    """Rank 0's background copier from the local tier to the remote one (see the module)."""

    def __init__(self, local: Tier, remote: Tier, *, keep_last: int, keep_every: int | None,
                 attempts: int, backoff_s: float, backoff_max_s: float, report: Report,
                 log: Callable[[str], None],
                 trust: signing.Trust | Callable[[], signing.Trust | None] | None = None,
                 ) -> None:
        self.local = local
        self._trust = trust
        self.remote = remote
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.report = report
        self.log = log
        self._attempts = attempts
        self._backoff = (backoff_s, backoff_max_s)
        self._lock = threading.Lock()
        self._queued: list[int] = []
        self._in_flight: int | None = None
        self._futures: list[concurrent.futures.Future] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "ckpt-upload")
        self.uploaded: list[int] = []
        self.failed: list[int] = []
        self.fenced: list[int] = []
        # This rank's fencing token: a remote root claimed by a newer generation is not
        # written to (the checkpointer hands over its store's).
        self.fence = fence.Fence()

    @property
    def trust(self) -> signing.Trust | None:
        """The job's key (the checkpointer hands over its store's when none was given)."""
        if callable(self._trust):
            self._trust = self._trust()
        return self._trust

    def use_trust(self, trust: signing.Trust | Callable[[], signing.Trust | None]) -> None:
        if self._trust is None:
            self._trust = trust

    @property
    def pending(self) -> set[int]:
        """Steps queued or being uploaded (protected from local pruning)."""
        with self._lock:
            return set(self._queued) | ({self._in_flight} if self._in_flight is not None
                                        else set())

    def submit(self, step: int) -> None:
        """Queue a locally committed step for upload (returns at once)."""
        with self._lock:
            if step in self._queued or step == self._in_flight:
                return
            self._queued.append(step)
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self._executor.submit(self._next))

    def _next(self) -> None:
        with self._lock:
            if not self._queued:
                return
            step = self._queued.pop(0)
            newer = [s for s in self._queued if s > step]
            kept_forever = bool(self.keep_every) and step % self.keep_every == 0
            if newer and not kept_forever:
                self.log(f"upload of checkpoint step {step} skipped: step {max(newer)} "
                         "supersedes it")
                self.report("checkpoint_upload_skipped", step=step, superseded_by=max(newer))
                return
            self._in_flight = step
        try:
            self._upload(step)
        finally:
            with self._lock:
                self._in_flight = None

    def _upload(self, step: int) -> None:
        src, dst = self.local.step_url(step), self.remote.step_url(step)
        t0 = time.perf_counter()
        retries = 0

        def on_retry(attempt: int, exc: BaseException, sleep_s: float) -> None:
            nonlocal retries
            retries += 1
            self.log(f"upload of checkpoint step {step}: attempt {attempt} failed "
                     f"({describe(exc)}); retrying in {sleep_s:.1f} s")
            self.report("checkpoint_upload_retry", step=step, attempt=attempt,
                        error=describe(exc), sleep_s=round(sleep_s, 3))

        retry = retrying(self._attempts, *self._backoff, on_retry=on_retry)
        try:
            check = layout.verify(src, fs=self.local.fs, trust=self.trust)
            if not check.ok or check.manifest is None:
                raise UploadError(f"local copy fails verification: {'; '.join(check.problems)}")
            manifest = check.manifest
            retry(lambda: layout.remove(dst, self.remote.fs))
            _, src_path = layout.filesystem(src, self.local.fs)
            _, dst_path = layout.filesystem(dst, self.remote.fs)
            with layout.StepReader(self.local.fs, src_path) as reader:
                for rel in sorted(manifest["files"]):
                    remote_file = posixpath.join(dst_path, rel)
                    if not layout.is_remote(dst):  # a shared filesystem as the durable tier
                        self.remote.fs.makedirs(posixpath.dirname(remote_file), exist_ok=True)
                    retry(lambda: self._put(reader, src_path, rel, remote_file))  # noqa: B023
            sizes = retry(lambda: self._remote_sizes(dst_path, manifest))
            if sizes:
                raise UploadError(f"remote copy differs after upload: {'; '.join(sizes)}")
            retry(lambda: fence.check_claim(self.remote.fs, self.remote.root, self.fence))
            retry(lambda: layout.write_manifest(dst, manifest, self.remote.fs))
        except fence.Fenced as exc:  # deposed: the remote copy stays uncommitted
            self.fenced.append(step)
            self.report("checkpoint_fenced", step=step, path=dst, error=str(exc)[:500])
            self.log(f"upload of checkpoint step {step} NOT committed: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - reported; the local copy stays the restore point
            self.failed.append(step)
            self.report("checkpoint_upload_failed", step=step, path=dst, error=describe(exc),
                        retries=retries)
            self.log(f"upload of checkpoint step {step} to {dst} FAILED after {retries} "
                     f"retries: {describe(exc)}; the local copy stays committed")
            return
        upload_s = time.perf_counter() - t0
        size = sum(f["size"] for f in manifest["files"].values())
        self.uploaded.append(step)
        self.report("checkpoint_committed", tier=self.remote.name, via="upload", step=step,
                    path=dst,
                    tokens=manifest.get("tokens"), bytes=size, upload_s=round(upload_s, 4),
                    retries=retries)
        self.log(f"checkpoint step {step} uploaded to {dst}: {size / 2**20:.1f} MiB in "
                 f"{upload_s:.2f} s ({retries} retries)")
        self._prune(step, retry)

    def _put(self, reader: layout.StepReader, src_path: str, rel: str, remote_file: str,
             ) -> None:
        """Upload one verified file. A local one is opened without following a link and
        handed over as ``/proc/self/fd/N``: the file checked is the file sent, even if its
        name is swapped for a link meanwhile."""
        if reader.local is not None and os.path.isdir("/proc/self/fd"):
            with reader.open(rel) as f:
                self.remote.fs.put_file(f"/proc/self/fd/{f.fileno()}", remote_file)
            return
        self.remote.fs.put_file(posixpath.join(src_path, rel), remote_file)

    def _remote_sizes(self, dst_path: str, manifest: dict[str, Any]) -> list[str]:
        problems = []
        for rel, meta in sorted(manifest["files"].items()):
            size = self.remote.fs.size(posixpath.join(dst_path, rel))
            if size != meta["size"]:
                problems.append(f"{rel}: size {size} != {meta['size']}")
        return problems

    def _prune(self, step: int, retry: Callable[[Callable[[], Any]], Any]) -> None:
        try:
            plan = retry(lambda: layout.plan_prune(self.remote.root, self.keep_last,
                                                   self.keep_every, protect={step},
                                                   fs=self.remote.fs, trust=self.trust))
            removed = retry(lambda: layout.execute_prune(plan, self.remote.fs))
        except Exception as exc:  # noqa: BLE001 - old checkpoints linger; the next prune retries
            self.log(f"pruning {self.remote.root} failed: {describe(exc)}")
            return
        if plan.failing:
            self.log(f"{self.remote.root}: checkpoint(s) {sorted(plan.failing)} fail "
                     "verification: not counted toward keep_last, left in place: "
                     + "; ".join(f"step {s}: {p[0]}" for s, p in sorted(plan.failing.items())))
        if removed or plan.failing:
            self.report("checkpoint_pruned", tier=self.remote.name, steps=removed,
                        failing=sorted(plan.failing))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued upload has finished; False on timeout."""
        with self._lock:
            futures = list(self._futures)
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def close(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` for queued uploads, then stop; one still running is left
        to die with the process (its remote copy stays uncommitted)."""
        finished = self.wait(timeout)
        self._executor.shutdown(wait=finished, cancel_futures=not finished)
        return finished
