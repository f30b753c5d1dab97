"""Checkpoint layout, manifests and verification (fsspec, no torch: the CLI uses it too).

``<root>/<job>/step-<8 digits>/`` holds the DCP files, then ``manifest.json``, written last:
step, tokens, world size, config hash, the model's shape, where the data-loader and RNG
state live in the DCP state dict, every file's size and digest, wall time, and an HMAC
signature over all of it (``signing``). A checkpoint is committed only when its manifest
exists; it is loaded only when the manifest's signature and every file verify. A directory
without a manifest (a save or an upload killed midway) is never loaded.

**Digests.** BLAKE3 (the ``blake3`` package): a cryptographic hash, so a signed manifest
vouches for the bytes. On one core of the 2-core CI machine it hashes 4.4 GB/s against 1.7
for SHA-256 (SHA-NI) and 19.2 for XXH3-64, the non-cryptographic checksum of format 1; its
own threads take it to 8.4 GB/s on two cores and scale with a GPU host's, where SHA-256
stays at one core per file (bench/checkpoint/checksum.py,
bench/results/checksum-20261122T1901.json).
Manifests of format 1 (XXH3-64 or CRC32, unsigned) still verify, for an operator who
trusts them (``signing.Trust.trust_unsigned``).

**Containment.** A manifest entry is a relative POSIX path of plain components
(``entry_problem``); anything else fails verification naming the entry, and nothing is
opened. On a local filesystem every file is reached from the step directory one component
at a time without following a symbolic link (``O_NOFOLLOW``, ``lstat``) and must be a
regular file; the step directory itself must not be a link. On an object store an entry is
a key under the step's prefix. ``remove`` and ``prune`` never follow a linked step
directory: the link is what goes.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import posixpath
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec

from orchestrator.contracts.rundir import is_remote  # noqa: F401 (layout.is_remote stays)
from trainer.checkpoint import manifest as manifest_format
from trainer.checkpoint import signing
from trainer.checkpoint.files import (  # noqa: F401 (layout.X stays the public name)
    _CHUNK,
    _CLOEXEC,
    _NOFOLLOW,
    CHECKSUM,
    DIGESTS,
    LocalStep,
    Unsafe,
    _show,
    entry_problem,
    file_digest,
    is_local,
    step_dir_problem,
    walk_local,
)

MANIFEST = "manifest.json"
FORMAT_1 = "orchestrator-checkpoint/1"  # XXH3-64 (or CRC32), unsigned
FORMAT = "orchestrator-checkpoint/2"  # BLAKE3, signed
FORMATS = (FORMAT_1, FORMAT)
CRYPTOGRAPHIC = ("blake3", "sha256")  # digests a signature can vouch for
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_THREADS = 8  # files checksummed at once: hashing releases the GIL, remote reads overlap
_MANIFEST_MAX = 256 * 2**20  # a manifest larger than this is not one of ours


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(url: str) -> int | None:
    """The step of a ``.../step-XXXXXXXX`` URL, or None for any other URL."""
    m = _STEP_DIR.match(posixpath.basename(url.rstrip("/")))
    return int(m.group(1)) if m else None


def job_url(root: str, job: str) -> str:
    """``<root>/<job>``: a URL stays a URL, a local path becomes absolute."""
    if "://" in root:
        return root.rstrip("/") + "/" + job
    return os.path.join(os.path.abspath(os.path.expanduser(root)), job)


def step_url(job_root_url: str, step: int) -> str:
    return job_root_url.rstrip("/") + "/" + step_dir_name(step)


def filesystem(url: str, fs: fsspec.AbstractFileSystem | None = None,
               ) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and path for a local path or URL (credentials from the env chain).

    ``fs`` reuses a filesystem built with options of its own (the uploader's retry settings).
    """
    if fs is not None:
        return fs, fs._strip_protocol(url)
    return fsspec.core.url_to_fs(url)



def _fmt(value: Any) -> str:
    return f"{value:08x}" if isinstance(value, int) else str(value)


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    url: str  # the step directory
    committed: bool  # manifest present (not yet verified)
    problem: str | None = None  # a step entry that can never verify (a symbolic link, ...)


@dataclass
class Verification:
    ok: bool
    problems: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    signature: str = signing.UNCHECKED  # signing.SIGNED, UNSIGNED, FORGED, NO_KEY, UNCHECKED


def _map(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    items = list(items)
    if len(items) < 2:
        return [fn(i) for i in items]
    with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(items))) as pool:
        return list(pool.map(fn, items))


