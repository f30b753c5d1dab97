"""Checkpoint layout, manifests and verification (fsspec, no torch: the CLI uses it too).

``<root>/<job>/step-<8 digits>/`` holds the DCP files, then ``manifest.json``, written last:
step, tokens, world size, config hash, where the data-loader and RNG state live in the DCP
state dict, every file's size and CRC32, wall time. A checkpoint is committed only when its
manifest exists and verifies; a directory without one (a save killed midway) is never
loaded.

CRC32 (zlib) is the checksum: 3.6 GB/s on one core of the 2-core CI machine, against 1.6 for
SHA-256 and 0.8 for BLAKE2b, with no extra dependency, and it is the checksum S3 computes and
checks server-side (x-amz-checksum-crc32).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec

MANIFEST = "manifest.json"
FORMAT = "orchestrator-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_CHUNK = 8 * 2**20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def job_url(root: str, job: str) -> str:
    """``<root>/<job>``: a URL stays a URL, a local path becomes absolute."""
    if "://" in root:
        return root.rstrip("/") + "/" + job
    return os.path.join(os.path.abspath(os.path.expanduser(root)), job)


def step_url(job_root_url: str, step: int) -> str:
    return job_root_url.rstrip("/") + "/" + step_dir_name(step)


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and path for a local path or URL (credentials from the env chain)."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def file_crc32(fs: fsspec.AbstractFileSystem, path: str) -> int:
    crc = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    url: str  # the step directory
    committed: bool  # manifest present (not yet verified)


@dataclass
class Verification:
    ok: bool
    problems: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None


def build_manifest(step_url: str, **meta: Any) -> dict[str, Any]:
    """The manifest of a finished step directory: every file's size and CRC32, plus meta."""
    fs, path = filesystem(step_url)
    files = {}
    for entry in sorted(fs.find(path, withdirs=False, detail=False)):
        rel = posixpath.relpath(entry, path)
        if rel == MANIFEST or rel.endswith(".tmp"):
            continue
        files[rel] = {"size": fs.size(entry), "crc32": file_crc32(fs, entry)}
    return {"format": FORMAT, **meta, "files": files, "created": time.time()}


def write_manifest(step_url: str, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` last and atomically: this is the commit point."""
    fs, path = filesystem(step_url)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    target = posixpath.join(path, MANIFEST)
    if "://" in step_url and not step_url.startswith("file://"):
        fs.pipe_file(target, data)  # one PUT: an object store commits it whole or not at all
        return
    tmp = target + ".tmp"
    with fs.open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        _fsync(f)
    fs.mv(tmp, target)


def _fsync(f: Any) -> None:
    try:
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError):
        pass  # not a local file: the store's own durability applies


def read_manifest(step_url: str) -> dict[str, Any] | None:
    fs, path = filesystem(step_url)
    try:
        with fs.open(posixpath.join(path, MANIFEST), "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def verify(step_url: str, checksums: bool = True) -> Verification:
    """Check a step directory against its manifest: every file present, sizes and CRCs equal."""
    manifest = read_manifest(step_url)
    if manifest is None:
        return Verification(False, [f"{MANIFEST} missing or unreadable"])
    if manifest.get("format") != FORMAT:
        return Verification(False, [f"unknown manifest format {manifest.get('format')!r}"],
                            manifest)
    fs, path = filesystem(step_url)
    problems = []
    for rel, meta in sorted(manifest.get("files", {}).items()):
        full = posixpath.join(path, rel)
        try:
            size = fs.size(full)
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if size != meta["size"]:
            problems.append(f"{rel}: size {size} != manifest {meta['size']}")
            continue
        if checksums:
            crc = file_crc32(fs, full)
            if crc != meta["crc32"]:
                problems.append(f"{rel}: crc32 {crc:08x} != manifest {meta['crc32']:08x}")
    if not manifest.get("files"):
        problems.append("manifest lists no files")
    return Verification(not problems, problems, manifest)


def list_checkpoints(job_root_url: str) -> list[CheckpointInfo]:
    """Step directories under a job's root, oldest first, with whether a manifest exists."""
    fs, path = filesystem(job_root_url)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    out = []
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
                    ) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest committed checkpoint (at most ``max_step``) that verifies.

    Each one that fails verification is reported through ``on_skip`` and passed over; the
    search goes on to older ones, so a corrupt newest checkpoint costs a little progress
    and never a restart loop.
    """
    for info in reversed(list_checkpoints(job_root_url)):
        if max_step is not None and info.step > max_step:
            continue
        if not info.committed:
            continue
        result = verify(info.url, checksums=checksums)
        if result.ok and result.manifest is not None:
            return info, result.manifest
        if on_skip is not None:
            on_skip(info, result.problems)
    return None


def prune(job_root_url: str, keep_last: int, keep_every: int | None = None,
          protect: set[int] | None = None) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep_last`` (and uncommitted debris
    older than the newest committed one). Returns the steps removed."""
    fs, _ = filesystem(job_root_url)
    infos = list_checkpoints(job_root_url)
    committed = [c for c in infos if c.committed]
    keep = {c.step for c in committed[-keep_last:]} | (protect or set())
    if keep_every:
        keep |= {c.step for c in committed if c.step % keep_every == 0}
    newest = committed[-1].step if committed else -1
    removed = []
    for c in infos:
        stale_debris = not c.committed and c.step < newest
        if (c.committed and c.step not in keep) or stale_debris:
            _, path = filesystem(c.url)
            fs.rm(path, recursive=True)
            removed.append(c.step)
    return removed
