"""One rank's view of its node's memory-tier directory: map, read and commit slots.

The agent made the files (``orchestrator.agent.memory``); a rank opens only those, never
creates a slot, and writes only manifests (by rename, last: the commit). The names and the
manifest's type are ``memory_format``'s.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import blake3

from trainer.checkpoint import memory_format as mf


@dataclass(frozen=True)
class Copy:
    """A committed copy in one of this rank's slots (not yet digest-verified)."""

    kind: str  # own | partner
    slot: str
    manifest: mf.MemoryManifest


class Slots:
    """One rank's view of its node's memory directory: map, read and commit slots."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._maps: dict[str, mmap.mmap] = {}

    def path(self, kind: str, rank: int, slot: str, ext: str) -> Path:
        return self.root / mf.slot_name(kind, rank, slot, ext)

    def map(self, kind: str, rank: int, slot: str) -> mmap.mmap | None:
        """The slot's bytes, mapped shared (None: the agent made no such slot)."""
        name = mf.slot_name(kind, rank, slot, "bin")
        if name not in self._maps:
            try:
                fd = os.open(self.root / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    return None
                self._maps[name] = mmap.mmap(fd, size, mmap.MAP_SHARED)
            finally:
                os.close(fd)
        return self._maps[name]

    def read_manifest(self, kind: str, rank: int, slot: str) -> mf.MemoryManifest | str:
        """The slot's parsed manifest, or why there is none usable."""
        path = self.path(kind, rank, slot, "json")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return "no committed copy"
        except OSError as exc:
            return f"unreadable manifest: {exc.strerror}"
        with os.fdopen(fd, "rb") as f:
            raw = f.read(mf.MANIFEST_MAX_BYTES + 1)
        try:
            return mf.parse_manifest(raw)
        except ValueError as exc:
            return f"torn or malformed manifest: {exc}"

    def uncommit(self, kind: str, rank: int, slot: str) -> None:
        self.path(kind, rank, slot, "json").unlink(missing_ok=True)

    def commit(self, kind: str, rank: int, slot: str, manifest: bytes) -> None:
        """Write the manifest last, by rename: a reader sees all of it or none."""
        final = self.path(kind, rank, slot, "json")
        tmp = final.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(manifest)
        os.replace(tmp, final)

    def copies(self, kind: str, rank: int) -> list[Copy]:
        out = []
        for slot in mf.SLOTS:
            m = self.read_manifest(kind, rank, slot)
            if isinstance(m, mf.MemoryManifest):
                out.append(Copy(kind, slot, m))
        return out

    def usage(self) -> tuple[int, int]:
        """(bytes the node's slot files hold now, their total size: the node's budget)."""
        used = size = 0
        try:
            for entry in os.scandir(self.root):
                st = entry.stat(follow_symlinks=False)
                used += st.st_blocks * 512
                size += st.st_size if entry.name.endswith(".bin") else 0
        except OSError:
            pass
        return used, size

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a tensor view still holds it: the process exit frees it
                pass
        self._maps.clear()


def digest_of(data: memoryview | mmap.mmap, m: mf.MemoryManifest) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    view = memoryview(data)
    for seg in [*m.segments, m.objects]:
        h.update(view[seg.offset:seg.offset + seg.nbytes])
    return "blake3:" + h.hexdigest()


class Pinned:
    """The first ``nbytes`` of a mapping page-locked for CUDA (``cudaHostRegister``), so
    copies between it and a GPU run at full speed and asynchronously. ``release`` undoes
    it. Anything that fails leaves the mapping pageable (slower copies, same bytes)."""

    def __init__(self, buf: mmap.mmap, nbytes: int) -> None:
        import ctypes

        import torch

        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(buf)
        self._ptr = ctypes.addressof(self._anchor)
        self.ok = torch.cuda.cudart().cudaHostRegister(self._ptr, nbytes, 0) == 0
        if not self.ok:
            self._anchor = None  # the export must go, or the mapping can never close

    def release(self) -> None:
        import torch

        if self.ok:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self.ok = False
        self._anchor = None