class StepReader:
    """Sizes and contents of a step directory's entries, contained in it (see the module)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self.local = LocalStep(path) if is_local(fs) else None
        self._listing: dict[str, dict[str, Any]] | None = None

    def close(self) -> None:
        if self.local is not None:
            self.local.close()

    def __enter__(self) -> StepReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _remote_listing(self) -> dict[str, dict[str, Any]]:
        if self._listing is None:  # one LIST for the whole step, not a HEAD per file
            self.fs.invalidate_cache(self.path)  # another process may have written since
            found = self.fs.find(self.path, withdirs=False, detail=True)
            base = self.path.rstrip("/") + "/"
            self._listing = {k[len(base):]: v for k, v in found.items() if k.startswith(base)}
        return self._listing

    def size(self, rel: str) -> int:
        problem = entry_problem(rel)
        if problem:
            raise Unsafe(problem)
        if self.local is not None:
            return self.local.lstat(rel).st_size
        info = self._remote_listing().get(rel)
        if info is None:
            raise Unsafe(f"{_show(rel)}: missing")
        if info.get("type", "file") != "file":
            raise Unsafe(f"{_show(rel)}: not a file")
        return int(info.get("size") or 0)

    def open(self, rel: str) -> IO[bytes]:
        problem = entry_problem(rel)
        if problem:
            raise Unsafe(problem)
        if self.local is not None:
            return self.local.open(rel)
        return self.fs.open(posixpath.join(self.path, rel), "rb")

    def digest(self, rel: str, algorithm: str) -> Any:
        with self.open(rel) as f:
            return DIGESTS[algorithm](f)


def build_manifest(step_url: str, expected: Iterable[str] = (), *,
                   fs: fsspec.AbstractFileSystem | None = None, key: bytes | None = None,
                   algorithm: str = CHECKSUM, trust: signing.Trust | None = None,
                   **meta: Any) -> dict[str, Any]:
    """The manifest of a finished step directory: every file's size and digest, plus meta,
    signed by ``trust`` (with its key or its signer) or with ``key`` (neither: unsigned).

    ``expected`` names files that must be there (DCP's metadata lists every rank's files): a
    rank whose files this process cannot see (a local tier that is not shared by all ranks)
    fails here, instead of committing a checkpoint that could never be loaded. A local step
    directory holding a symbolic link or a device is never committed (``Unsafe``).
    """
    fs, path = filesystem(step_url, fs)
    if is_local(fs):
        rels = walk_local(path)
    else:
        rels = [posixpath.relpath(e, path)
                for e in sorted(fs.find(path, withdirs=False, detail=False))]
    missing = sorted(set(expected) - set(rels))
    if missing:
        raise FileNotFoundError(
            f"{step_url}: {len(missing)} file(s) written by the save are not visible here "
            f"({', '.join(missing[:4])}): the checkpoint directory must be shared by all ranks")
    names = [r for r in rels if r != MANIFEST and not r.endswith(".tmp")]
    with StepReader(fs, path) as reader:
        def describe(rel: str) -> tuple[str, dict[str, Any]]:
            with reader.open(rel) as f:
                size = os.fstat(f.fileno()).st_size if reader.local is not None else None
                digest = DIGESTS[algorithm](f)
            return rel, {"size": size if size is not None else reader.size(rel),
                         algorithm: digest}

        files = dict(_map(describe, names))
    manifest = {"format": FORMAT if algorithm in CRYPTOGRAPHIC else FORMAT_1,
                "checksum": algorithm, **meta, "files": files, "created": time.time()}
    if trust is not None and trust.can_sign:
        return trust.sign(manifest)  # the key, or the node agent that holds it
    return signing.sign(manifest, key) if key is not None else manifest


def write_manifest(step_url: str, manifest: dict[str, Any],
                   fs: fsspec.AbstractFileSystem | None = None) -> None:
    """Write ``manifest.json`` last and atomically: this is the commit point."""
    fs, path = filesystem(step_url, fs)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    target = posixpath.join(path, MANIFEST)
    if not is_local(fs):
        fs.pipe_file(target, data)  # one PUT: an object store commits it whole or not at all
        return
    problem = step_dir_problem(path)
    if problem:
        raise Unsafe(problem)
    tmp = target + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | _CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        _fsync(f)
    os.replace(tmp, target)  # replaces a name: a link planted at the target is not followed


def _fsync(f: Any) -> None:
    try:
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError):
        pass  # not a local file: the store's own durability applies


def _load_manifest(fs: fsspec.AbstractFileSystem, path: str,
                   ) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) or (None, why not): a local manifest must be a regular file; its
    bytes are read and typed by ``manifest.parse`` (bounded, never raises)."""
    try:
        if is_local(fs):
            with LocalStep(path) as step, step.open(MANIFEST) as f:
                data = f.read(_MANIFEST_MAX + 1)
        else:
            with fs.open(posixpath.join(path, MANIFEST), "rb") as f:
                data = f.read(_MANIFEST_MAX + 1)
    except Unsafe as exc:
        text = str(exc)
        if text.endswith(": missing"):
            return None, f"{MANIFEST}: missing or unreadable"
        return None, text
    except FileNotFoundError:
        return None, f"{MANIFEST}: missing or unreadable"
    if len(data) > _MANIFEST_MAX:
        return None, f"{MANIFEST}: larger than {_MANIFEST_MAX} bytes"
    return manifest_format.parse(data)


