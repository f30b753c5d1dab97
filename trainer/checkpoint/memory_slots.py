"""One rank's view of its node's memory-tier directory: map, read and commit slots.

The agent made the files (``orchestrator.agent.memory``); a rank opens only those, never
creates a slot, and writes only manifests (by rename, last: the commit). The names and the
manifest's type are ``memory_format``'s.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        self.pinned: list[Pinned] = []  # page-locked ahead by a warm standby
        self.pinned_slots: set[str] = set()  # which of this rank's own slots they are
        self.by_slot: dict[str, Pinned] = {}  # and each one's page-locked range

    @classmethod
    def shared(cls, root: Path) -> Slots:
        """The slots a warm standby of this process mapped and page-locked ahead of its
        hand-off (``pin_own_slots``), else a fresh view. A standby's :class:`SlotPinner`
        and its copier (``copier``) stop first: from here on the slots are this process's
        memory tier's."""
        server = _SERVERS.pop(str(root), None)
        if server is not None:
            server.stop()
        pinner = _PINNERS.pop(str(root), None)
        if pinner is not None:
            pinner.stop()
        return _PREPARED.pop(str(root), None) or cls(root)

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
                buf = mmap.mmap(fd, size, mmap.MAP_SHARED)
            finally:
                os.close(fd)
            # 2 MiB pages where the tmpfs is mounted huge=advise (always/within_size give
            # them anyway; never ignores it): page-locking them, and a dead rank's release
            # of them, cost a fraction of 4 KiB pages' (orchestrator.agent.memory).
            with contextlib.suppress(AttributeError, OSError):
                buf.madvise(mmap.MADV_HUGEPAGE)
            self._maps[name] = buf
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
        for pinned in self.pinned:
            pinned.release()
        self.pinned.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a tensor view still holds it: the process exit frees it
                pass
        self._maps.clear()


# Slots a warm standby mapped and page-locked, by memory directory, until its rank's memory
# tier takes them (``Slots.shared``).
_PREPARED: dict[str, Slots] = {}
_PINNERS: dict[str, SlotPinner] = {}  # a standby's pinner, stopped by ``Slots.shared``
_SERVERS: dict[str, Any] = {}  # a standby's ``copier.CopierServer``, the same


