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

Verification includes the manifest's signature under the store's ``trust`` (the job's key,
``signing``): a remote manifest that is not signed with it, or that names a file outside its
step directory, is refused before anything is fetched or written.

No torch here: the CLI lists, verifies and prunes through the same code.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from trainer.checkpoint import layout, signing
from trainer.checkpoint.fence import Fence
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
_COPY_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Refusal:
    """A checkpoint passed over by ``select``: its step, tier, signature outcome, problems."""

    step: int
    tier: str
    signature: str
    problems: tuple[str, ...]
    key_id: str | None = None  # the key the manifest says signed it


def _key_id(manifest: dict[str, Any] | None) -> str | None:
    sig = (manifest or {}).get(signing.SIGNATURE)
    return sig.get("key_id") if isinstance(sig, dict) else None


def same_checkpoint(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Two manifests describe the same checkpoint: same step, files, sizes and checksums."""
    return a is not None and b is not None and a.get("step") == b.get("step") \
        and a.get("files") == b.get("files")


class CheckpointStore:
    """The tiers of one job: ``primary`` (saves land here) and an optional ``remote``."""

    def __init__(self, primary: Tier, remote: Tier | None = None,
                 retry: Callable[[Callable[[], Any]], Any] = no_retry,
                 trust: signing.Trust | Callable[[], signing.Trust] | None = None,
                 fence: Fence | None = None) -> None:
        self.primary = primary
        self.remote = remote
        self.retry = retry  # wraps each remote request (transient errors retried)
        self._trust = trust
        # The reader's generation and lineage: a deposed generation's checkpoint is refused.
        self.fence = fence or Fence()
        self.refused: list[Refusal] = []  # what the last ``select`` passed over

    @property
    def trust(self) -> signing.Trust | None:
        """The key checkpoints are signed and verified with (loaded on first use: only the
        rank that commits and chooses reads it)."""
        if callable(self._trust):
            self._trust = self._trust()
        return self._trust

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
        returned ``Choice`` points at the local copy. What it passes over is in ``refused``.
        """
        self.refused = []
        listings = self._listings(log)
        steps = sorted({s for found in listings.values() for s in found}, reverse=True)
        for step in steps:
            if max_step is not None and step > max_step:
                continue
            holders = [t for t in self.tiers if step in listings[t.name]]
            for tier in self._order(step, holders):
                info = listings[tier.name][step]
                outcome, manifest = signing.UNCHECKED, None
                if info.problem:
                    choice, problems = None, [info.problem]
                elif tier is self.remote and self.tiered:
                    try:
                        choice, problems, outcome, manifest = self._fetch(step, checksums, log)
                    except Exception as exc:  # noqa: BLE001 - retries spent: try older ones
                        choice, problems = None, [f"fetch failed: {type(exc).__name__}: {exc}"]
                else:
                    result = layout.verify(info.url, checksums=checksums, fs=tier.fs,
                                           trust=self.trust)
                    fenced = fenced_problems(self.fence, result.manifest)
                    choice = Choice(step, tier.name, info.url, result.manifest) \
                        if result.ok and result.manifest is not None and not fenced else None
                    problems, outcome, manifest = fenced + result.problems, result.signature, \
                        result.manifest
                if choice is not None:
                    return choice
                self.refused.append(Refusal(step, tier.name, outcome, tuple(problems),
                                            _key_id(manifest)))
                if on_skip is not None:
                    on_skip(tier.name, info, problems)
        return None

    def newest_committed(self, max_step: int | None = None,
                         log: Callable[[str], None] = print) -> int | None:
        """The newest step with a manifest in either tier (<= ``max_step``), unverified: the
        floor a memory-tier copy must reach (a listing, no file is read)."""
        steps = [s for found in self._listings(log).values() for s in found
                 if max_step is None or s <= max_step]
        return max(steps, default=None)

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
               ) -> tuple[Choice | None, list[str], str, dict[str, Any] | None]:
        """Copy the remote step into the primary tier and verify it there; commit it locally
        only when it verifies (a failed fetch leaves no committed local copy).

        The remote manifest is checked first: its signature, and every entry a plain
        relative path (a key under the step's prefix), so a manifest naming ``../x`` or an
        absolute path is refused before anything is read or written. Files are created
        fresh inside the new local step directory, never through a link.
        """
        assert self.remote is not None
        src, dst = self.remote.step_url(step), self.primary.step_url(step)
        manifest = self.retry(lambda: layout.read_manifest(src, self.remote.fs))
        if manifest is None:
            return None, [f"{layout.MANIFEST}: missing or unreadable"], signing.UNCHECKED, None
        problems = layout.manifest_problems(manifest)
        outcome, denied = layout.authenticate(manifest, self.trust)
        if denied:
            problems.insert(0, denied)
        problems[:0] = fenced_problems(self.fence, manifest if not denied else None)
        if problems:
            return None, problems, outcome, manifest
        t0 = time.perf_counter()
        layout.remove(dst, self.primary.fs)
        _, src_path = layout.filesystem(src, self.remote.fs)
        _, dst_path = layout.filesystem(dst, self.primary.fs)
        self.primary.fs.makedirs(dst_path, exist_ok=True)
        missing = []
        with layout.StepReader(self.remote.fs, src_path) as reader:
            for rel in sorted(manifest["files"]):
                try:
                    self.retry(lambda: self._copy_in(reader, rel, dst_path))  # noqa: B023
                except (FileNotFoundError, layout.Unsafe) as exc:
                    missing.append(str(exc) if isinstance(exc, layout.Unsafe)
                                   else f"{rel}: missing")
        if missing:
            layout.remove(dst, self.primary.fs)
            return None, missing, outcome, manifest
        layout.write_manifest(dst, manifest, self.primary.fs)
        result = layout.verify(dst, checksums=checksums, fs=self.primary.fs, trust=self.trust)
        if not result.ok:
            layout.remove(dst, self.primary.fs)  # never leave a bad copy committed locally
            return None, result.problems, result.signature, manifest
        size = sum(f.get("size", 0) for f in manifest["files"].values())
        log(f"fetched checkpoint step {step} from {src} into {dst}: {size / 2**20:.1f} MiB in "
            f"{time.perf_counter() - t0:.2f} s")
        return Choice(step, self.primary.name, dst, manifest, fetched_from=src), [], \
            result.signature, manifest

    def reject(self, choice: Choice, everywhere: bool) -> list[str]:
        """Uncommit a copy that verified but did not load: its manifest becomes
        ``REJECTED`` (kept for the operator, never read as a commit), so no restart picks
        it again. The copy read, and with ``everywhere`` every tier's copy of the same
        checkpoint (the same files and digests: the content itself does not load). Returns
        the step URLs uncommitted."""
        done = []
        for tier in self.tiers:
            url = tier.step_url(choice.step)
            if url != choice.url and url != choice.fetched_from:
                if not everywhere or not same_checkpoint(
                        layout.read_manifest(url, tier.fs), choice.manifest):
                    continue
            elif url == choice.fetched_from and not everywhere:
                continue
            if uncommit(url, tier.fs):
                done.append(url)
        return done

    def _copy_in(self, reader: layout.StepReader, rel: str, dst_path: str) -> None:
        """One remote file into the new local step directory (``rel`` already checked)."""
        if not layout.is_local(self.primary.fs):
            target = posixpath.join(dst_path, rel)
            with reader.open(rel) as src, self.primary.fs.open(target, "wb") as out:
                shutil.copyfileobj(src, out, _COPY_CHUNK)
            return
        target = os.path.join(dst_path, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        with reader.open(rel) as src, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, _COPY_CHUNK)