def read_manifest(step_url: str, fs: fsspec.AbstractFileSystem | None = None,
                  ) -> dict[str, Any] | None:
    """The manifest (not verified), or None when missing, unreadable or not contained."""
    fs, path = filesystem(step_url, fs)
    return _load_manifest(fs, path)[0]


def manifest_problems(manifest: dict[str, Any]) -> list[str]:
    """What makes a manifest unusable before any file is opened: its format, and entries
    that are not plain relative paths or lack a size."""
    if manifest.get("format") not in FORMATS:
        return [f"{MANIFEST}: unknown format {_show(manifest.get('format'))}"]
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return [f"{MANIFEST}: lists no files"]
    problems = []
    for rel, meta in sorted(files.items(), key=lambda kv: str(kv[0])):
        problem = entry_problem(rel)
        if problem is None and rel == MANIFEST:
            problem = f"{MANIFEST}: lists itself"
        if problem is None and (not isinstance(meta, dict) or not isinstance(
                meta.get("size"), int) or isinstance(meta.get("size"), bool)
                or meta["size"] < 0):
            problem = f"{_show(rel)}: no size in the manifest"
        if problem:
            problems.append(problem)
    return problems


def authenticate(manifest: dict[str, Any], trust: signing.Trust | None,
                 ) -> tuple[str, str | None]:
    """(signature outcome, problem or None) of a manifest under ``trust`` (None: not
    checked). A signed manifest must vouch for cryptographic digests."""
    if trust is None:
        return signing.UNCHECKED, None
    outcome, message = trust.check(manifest)
    if outcome == signing.SIGNED:
        weak = sorted(rel for rel, meta in (manifest.get("files") or {}).items()
                      if isinstance(meta, dict) and not any(a in meta for a in CRYPTOGRAPHIC))
        if weak:
            return signing.FORGED, (f"{MANIFEST}: signed, but {_show(weak[0])} has no "
                                    "cryptographic digest to vouch for")
        return outcome, None
    if outcome == signing.UNSIGNED and trust.trust_unsigned:
        return outcome, None
    if outcome == signing.UNSIGNED:
        message += ": refused (--trust-unsigned, or checkpoint.trust_unsigned, accepts it)"
    return outcome, f"{MANIFEST}: {message}"


def verify(step_url: str, checksums: bool = True,
           fs: fsspec.AbstractFileSystem | None = None,
           trust: signing.Trust | None = None) -> Verification:
    """Check a step directory against its manifest: the manifest's signature (under
    ``trust``; None checks integrity only), every entry contained and a regular file, sizes
    and digests equal. Each problem names the file and what is wrong with it; an entry
    that is not contained is never opened, and nothing is opened when the manifest itself
    fails (its format, its entries, its signature)."""
    fs, path = filesystem(step_url, fs)
    if is_local(fs):
        problem = step_dir_problem(path)
        if problem:
            return Verification(False, [problem])
    manifest, problem = _load_manifest(fs, path)
    if manifest is None:
        return Verification(False, [problem or f"{MANIFEST}: missing or unreadable"])
    problems = manifest_problems(manifest)
    if problems and problems[0].startswith(f"{MANIFEST}: unknown format"):
        return Verification(False, problems, manifest)
    outcome, denied = authenticate(manifest, trust)
    if denied:
        problems.insert(0, denied)
    dir_step = parse_step_dir(step_url)
    if dir_step is not None and manifest.get("step") not in (None, dir_step):
        problems.append(f"{MANIFEST}: records step {_show(manifest.get('step'))} but sits in "
                        f"{step_dir_name(dir_step)} (renamed or copied over)")
    if problems:
        return Verification(False, problems, manifest, outcome)
    files: dict[str, dict[str, Any]] = manifest["files"]
    try:
        reader = StepReader(fs, path)
    except Unsafe as exc:  # replaced by a link, or removed, since it was checked above
        return Verification(False, [str(exc)], manifest, outcome)

    with reader:
        def check(item: tuple[str, dict[str, Any]]) -> str | None:
            rel, meta = item
            try:
                size = reader.size(rel)
                if size != meta["size"]:
                    return f"{rel}: size {size} != manifest {meta['size']} (truncated or torn)"
                if not checksums:
                    return None
                algorithm = next((a for a in DIGESTS if a in meta), None)
                if algorithm is None:
                    return f"{rel}: no checksum this version knows (unverifiable)"
                digest = reader.digest(rel, algorithm)
            except Unsafe as exc:
                return str(exc)
            except FileNotFoundError:
                return f"{rel}: missing"
            if digest != meta[algorithm]:
                return (f"{rel}: {algorithm} {_fmt(digest)} != manifest "
                        f"{_fmt(meta[algorithm])} (contents changed)")
            return None

        try:
            problems = [p for p in _map(check, sorted(files.items())) if p]
        except FileNotFoundError:
            problems = [f"{posixpath.basename(path)}: missing"]
    return Verification(not problems, problems, manifest, outcome)