def pin_own_slots(root: Path, rank: int, slots: Slots | None = None,
                  pin: Callable[[mmap.mmap, int], Pinned] | None = None) -> int:
    """A warm standby's preparation: map ``rank``'s own slots and page-lock the bytes each
    committed copy uses (registering the agent's shared memory: nothing pinned is
    allocated), kept for this process's memory tier. Slots ``slots`` already holds pinned
    are left as they are. Returns the bytes page-locked now."""
    slots = slots if slots is not None else Slots(root)
    pin = pin or Pinned
    total = 0
    for copy in slots.copies("own", rank):
        if copy.slot in slots.pinned_slots:
            continue
        buf = slots.map("own", rank, copy.slot)
        if buf is None:
            continue
        length = min(len(buf), -(-copy.manifest.data_bytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        pinned = pin(buf, length)
        if pinned.ok:
            slots.pinned.append(pinned)
            slots.pinned_slots.add(copy.slot)
            slots.by_slot[copy.slot] = pinned
            total += length
    _PREPARED[str(root)] = slots
    return total


class SlotPinner(threading.Thread):
    """Page-locks ``rank``'s own slots as their first copies are committed, for a standby
    made before them (one started with the job waits through the first memory saves).
    Without it that standby's rank restored from pageable memory: 1.7 s against 0.3 s
    for the 1.14B model's 6.8 GB on an H200. Polls every ``interval_s`` until every slot
    is pinned, or until the rank's memory tier takes the slots (:meth:`Slots.shared`)."""

    def __init__(self, root: Path, rank: int, interval_s: float = 0.5,
                 pin: Callable[[mmap.mmap, int], Pinned] | None = None) -> None:
        super().__init__(name="slot-pinner", daemon=True)
        self.root, self.rank, self.interval_s, self._pin = root, rank, interval_s, pin
        self.slots = _PREPARED.get(str(root)) or Slots(root)
        self.pinned_bytes = 0
        self._stopped = threading.Event()
        self._busy = threading.Lock()

    def run(self) -> None:
        while not self._stopped.is_set() and len(self.slots.pinned_slots) < len(mf.SLOTS):
            with self._busy:
                if self._stopped.is_set():
                    break
                try:
                    self.pinned_bytes += pin_own_slots(self.root, self.rank, self.slots,
                                                       self._pin)
                except (OSError, RuntimeError, ValueError):
                    pass  # a slot being remade, a driver error: the next round, or never
            self._stopped.wait(self.interval_s)

    def stop(self) -> None:
        """No slot is pinned after this returns (one being pinned now is finished)."""
        self._stopped.set()
        with self._busy:
            pass


def watch_own_slots(root: Path, rank: int, interval_s: float = 0.5,
                    pin: Callable[[mmap.mmap, int], Pinned] | None = None) -> SlotPinner:
    """Start a :class:`SlotPinner` for this process (a standby): its slots go to the rank's
    memory tier with every copy page-locked that was committed before the hand-off."""
    pinner = SlotPinner(root, rank, interval_s, pin)
    _PREPARED[str(root)] = pinner.slots
    _PINNERS[str(root)] = pinner
    pinner.start()
    return pinner


def pin_for_copies(slots: Slots, rank: int, nbytes: int,
                   pin: Callable[[mmap.mmap, int], Pinned] | None = None
                   ) -> dict[str, tuple[mmap.mmap, int]]:
    """A standby's copier: each own slot of ``rank`` page-locked for a save of ``nbytes``
    (one pinned for less is pinned again); ``slot -> (mapping, page-locked bytes)``, empty
    when a slot is missing or cannot be page-locked."""
    pin = pin or Pinned
    out = {}
    for slot in mf.SLOTS:
        buf = slots.map("own", rank, slot)
        if buf is None:
            return {}
        length = min(len(buf), -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        have = slots.by_slot.get(slot)
        if have is None or have.nbytes < length:
            if have is not None:
                have.release()
                slots.pinned.remove(have)
            have = pin(buf, length)
            if not have.ok:
                slots.by_slot.pop(slot, None)
                slots.pinned_slots.discard(slot)
                return {}
            slots.pinned.append(have)
            slots.pinned_slots.add(slot)
            slots.by_slot[slot] = have
        out[slot] = (buf, have.nbytes)
    return out


def serve_own_slots(root: Path, rank: int, log: Callable[[str], None]) -> Any:
    """A standby's copier for ``rank`` (``copier``), serving until ``Slots.shared``; None
    where its socket's path is too long for ``sun_path``."""
    from trainer.checkpoint.copier import CopierServer, socket_path, usable_path

    path = socket_path(root, rank)
    if not usable_path(path):
        log(f"slot copier: {path} is too long for a Unix socket; the rank copies on its own")
        return None
    slots = _PREPARED.setdefault(str(root), Slots(root))

    def pin(nbytes: int) -> dict[str, tuple[mmap.mmap, int]]:
        pinner = _PINNERS.pop(str(root), None)
        if pinner is not None:  # the copier's pins cover what it would pin
            pinner.stop()
        return pin_for_copies(slots, rank, nbytes)

    import torch

    server = CopierServer(path, rank, pin, log, device=torch.cuda.current_device())
    _SERVERS[str(root)] = server
    server.start()
    return server


class DigestCancelled(Exception):
    """A digest stopped midway (an in-job recovery cancelled the commit it was for)."""


# The digest hashes a copy in pieces this large: each ``update`` hands the bytes to
# blake3's own threads without the GIL and takes the GIL back at its end. Per tensor (about
# 700 segments for the 1.14B model) each return waited for the training thread's GIL: 0.5-1.3
# s for a copy blake3 hashes in 0.1 s alone.
DIGEST_PIECE = 1 << 30


def digest_of(data: memoryview | mmap.mmap, m: mf.MemoryManifest,
              cancelled: threading.Event | None = None) -> str:
    """BLAKE3 of the copy's first ``data_bytes`` bytes (its segments, their alignment
    padding and the objects blob), in :data:`DIGEST_PIECE` pieces; raises
    :class:`DigestCancelled` between pieces once ``cancelled`` is set."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    view = memoryview(data)[:m.data_bytes]
    for start in range(0, m.data_bytes, DIGEST_PIECE):
        if cancelled is not None and cancelled.is_set():
            raise DigestCancelled
        h.update(view[start:start + DIGEST_PIECE])
    return "blake3:" + h.hexdigest()


class DigestAhead:
    """The digest of this rank's newest own copy, computed in a thread from the worker's
    start: a restart from memory verifies every byte it restores (blake3 over the slot,
    6.8 GB per rank of the 1.14B model), and that ran after the process groups were up,
    on the restart's path. Started before them (the device pick, NCCL's and gloo's
    set-up take 1-2 s), the digest is ready when the plan asks for it.

    Only a digest is kept, under the slot and the digest its manifest claims: the plan
    re-reads the manifest, checks it (signature, job, rank) and compares; a copy committed
    again since (another manifest) is digested afresh. Nothing writes a slot while a new
    generation starts: the ranks that wrote it were reaped before the relaunch."""

    def __init__(self, root: Path, rank: int, max_step: int | None,
                 every: bool = False) -> None:
        self._digests: dict[tuple[str, str], str] = {}
        self._done = threading.Condition()  # notified at each digest and at the end
        self._finished = False
        self.seconds = 0.0
        self.error: str | None = None
        # Wall-clock marks: the start, and the end of each copy's digest (``digest_<step>``).
        self.marks: dict[str, float] = {"digest_start": time.time()}
        self._thread = threading.Thread(target=self._run, args=(root, rank, max_step, every),
                                        name="memory-digest-ahead", daemon=True)
        self._thread.start()

    def _run(self, root: Path, rank: int, max_step: int | None, every: bool) -> None:
        t0 = time.perf_counter()
        slots = Slots(root)
        try:
            copies = sorted((c for c in slots.copies("own", rank)
                             if max_step is None or c.manifest.step <= max_step),
                            key=lambda c: c.manifest.step, reverse=True)
            # The newest copy, or (an in-job recovery, which may roll back to the older
            # one: the newest step every rank holds) every copy, newest first.
            for copy in copies if every else copies[:1]:
                buf = slots.map("own", rank, copy.slot)
                if buf is not None:
                    found = digest_of(buf, copy.manifest)
                    with self._done:
                        self._digests[(copy.slot, copy.manifest.digest)] = found
                        self.marks[f"digest_{copy.manifest.step}"] = time.time()
                        self.seconds = time.perf_counter() - t0  # so far
                        self._done.notify_all()
        except (OSError, ValueError) as exc:  # the plan digests it itself then
            self.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            slots.close()
            self.seconds = time.perf_counter() - t0
            with self._done:
                self._finished = True
                self._done.notify_all()

    def digest(self, slot: str, manifest: mf.MemoryManifest) -> str | None:
        """The digest of ``slot``'s bytes as its ``manifest`` lays them out, or None when
        it was not computed ahead: waits until that copy's digest is done (not the older
        copies after it: an in-job recovery rolls back to the newest copy as a rule) or
        the thread has ended."""
        key = (slot, manifest.digest)
        with self._done:
            self._done.wait_for(lambda: key in self._digests or self._finished)
            return self._digests.get(key)


_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class Pinned:
    """The first ``nbytes`` of a mapping page-locked for CUDA (``cudaHostRegister``), so
    copies between it and a GPU run at full speed and asynchronously. ``release`` undoes
    it. Anything that fails leaves the mapping pageable (slower copies, same bytes)."""

    def __init__(self, buf: mmap.mmap, nbytes: int) -> None:
        import ctypes

        import torch

        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(buf)
        self._ptr = ctypes.addressof(self._anchor)
        code = torch.cuda.cudart().cudaHostRegister(self._ptr, nbytes, 0)
        # Already registered (a warm standby of this process locked it ahead): as fast,
        # and not ours to release.
        self.already = code == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.ok = code == 0
        self.nbytes = nbytes
        if not self.ok:
            self._anchor = None  # the export must go, or the mapping can never close

    def release(self) -> None:
        import torch

        if self.ok:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self.ok = False
            self.nbytes = 0
        self._anchor = None