REJECTED = "manifest.rejected.json"


def uncommit(step_url: str, fs: fsspec.AbstractFileSystem | None = None) -> bool:
    """Rename a step's manifest to ``REJECTED`` (the step is no longer committed); False
    when it had none. A local step directory that is a link is not followed."""
    fs, path = layout.filesystem(step_url, fs)
    src, dst = posixpath.join(path, layout.MANIFEST), posixpath.join(path, REJECTED)
    if layout.is_local(fs):
        if layout.step_dir_problem(path) is not None or not os.path.lexists(src):
            return False
        os.replace(src, dst)
        return True
    if not fs.exists(src):
        return False
    fs.copy(src, dst)
    fs.rm(src)
    return True


def fenced_problems(fence: Fence, manifest: dict[str, Any] | None) -> list[str]:
    """``[why]`` when ``fence`` refuses the checkpoint of ``manifest`` (one written by a
    deposed generation, ``trainer.checkpoint.fence``), else ``[]``. Only a manifest whose
    signature verified carries a generation worth reading."""
    refusal = fence.refusal(manifest)
    return [refusal] if refusal else []


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
    signature: str | None = None  # signing.SIGNED, UNSIGNED, FORGED, NO_KEY; None: uncommitted


def describe(root: str, checksums: bool = False, tier: str | None = None,
             trust: signing.Trust | None = None) -> list[Row]:
    """Every step directory under a job root with its size, age and verification (the
    signature under ``trust``; None checks integrity only)."""
    t = Tier.at(root, tier)
    rows = []
    for info in layout.list_checkpoints(t.root, t.fs):
        if info.problem:
            rows.append(Row(info.step, t.name, info.url, True, None, None, False,
                            (info.problem,), signing.UNCHECKED))
            continue
        if not info.committed:
            rows.append(Row(info.step, t.name, info.url, False, None, None, None,
                            ("uncommitted: no manifest (a save or upload that did not finish)",)))
            continue
        result = layout.verify(info.url, checksums=checksums, fs=t.fs, trust=trust)
        m = result.manifest or {}
        files = m.get("files") if isinstance(m.get("files"), dict) else {}
        size = sum(f.get("size", 0) for f in files.values()
                   if isinstance(f, dict) and isinstance(f.get("size"), int)) or None
        created = m.get("created") if isinstance(m.get("created"), int | float) else None
        rows.append(Row(info.step, t.name, info.url, True, size, created, result.ok,
                        tuple(result.problems), result.signature))
    return rows


