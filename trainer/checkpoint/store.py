"""Checkpoint tiers: where checkpoints live, which one a restart loads, and fetching it.

A job has one tier (a local path, a shared filesystem, or ``s3://``) or two: a local tier
(NVMe, FSx) that saves commit to first, and a remote tier (``s3://``) that the background
uploader (``upload``) copies each committed checkpoint to, manifest last. A restart loads the
newest checkpoint committed in either tier that verifies:

- the local copy first when both tiers hold the step and their manifests list the same files
  and checksums; when they differ (another run wrote one of them), the newer manifest;
- a remote copy is fetched into the local tier (files, then the manifest) and verified there,
  so it is read once and the next restart finds it locally;
- a copy that fails verification is reported (``on_skip``) and passed over, then the other
  tier's copy of the step, then older steps: a corrupt checkpoint costs progress, never a loop.

No torch here: the CLI lists, verifies and prunes through the same code.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from trainer.checkpoint import layout
from trainer.checkpoint.retry import no_retry

LOCAL, REMOTE = "local", "remote"

# The uploader's own retry loop (tenacity) decides how long to keep trying; one s3fs attempt
# and botocore's "standard" mode with 3 attempts (throttle-aware backoff) keep the inner
# layers from multiplying it: s3fs's defaults turn one failing PUT into 25 requests and 40 s.
_S3_OPTIONS = {"config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"},
                                 "connect_timeout": 10, "read_timeout": 120}}
_S3FS_RETRIES = 1  # s3fs's own loop (a class attribute, not a constructor option)


def tier_of(url: str) -> str:
    """``remote`` for an object store or other URL, ``local`` for a path or ``file://``."""
    return REMOTE if layout.is_remote(url) else LOCAL


def open_filesystem(url: str) -> fsspec.AbstractFileSystem:
    """A filesystem for a tier: for S3, with the bounded inner retries described above."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    if protocol in ("s3", "s3a"):
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **_S3_OPTIONS)
        fs.retries = _S3FS_RETRIES
        return fs
    return fsspec.core.url_to_fs(url)[0]


@dataclass(frozen=True)
class Tier:
    """One tier: its name and the job's root in it (``<root>/<job>``)."""

    name: str
    root: str
    fs: fsspec.AbstractFileSystem

    @classmethod
    def at(cls, root: str, name: str | None = None) -> Tier:
        return cls(name or tier_of(root), root, open_filesystem(root))

    def step_url(self, step: int) -> str:
        return layout.step_url(self.root, step)

    def committed(self) -> dict[int, layout.CheckpointInfo]:
        return {c.step: c for c in layout.list_checkpoints(self.root, self.fs) if c.committed}


@dataclass(frozen=True)
class Choice:
    """The checkpoint a restart loads: its step, the tier and URL it is read from."""

    step: int
    tier: str
    url: str
    manifest: dict[str, Any]
    fetched_from: str | None = None  # the remote URL, when it was fetched into the local tier


Skip = Callable[[str, layout.CheckpointInfo, list[str]], None]  # (tier, info, problems)