def list_checkpoints(job_root_url: str, fs: fsspec.AbstractFileSystem | None = None,
                     ) -> list[CheckpointInfo]:
    """Step directories under a job's root, oldest first, with whether a manifest exists.
    A local step entry that is a symbolic link or not a directory is listed with its
    ``problem`` (never followed)."""
    fs, path = filesystem(job_root_url, fs)
    out = []
    if is_local(fs):
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for entry in entries:
            m = _STEP_DIR.match(entry.name)
            if not m:
                continue
            url = step_url(job_root_url, int(m.group(1)))
            problem = step_dir_problem(entry.path)
            committed = problem is not None or os.path.lexists(
                os.path.join(entry.path, MANIFEST))
            out.append(CheckpointInfo(int(m.group(1)), url, committed, problem))
        return sorted(out, key=lambda c: c.step)
    fs.invalidate_cache(path)  # object stores cache listings; another process may have written
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    for entry in entries:
        name = posixpath.basename(entry.rstrip("/"))
        m = _STEP_DIR.match(name)
        if not m:
            continue
        url = step_url(job_root_url, int(m.group(1)))
        committed = fs.exists(posixpath.join(path, name, MANIFEST))
        out.append(CheckpointInfo(int(m.group(1)), url, committed))
    return sorted(out, key=lambda c: c.step)