def trust_refusals(refused: list[Refusal], trust: signing.Trust | None) -> list[Refusal]:
    """The refusals that are about the key rather than the checkpoint: unsigned ones (not
    trusted), signed ones with no key to check, and ones signed with another key. When
    nothing verifies and some are these, the operator has the wrong key, not bad data."""
    mine = trust.key_id if trust is not None else None
    return [r for r in refused if r.signature in (signing.UNSIGNED, signing.NO_KEY)
            or (r.signature == signing.FORGED and r.key_id is not None and r.key_id != mine)]


def default_trust(cfg: Any, root: str) -> Callable[[], signing.Trust]:
    """The job's trust, loaded when first needed. A rank its node agent runs holds no key:
    the agent signs and checks for it (``orchestrator.worker.keyclient``). Any other
    process (``python -m trainer`` alone, a tool) uses the key from the environment, else
    the one beside the primary tier's root (created by the first writer, ``signing``)."""
    def load() -> signing.Trust:
        trust_unsigned = bool(getattr(cfg, "trust_unsigned", False))
        signer = agent_signer(os.environ)
        if signer is not None:
            return signing.Trust(None, trust_unsigned, "the node agent", signer=signer)
        return signing.trust_from(cfg.local_url or root, create=True,
                                  trust_unsigned=trust_unsigned)
    return load


def agent_signer(env: Any) -> signing.Signer | None:
    """The node agent's key service for this rank, when a node agent runs it."""
    from orchestrator.contracts import env as ec

    agent = ec.AgentEnv.from_env(env)
    if not agent.managed or agent.agent_socket is None:
        return None
    from orchestrator.worker.keyclient import AgentSigner

    return AgentSigner(agent.agent_socket, ec.get_int(env, "RANK", 0, minimum=0) or 0)


def open_store(cfg: Any, job: str, root: str,
               retry: Callable[[Callable[[], Any]], Any] = no_retry,
               trust: signing.Trust | None = None, fence: Fence | None = None,
               ) -> CheckpointStore:
    """The tiers of ``job`` from a ``CheckpointConfig``: ``root`` (the checkpoint root the
    supervisor hands out) is the only tier, or the remote one when ``cfg.local_url`` is set.
    ``trust`` defaults to the job's key, read on first use (``default_trust``); ``fence``
    (the generation and lineage of the reader) refuses a deposed generation's checkpoints."""
    main = layout.job_url(root, job)
    key = trust if trust is not None else default_trust(cfg, root)
    if cfg.local_url:
        return CheckpointStore(Tier.at(layout.job_url(cfg.local_url, job), LOCAL),
                               Tier.at(main, REMOTE), retry, key, fence)
    return CheckpointStore(Tier.at(main), None, retry, key, fence)


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