def same_checkpoint(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Two manifests describe the same checkpoint: same step, files, sizes and checksums."""
    return a is not None and b is not None and a.get("step") == b.get("step") \
        and a.get("files") == b.get("files")


class CheckpointStore:
    """The tiers of one job: ``primary`` (saves land here) and an optional ``remote``."""

    def __init__(self, primary: Tier, remote: Tier | None = None,
                 retry: Callable[[Callable[[], Any]], Any] = no_retry) -> None:
        self.primary = primary
        self.remote = remote
        self.retry = retry  # wraps each remote request (transient errors retried)

    @property
    def tiers(self) -> list[Tier]:
        return [self.primary] + ([self.remote] if self.remote is not None else [])

    @property
    def tiered(self) -> bool:
        return self.remote is not None

    def _order(self, step: int, holders: list[Tier]) -> list[Tier]:
        if len(holders) < 2:
            return holders
        manifests = [layout.read_manifest(t.step_url(step), t.fs) for t in holders]
        if same_checkpoint(*manifests) or None in manifests:
            return holders  # primary (local) first
        created = [float((m or {}).get("created") or 0) for m in manifests]
        return [t for _, t in sorted(zip(created, holders, strict=True), key=lambda p: -p[0])]

    def select(self, max_step: int | None = None, checksums: bool = True,
               on_skip: Skip | None = None, log: Callable[[str], None] = print,
               ) -> Choice | None:
        """The newest committed checkpoint (<= ``max_step``) that verifies, in either tier.

        With two tiers, a remote choice is fetched into the primary tier first and the
        returned ``Choice`` points at the local copy.
        """
        listings = self._listings(log)
        steps = sorted({s for found in listings.values() for s in found}, reverse=True)
        for step in steps:
            if max_step is not None and step > max_step:
                continue
            holders = [t for t in self.tiers if step in listings[t.name]]
            for tier in self._order(step, holders):
                info = listings[tier.name][step]
                if tier is self.remote and self.tiered:
                    try:
                        choice, problems = self._fetch(step, checksums, log)
                    except Exception as exc:  # noqa: BLE001 - retries spent: try older ones
                        choice, problems = None, [f"fetch failed: {type(exc).__name__}: {exc}"]
                else:
                    result = layout.verify(info.url, checksums=checksums, fs=tier.fs)
                    choice = Choice(step, tier.name, info.url, result.manifest) \
                        if result.ok and result.manifest is not None else None
                    problems = result.problems
                if choice is not None:
                    return choice
                if on_skip is not None:
                    on_skip(tier.name, info, problems)
        return None

    def _listings(self, log: Callable[[str], None]) -> dict[str, dict[int, Any]]:
        """Committed steps per tier. An unreachable remote tier (retries spent) leaves the
        choice to the local tier instead of failing the restart."""
        listings: dict[str, dict[int, Any]] = {self.primary.name: self.primary.committed()}
        if self.remote is not None:
            try:
                listings[self.remote.name] = self.retry(self.remote.committed)
            except Exception as exc:  # noqa: BLE001 - logged; the local tier still restores
                log(f"remote tier {self.remote.root} unreachable ({type(exc).__name__}: "
                    f"{exc}): choosing from the local tier only")
                listings[self.remote.name] = {}
        return listings

    def _fetch(self, step: int, checksums: bool, log: Callable[[str], None],
               ) -> tuple[Choice | None, list[str]]:
        """Copy the remote step into the primary tier and verify it there; commit it locally
        only when it verifies (a failed fetch leaves no committed local copy)."""
        assert self.remote is not None
        src, dst = self.remote.step_url(step), self.primary.step_url(step)
        manifest = self.retry(lambda: layout.read_manifest(src, self.remote.fs))
        if manifest is None or manifest.get("format") != layout.FORMAT:
            return None, [f"{layout.MANIFEST}: missing, unreadable or of an unknown format"]
        t0 = time.perf_counter()
        layout.remove(dst, self.primary.fs)
        _, src_path = layout.filesystem(src, self.remote.fs)
        _, dst_path = layout.filesystem(dst, self.primary.fs)
        self.primary.fs.makedirs(dst_path, exist_ok=True)
        missing = []
        for rel in sorted(manifest.get("files") or {}):
            target = posixpath.join(dst_path, rel)
            self.primary.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            source = posixpath.join(src_path, rel)
            try:
                self.retry(lambda: self.remote.fs.get_file(source, target))  # noqa: B023
            except FileNotFoundError:
                missing.append(f"{rel}: missing")
        if missing:
            layout.remove(dst, self.primary.fs)
            return None, missing
        layout.write_manifest(dst, manifest, self.primary.fs)
        result = layout.verify(dst, checksums=checksums, fs=self.primary.fs)
        if not result.ok:
            layout.remove(dst, self.primary.fs)  # never leave a bad copy committed locally
            return None, result.problems
        size = sum(f.get("size", 0) for f in manifest["files"].values())
        log(f"fetched checkpoint step {step} from {src} into {dst}: {size / 2**20:.1f} MiB in "
            f"{time.perf_counter() - t0:.2f} s")
        return Choice(step, self.primary.name, dst, manifest, fetched_from=src), []


@dataclass(frozen=True)
class Row:
    """One checkpoint in one tier, as ``orchestrator checkpoints list`` shows it."""

    step: int
    tier: str
    url: str
    committed: bool
    size: int | None
    created: float | None
    verified: bool | None  # None: not committed, so nothing to verify
    problems: tuple[str, ...] = ()


def describe(root: str, checksums: bool = False, tier: str | None = None) -> list[Row]:
    """Every step directory under a job root with its size, age and verification."""
    t = Tier.at(root, tier)
    rows = []
    for info in layout.list_checkpoints(t.root, t.fs):
        if not info.committed:
            rows.append(Row(info.step, t.name, info.url, False, None, None, None,
                            ("uncommitted: no manifest (a save or upload that did not finish)",)))
            continue
        result = layout.verify(info.url, checksums=checksums, fs=t.fs)
        m = result.manifest or {}
        size = sum(f.get("size", 0) for f in (m.get("files") or {}).values()) or None
        rows.append(Row(info.step, t.name, info.url, True, size, m.get("created"), result.ok,
                        tuple(result.problems)))
    return rows


def open_store(cfg: Any, job: str, root: str,
               retry: Callable[[Callable[[], Any]], Any] = no_retry) -> CheckpointStore:
    """The tiers of ``job`` from a ``CheckpointConfig``: ``root`` (the checkpoint root the
    supervisor hands out) is the only tier, or the remote one when ``cfg.local_url`` is set."""
    main = layout.job_url(root, job)
    if cfg.local_url:
        return CheckpointStore(Tier.at(layout.job_url(cfg.local_url, job), LOCAL),
                               Tier.at(main, REMOTE), retry)
    return CheckpointStore(Tier.at(main), None, retry)


def resolve(url: str) -> tuple[str, int | None]:
    """A URL the CLI was given, as (job root, step): a step directory names one checkpoint
    (step set); anything else is a job root (step None). A checkpoint root holding job
    folders instead of step directories is refused with the job URLs to use."""
    step = layout.parse_step_dir(url)
    if step is not None:
        parent = url.rstrip("/").rsplit("/", 1)[0]
        return parent, step
    fs, path = layout.filesystem(url)
    if layout.list_checkpoints(url, fs):
        return url, None
    try:
        children = [posixpath.basename(e.rstrip("/")) for e in fs.ls(path, detail=False)]
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: no such directory or prefix") from None
    jobs = [c for c in children
            if layout.list_checkpoints(url.rstrip("/") + "/" + c, fs)]
    if jobs:
        raise ValueError(f"{url} holds the checkpoints of job(s) {', '.join(sorted(jobs))}: "
                         f"pass {url.rstrip('/')}/<job>")
    return url, None