def newest_verified(job_root_url: str, max_step: int | None = None, checksums: bool = True,
                    on_skip: Callable[[CheckpointInfo, list[str]], None] | None = None,
                    fs: fsspec.AbstractFileSystem | None = None,
                    trust: signing.Trust | None = None,
                    ) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest committed checkpoint (at most ``max_step``) that verifies.

    Each one that fails verification is reported through ``on_skip`` and passed over; the
    search goes on to older ones, so a corrupt newest checkpoint costs a little progress
    and never a restart loop.
    """
    for info in reversed(list_checkpoints(job_root_url, fs)):
        if max_step is not None and info.step > max_step:
            continue
        if not info.committed:
            continue
        result = Verification(False, [info.problem]) if info.problem else \
            verify(info.url, checksums=checksums, fs=fs, trust=trust)
        if result.ok and result.manifest is not None:
            return info, result.manifest
        if on_skip is not None:
            on_skip(info, result.problems)
    return None


def retained(steps: list[int], keep_last: int, keep_every: int | None = None,
             protect: set[int] | None = None) -> set[int]:
    """The committed steps a retention rule keeps: the newest ``keep_last``, every multiple
    of ``keep_every`` (kept forever), and ``protect``."""
    keep = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set()
    keep |= protect or set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


@dataclass
class PrunePlan:
    """What a prune keeps and removes. Only checkpoints that verify count toward the rule;
    one that fails is never kept at the expense of good ones, and is left in place (for
    inspection) unless ``remove_failing``."""

    keep: list[int] = field(default_factory=list)  # verified (or protected), kept
    remove: list[int] = field(default_factory=list)  # beyond the rule, or stale debris
    failing: dict[int, list[str]] = field(default_factory=dict)  # committed, fail to verify
    urls: dict[int, str] = field(default_factory=dict)


def plan_prune(job_root_url: str, keep_last: int, keep_every: int | None = None,
               protect: set[int] | None = None, fs: fsspec.AbstractFileSystem | None = None,
               *, trust: signing.Trust | None = None, checksums: bool = False,
               remove_failing: bool = False) -> PrunePlan:
    """The retention rule applied to the checkpoints that verify (sizes, containment and
    the signature under ``trust``; digests too with ``checksums``). Protected steps (the one
    just committed, uploads in flight) count as good without being read."""
    protect = set(protect or ())
    infos = list_checkpoints(job_root_url, fs)
    plan = PrunePlan(urls={c.step: c.url for c in infos})
    good = []
    for c in infos:
        if not c.committed:
            continue
        if c.step in protect:
            good.append(c.step)
            continue
        result = Verification(False, [c.problem]) if c.problem else \
            verify(c.url, checksums=checksums, fs=fs, trust=trust)
        if result.ok:
            good.append(c.step)
        else:
            plan.failing[c.step] = result.problems
    keep = retained(good, keep_last, keep_every, protect)
    committed = [c.step for c in infos if c.committed]
    newest = committed[-1] if committed else -1
    for c in infos:
        if c.step in plan.failing:
            if remove_failing and c.step not in protect:
                plan.remove.append(c.step)
        elif c.committed and c.step in keep:
            plan.keep.append(c.step)
        elif c.committed or (c.step < newest and c.step not in protect):
            plan.remove.append(c.step)  # beyond the rule, or debris older than a commit
    return plan


def execute_prune(plan: PrunePlan, fs: fsspec.AbstractFileSystem | None = None) -> list[int]:
    """Remove what ``plan`` says; returns the steps removed."""
    for s in plan.remove:
        remove(plan.urls[s], fs)
    return list(plan.remove)


def prune(job_root_url: str, keep_last: int, keep_every: int | None = None,
          protect: set[int] | None = None,
          fs: fsspec.AbstractFileSystem | None = None, dry_run: bool = False, *,
          trust: signing.Trust | None = None, checksums: bool = False,
          remove_failing: bool = False) -> list[int]:
    """Delete checkpoints the retention rule does not keep (``plan_prune``) and uncommitted
    debris older than the newest committed one. Returns the steps removed (or, with
    ``dry_run``, the steps that would be)."""
    plan = plan_prune(job_root_url, keep_last, keep_every, protect, fs, trust=trust,
                      checksums=checksums, remove_failing=remove_failing)
    return list(plan.remove) if dry_run else execute_prune(plan, fs)


def remove(step_url: str, fs: fsspec.AbstractFileSystem | None = None) -> None:
    """Delete a step directory, the manifest first: a half-deleted checkpoint is uncommitted,
    never a committed one with files missing. A local step entry that is a symbolic link
    (or anything but a directory) is removed itself; what it points to is never touched."""
    fs, path = filesystem(step_url, fs)
    if is_local(fs):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)  # the link, not its target
            return
        manifest = os.path.join(path, MANIFEST)
        if os.path.lexists(manifest):
            fs.rm(manifest)  # a real directory: a link named manifest.json goes itself
        try:
            shutil.rmtree(path)  # never follows links inside the tree
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        return
    manifest = posixpath.join(path, MANIFEST)
    if fs.exists(manifest):
        fs.rm(manifest)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def resign(step_url: str, key: bytes, trust: signing.Trust,
           fs: fsspec.AbstractFileSystem | None = None) -> Verification:
    """Sign a checkpoint with ``key`` after it verifies in full under ``trust`` (its old key,
    or ``trust_unsigned`` for an unsigned one): how checkpoints move to another job. Files
    without a BLAKE3 digest (format 1) are digested again; the manifest is rewritten in one
    atomic step. Returns the verification under ``trust`` (not ok: nothing was written)."""
    result = verify(step_url, checksums=True, fs=fs, trust=trust)
    if not result.ok or result.manifest is None:
        return result
    fs, path = filesystem(step_url, fs)
    old = result.manifest
    with StepReader(fs, path) as reader:
        def redigest(item: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
            rel, meta = item
            if CHECKSUM in meta:
                return rel, {"size": meta["size"], CHECKSUM: meta[CHECKSUM]}
            return rel, {"size": meta["size"], CHECKSUM: reader.digest(rel, CHECKSUM)}

        files = dict(_map(redigest, sorted(old["files"].items())))
    again = verify(step_url, checksums=False, fs=fs, trust=trust)  # unchanged meanwhile?
    if not again.ok or again.manifest != old:
        return Verification(False, ["changed while it was being re-signed"], old, result.signature)
    previous = old.get(signing.SIGNATURE)
    manifest = {k: v for k, v in old.items() if k != signing.SIGNATURE}
    manifest.update(format=FORMAT, checksum=CHECKSUM, files=files, resigned={
        "at": time.time(), "from_key_id": previous.get("key_id")
        if isinstance(previous, dict) else None, "was": result.signature})
    write_manifest(step_url, signing.sign(manifest, key), fs)
    return result
