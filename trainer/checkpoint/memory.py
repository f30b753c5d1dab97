"""The memory tier: each rank's newest state in its node's shared memory, and its partner's.

The node agent creates the slot files in a directory of its own (``/dev/shm``), sized by
``checkpoint.memory_max_bytes``, and removes them when it exits (``orchestrator.agent
.memory``); they outlive the worker processes, not the agent. A rank maps its slots; the
format and the manifest are ``memory_format``'s.

**Saving** (``save``, every ``checkpoint.memory_interval_steps`` steps): the manifest of
the older of the rank's two slots is removed and the state's tensors are copied into that
slot (device-to-host on a GPU; with ``overlap``, on a stream of their own beside the next
step, ``memory_landing``): training waits for this copy only. A commit thread then
digests the slot's bytes (BLAKE3), signs the manifest and renames it into place: the
commit. With a partner, each rank's commit thread then sends its slot (bytes and manifest)
to the rank at the same local index on the next node, over a gloo group of the tier's own,
and receives the previous node's: that copy is committed the same way in a ``partner``
slot. One save is in flight at a time. GEMINI's placement (a ring over nodes, one replica
each): one node lost loses no state, memory per node is twice a rank's state, and the
exchange is one send/receive pair per rank, not a collective that grows with the world.
A step the durable tier saves at copies into this tier too, and the durable save takes its
tensors from that copy (``copy_of``, ``slot_source``): the slot is not written again until
they are copied out.

**Restoring** (``plan``, then ``load``): every rank lists the committed copies it holds,
its own and its partner's; the ranks all-gather that and each takes the same decision: the
newest step that every rank can restore (from its own copy or from its partner's holder)
and that is at least as new as the durable tier's newest checkpoint and within the
restart's ``max_step``. Each rank then verifies its copy (signature, job, world layout,
digest), a holder verifies and sends the copy of a rank that lost its node, and the ranks
agree (all-reduce) that every copy verified: else the restore takes the durable tier, with
the reason. Without partners, a rank's own copy whose digest a thread computes from the
process's start (``DigestAhead``) has only its manifest checked in the plan; ``load``
compares the digest, after the model is built, and a mismatch sends every rank to the
durable tier there. ``load`` copies each tensor segment straight into the tensor at the
same place of the fresh state dict and hands the filled state to each part's
``load_state_dict``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import io
import mmap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import memory_format as mf
from trainer.checkpoint import signing
from trainer.checkpoint.copier import CopierClient, socket_path
from trainer.checkpoint.memory_landing import CopierLanding, CopyStream, Landing
from trainer.checkpoint.memory_load import await_copies, objects_digest
from trainer.checkpoint.memory_restore import MemoryRestore
from trainer.checkpoint.memory_slots import (
    DigestAhead,
    DigestCancelled,
    Pinned,
    Slots,
    digest_of,
)
from trainer.checkpoint.slot_source import SlotCopy, local_tensor

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their bytes
_COPIER_RETRY_S = 5.0  # how often a save looks for its standby's copier
_COPIER_WAIT_S = 120.0  # a restore's copies by the copier (6.8 GB take 0.13 s on an H200)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# Host copies go through memmove: torch's copy_ into a tensor over the mapping runs on its
# OpenMP threads, which on a busy host crawled at 30-100 MB/s where one memmove did 4+ GB/s
# (37.6 MiB of state: ~1 s against 8 ms). Device tensors keep copy_ (cudaMemcpy).
def _to_slot(buf: Any, offset: int, src: torch.Tensor, nbytes: int) -> None:
    """Copy ``src``'s ``nbytes`` (contiguous) into ``buf`` at ``offset``."""
    if src.device.type == "cpu":
        anchor = ctypes.c_char.from_buffer(buf, offset)
        ctypes.memmove(ctypes.addressof(anchor), src.data_ptr(), nbytes)
        del anchor
    else:
        dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
        dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)


class MemoryTier(MemoryRestore):
    """One rank's side of the memory tier (see the module)."""

    def __init__(self, root: Path, *, rank: int, world_size: int, procs_per_node: int,
                 job: str, config_hash: str | None, generation: int, partner: bool,
                 group: Any, trust: Callable[[], signing.Trust | None],
                 log: Callable[[str], None], device_type: str = "cpu",
                 pin_restore: bool = False, ahead: DigestAhead | None = None,
                 overlap: bool = False, copier: bool = False) -> None:
        self.slots = Slots.shared(root)
        # A GPU's copies land beside the next step (``memory_landing``): only where every
        # change to the state is an optimizer step (our trainer), not a script's own loop.
        self.overlap = overlap and device_type == "cuda"
        self._copies: CopyStream | None = None
        # The standby's copier (``copier``): while it makes the copies, this rank has no
        # slot page-locked (``_unpinned``); without it the rank locks them again.
        self._copier_path = socket_path(root, rank) if copier and self.overlap else None
        self._copier: CopierClient | None = None
        self._copier_tried = -_COPIER_RETRY_S
        self._save_bytes: int | None = None
        self._tensor_bytes: int | None = None  # the slot's bytes the copies write
        self._unpinned = False
        self._repin: concurrent.futures.Future | None = None
        self._ahead = ahead  # this rank's own newest copy, digested since the start
        self.pin_restore = pin_restore and device_type == "cuda"
        self._pinned: list[Pinned] = []
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.config_hash = config_hash
        self.generation = generation
        self.group = group
        self._trust = trust
        self.log = log
        self.device_type = device_type
        nodes = world_size // procs_per_node if procs_per_node > 0 else 1
        self.partnered = partner and nodes > 1 and group is not None
        # The ring over nodes: my copy goes to the next node, I hold the previous node's.
        self.ppn = procs_per_node
        self.holder = (rank + procs_per_node) % world_size
        self.held = (rank - procs_per_node) % world_size
        self.last_step: int | None = None
        self.last_bytes = 0
        self.staged_step: int | None = None
        self.last_copy_s = 0.0
        self._prepared = False
        self.saves = 0
        self._reported = False
        self.disabled_reason: str | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "memory-commit")
        self._pending: concurrent.futures.Future | None = None
        self._preparation: concurrent.futures.Future | None = None  # prepare_saves's
        # Slots a durable save still copies out of (``copy_of``): not written until done.
        self._holds: dict[str, concurrent.futures.Future] = {}
        self._copy: SlotCopy | None = None  # the last save's copy (``landed`` waits for it)
        self._landing: Landing | CopierLanding | None = None  # what ``_stage`` just issued
        self._plain: dict[str, Any] = {}
        self._cancel = threading.Event()  # set by ``abandon``: the commit in flight stops

    @property
    def trust(self) -> signing.Trust | None:
        return self._trust()

    # -- saving ----------------------------------------------------------------------------
    def _target(self, kind: str, rank: int, keep: int | None = None) -> str:
        """The slot a save overwrites: an empty one, else the one with the older step, but
        never the copy of step ``keep``: the newest step every rank has committed, the one
        a recovery rolls back to if a rank dies before this save is committed everywhere
        (a rank may commit step 30 while a slower peer still commits 20)."""
        have = {c.slot: c.manifest.step for c in self.slots.copies(kind, rank)}
        free = [s for s in mf.SLOTS if s not in have]
        if free:
            return free[0]
        spare = [s for s in have if have[s] != keep] or list(have)
        return min(spare, key=lambda s: have[s])

    def save(self, step: int, tokens: int, state: dict[str, Any],
             keep: int | None = None, commit: bool = True) -> float:
        """Copy ``state`` into the older own slot (training waits for this copy only),
        never the one holding step ``keep`` (the newest step every rank has committed);
        the digest, the signed manifest (the commit) and the partner exchange follow in
        the background. One save in flight: this waits for the previous one first.
        ``commit=False``: the copy only (``copy_of``: a durable save's source at the last
        step, which no recovery rolls back to). Returns the seconds training was blocked."""
        t0 = time.perf_counter()
        self.wait()
        self._copy = None
        if self.disabled_reason is not None:
            return 0.0
        copier = self._copier_for_save()
        if copier is None and not self._own_copies_ready():
            return time.perf_counter() - t0
        slot = self._target("own", self.rank, keep)
        buf = self.slots.map("own", self.rank, slot)
        staged = None
        if buf is None:
            self._disable(f"the agent made no slot {mf.slot_name('own', self.rank, slot, 'bin')}")
        else:
            self._await_hold(slot)
            self.slots.uncommit("own", self.rank, slot)
            staged = self._stage(buf, slot, step, tokens, state, copier)
        landing, self._landing = self._landing, None
        if buf is not None and staged is not None:
            self._copy = SlotCopy(step, buf, tuple(staged.keys), tuple(staged.segments),
                                  lambda done: self._holds.__setitem__(slot, done),
                                  self._plain, landing.wait if landing is not None else None)
        self._plain = {}
        if not commit or (staged is None and not self.partnered):
            return time.perf_counter() - t0
        self.saves += 1
        prepare = None
        if not self._prepared and staged is not None:  # a fresh run's first save
            self._prepared, prepare = True, staged.data_bytes
        self._pending = self._executor.submit(self._commit, slot, buf, staged, prepare,
                                              landing)
        return time.perf_counter() - t0

    def copy_of(self, step: int) -> SlotCopy | None:
        """The copy the last save made, when it is of ``step`` (a durable save's source)."""
        copy = self._copy
        return copy if copy is not None and copy.step == step else None

    def _await_hold(self, slot: str) -> None:
        """Until a durable save has copied ``slot`` out (about a second after its step)."""
        held = self._holds.pop(slot, None)
        if held is not None and not held.done():
            t0 = time.perf_counter()
            concurrent.futures.wait([held])
            self.log(f"memory tier: waited {time.perf_counter() - t0:.2f} s for a durable "
                     f"save to copy slot {slot} out")

    def prepare_saves(self, state: dict[str, Any]) -> None:
        """After a generation's first step, in the background: fault in the own slots' pages for a state
        of this size (tmpfs gives a page on first touch; a save into fresh pages blocked
        0.2-0.3 s for 37.6 MiB here, against 17 ms once they exist) and, on a GPU,
        page-lock them so saves copy device-to-host at full speed. The first save waits
        for this only if it comes first.

        Not before the first step: ``state_dict()`` of an optimizer with no state yet runs a
        zero-learning-rate step to make one (torch's ``_init_optim_state``), which would
        count a step a fresh run never took, and beside a restored run's first (compiled)
        step the page-locking slows it by seconds."""
        if self._pending is not None or self._prepared:
            return
        self._prepared = True
        tensors: list[torch.Tensor] = []
        for part in state.values():
            mf.flatten(part.state_dict(), tensors, _is_tensor)
        nbytes = sum(mf.aligned(local_tensor(t).numel() * local_tensor(t).element_size())
                     for t in tensors) + 2**20  # and the object tree
        self._pending = self._preparation = self._executor.submit(self._prepare_slots, nbytes)

    def preparing(self) -> bool:
        """Whether ``prepare_saves``'s background work is still running."""
        return self._preparation is not None and not self._preparation.done()

    def _copier_for_save(self) -> CopierClient | None:
        """The standby's copier when it makes this save's copies (connecting to one every
        few seconds while there is none); the first time, this rank's own page-locked
        slots are let go in the background."""
        if self._copier_path is None or self._tensor_bytes is None:
            return None
        client = self._copier
        if client is not None and client.dead is not None:
            client.close()
            self._copier = client = None
        if client is None and time.monotonic() - self._copier_tried >= _COPIER_RETRY_S:
            self._copier_tried = time.monotonic()
            self._copier = client = CopierClient.connect(self._copier_path, self.rank,
                                                         self._tensor_bytes, self.log)
        if client is None or not client.usable():
            return None
        if not self._unpinned and (self._repin is None or self._repin.done()):
            self._unpinned = True
            self.log("memory tier: the standby makes this rank's copies; its page-locked "
                     "slots are released")
            self._executor.submit(self._unpin_own)  # after the commit in flight
        return client

    def _unpin_own(self) -> None:
        for pins in (self._pinned, self.slots.pinned):
            while pins:
                pins.pop().release()
        self.slots.pinned_slots.clear()
        self.slots.by_slot.clear()

    def _own_copies_ready(self) -> bool:
        """Whether this rank can copy on its own: False while its slots, released to the
        copier that is gone now, are page-locked again (in the background; those saves
        are skipped: a pageable copy of the whole state would block training)."""
        if not self._unpinned:
            return True
        if self._repin is None:
            self.log("memory tier: the standby's copier is gone; page-locking the slots "
                     "again (saves skipped until then)")
            self._repin = self._executor.submit(self._prepare_slots, self._save_bytes or 0)
        if not self._repin.done():
            return False
        self._unpinned, self._repin = False, None
        return True

    def _prepare_slots(self, nbytes: int) -> None:
        self._save_bytes = nbytes
        for slot in mf.SLOTS:
            buf = self.slots.map("own", self.rank, slot)
            if buf is None:
                continue
            length = min(len(buf), -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
            try:  # allocates what is missing, keeps what a committed copy holds
                buf.madvise(_MADV_POPULATE_WRITE, 0, length)
            except (OSError, ValueError):  # a kernel before 5.14: pages come on first save
                pass
            if self.device_type == "cuda":
                # Only what a save of this state uses: a slot is sized for the node's whole
                # budget, and locking all of it held the driver for seconds more.
                pinned = Pinned(buf, length)
                if pinned.ok:
                    self._pinned.append(pinned)
                elif not pinned.already:
                    self.log("memory tier: could not page-lock a slot; copies stay pageable")

    def wait(self) -> None:
        """Until the save in flight is committed (and exchanged); its error is logged."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - the older copy stays; the next save retries
            self.log(f"memory tier: a save failed: {type(exc).__name__}: {exc}")

    def digest_ahead(self) -> None:
        """Start digesting this rank's own copies in a thread now (an in-job recovery:
        while the new process groups meet), for the restore's verification to find."""
        self._ahead = DigestAhead(self.slots.root, self.rank, None, every=True)

    def abandon(self, timeout: float) -> bool:
        """Forget the commit in flight when an in-job recovery aborted the process groups
        (its partner exchange fails then; its own copy may be committed). False: the
        commit thread did not end within ``timeout`` s."""
        pending = self._pending
        if pending is None:
            return True
        self._cancel.set()  # the commit stops before its manifest, its digest midway
        done, _ = concurrent.futures.wait([pending], timeout=timeout)
        if not done:
            return False
        self._cancel.clear()
        self._pending = None
        if pending.exception() is not None:
            self.log(f"memory tier: the save in flight ended with the recovery: "
                     f"{type(pending.exception()).__name__}")
        return True

    def report_due(self) -> bool:
        """True once: when a save has staged its bytes (a save from the durable staging
        stages in the commit thread, after the step that asked for it)."""
        if self._reported or not self.last_bytes:
            return False
        self._reported = True
        return True

    def report(self) -> dict[str, Any]:
        """What the node's memory tier holds now, for the ``memory_tier`` event."""
        used, budget = self.slots.usage()
        return {"step": self.staged_step or 0, "bytes": self.last_bytes, "node_bytes": used,
                "node_budget_bytes": budget, "partner": self.partnered}

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        self.log(f"memory tier off for this generation: {reason}")

    def _stage(self, buf: mmap.mmap, slot: str, step: int, tokens: int,
               state: dict[str, Any], copier: CopierClient | None = None
               ) -> mf.MemoryManifest | None:
        """Copy every tensor of ``state`` and its object tree into ``buf``; the manifest
        to commit, its digest still to compute (None: the state does not fit)."""
        tensors: list[torch.Tensor] = []
        keys = sorted(state)
        # Each part's state dict, kept for a durable save of this step (``copy_of``).
        self._plain = {k: state[k].state_dict() for k in keys}
        tree = {k: mf.flatten(self._plain[k], tensors, _is_tensor) for k in keys}
        objects = io.BytesIO()
        torch.save(tree, objects)
        blob = objects.getvalue()
        segments, offset = [], 0
        for t in tensors:
            local = local_tensor(t)
            nbytes = local.numel() * local.element_size()
            segments.append(mf.Segment(offset=offset, nbytes=nbytes, dtype=_dtype_name(local),
                                       shape=list(local.shape)))
            offset = mf.aligned(offset + nbytes)
        end = offset + len(blob)
        self._tensor_bytes = offset or None
        if end > len(buf):
            self._disable(f"the state needs {end} bytes, a slot holds {len(buf)} "
                          "(raise checkpoint.memory_max_bytes)")
            return None
        devices = {local_tensor(t).device for t in tensors if local_tensor(t).is_cuda}
        copies = self._copy_stream(devices)
        if copier is not None and (copies is None or not all(
                local_tensor(t).is_contiguous() for t in tensors if local_tensor(t).is_cuda)):
            copier = None
        pieces: list[tuple[torch.Tensor, int]] = []  # what the copier copies
        with torch.no_grad(), copies.begin() if copies is not None and copier is None \
                else contextlib.nullcontext():
            for t, seg in zip(tensors, segments, strict=True):
                local = local_tensor(t).detach()
                if not seg.nbytes:
                    continue
                if copier is not None and local.is_cuda:
                    pieces.append((local, seg.offset))
                else:
                    _to_slot(buf, seg.offset, local.contiguous(), seg.nbytes)
        if copier is not None and copies is not None:
            # Sent once the step that made the bytes is done on the device; the optimizer
            # waits on the host for them to land (``CopierLanding``).
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(copies.device))
            landing = CopierLanding(copier.copy("d2h", slot, pieces, after=done), self.log)
            copies.last = self._landing = landing
        elif copies is not None:  # they land beside the next step; the optimizer waits
            self._landing = copies.end()
        elif self.device_type == "cuda":  # the copies must land before training moves on
            await_copies(devices)
        buf[offset:end] = blob
        self.last_bytes, self.staged_step = end, step
        return mf.MemoryManifest(
            format=mf.FORMAT, job=self.job, config_hash=self.config_hash, rank=self.rank,
            world_size=self.world_size, step=step, tokens=tokens, generation=self.generation,
            keys=keys, segments=segments, objects=mf.Blob(offset=offset, nbytes=len(blob)),
            data_bytes=end, digest="blake3:" + "0" * 64, objects_digest=objects_digest(blob))

    def _copy_stream(self, devices: set[torch.device]) -> CopyStream | None:
        """The copy stream of the rank's one GPU, with ``overlap`` (None otherwise)."""
        if not self.overlap or len(devices) != 1:
            return None
        if self._copies is None:
            self._copies = CopyStream(next(iter(devices)))
        return self._copies

    def _commit(self, slot: str, buf: mmap.mmap | None, staged: mf.MemoryManifest | None,
                prepare: int | None = None,
                landing: Landing | CopierLanding | None = None) -> None:
        """Background: digest the staged bytes once they have landed, sign and commit the
        manifest, then trade copies with the partner (on the tier's own group, never the
        training thread's); then, after a fresh run's first save, prepare the slots for
        ``prepare`` bytes."""
        try:
            if landing is not None and not landing.wait(self._cancel):
                return  # an in-job recovery: this copy of the abandoned steps is not kept
            self._commit_copy(slot, buf, staged)
        finally:
            if prepare is not None:
                self._prepare_slots(prepare)

    def _commit_copy(self, slot: str, buf: mmap.mmap | None,
                     staged: mf.MemoryManifest | None) -> None:
        manifest = None
        if staged is not None and buf is not None:
            try:
                digest = digest_of(buf, staged, self._cancel)
            except DigestCancelled:
                return  # an in-job recovery: this copy of the abandoned steps is not kept
            if self._cancel.is_set():
                return
            body = staged.model_copy(update={"digest": digest})
            trust = self.trust
            manifest = mf.encode(mf.sign(body.model_dump(mode="json", exclude_none=True),
                                         trust))
            self.slots.commit("own", self.rank, slot, manifest)
            self.last_step = staged.step
        if not self.partnered:
            return
        # Every rank exchanges or none does: a rank whose state did not fit must not leave
        # its partner waiting for bytes.
        ok = torch.tensor([1 if manifest is not None else 0], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not ok.item():
            self.partnered = False
            self.log("memory tier: partner copies off for this generation (a rank's state "
                     "does not fit its slot)")
            return
        assert buf is not None and manifest is not None
        self._exchange(buf, manifest)

    def _exchange(self, buf: mmap.mmap, manifest: bytes) -> None:
        """Send my committed copy to my holder; receive and commit the one I hold."""
        size = torch.tensor([len(manifest), mf.parse_manifest(manifest).data_bytes],
                            dtype=torch.int64)
        their = torch.zeros(2, dtype=torch.int64)
        self._sendrecv(size, their)
        slot = self._target("partner", self.held)
        pbuf = self.slots.map("partner", self.held, slot)
        mine_n = int(size[1])
        m_len, d_len = int(their[0]), int(their[1])
        # Both ends must know whether the data moves: a holder with no room sends an empty
        # answer (and keeps its older copy), so neither side waits for bytes never sent.
        room = torch.tensor([1 if pbuf is not None and d_len <= len(pbuf) and
                             m_len <= mf.MANIFEST_MAX_BYTES else 0], dtype=torch.int64)
        peer_room = torch.zeros(1, dtype=torch.int64)
        self._sendrecv(room, peer_room, to_held=True)
        if room.item():
            self.slots.uncommit("partner", self.held, slot)
        send_m = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
        recv_m = torch.zeros(m_len if room.item() else 0, dtype=torch.uint8)
        src = torch.frombuffer(buf, dtype=torch.uint8, count=mine_n) if peer_room.item() \
            else torch.zeros(0, dtype=torch.uint8)
        dst = torch.frombuffer(pbuf, dtype=torch.uint8, count=d_len) \
            if room.item() and d_len else torch.zeros(0, dtype=torch.uint8)
        ops = []
        if peer_room.item():
            ops += [dist.P2POp(dist.isend, send_m, self.holder, self.group),
                    dist.P2POp(dist.isend, src, self.holder, self.group)]
        if room.item():
            ops += [dist.P2POp(dist.irecv, recv_m, self.held, self.group),
                    dist.P2POp(dist.irecv, dst, self.held, self.group)]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if room.item():
            self.slots.commit("partner", self.held, slot, recv_m.numpy().tobytes())
        else:
            self.log(f"memory tier: no room for rank {self.held}'s partner copy "
                     f"({d_len} bytes)")

    def _sendrecv(self, send: torch.Tensor, recv: torch.Tensor, to_held: bool = False) -> None:
        """``send`` to my holder and ``recv`` from the rank I hold (reversed: ``to_held``)."""
        dst, src = (self.held, self.holder) if to_held else (self.holder, self.held)
        ops = [dist.P2POp(dist.isend, send, dst, self.group),
               dist.P2POp(dist.irecv, recv, src, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def invalidate_after(self, step: int) -> list[str]:
        """Uncommit every copy newer than ``step``, the point this generation restored
        from: it belongs to a future that was abandoned (a rollback)."""
        dropped = []
        for kind, rank in (("own", self.rank), ("partner", self.held)):
            for c in self.slots.copies(kind, rank):
                if c.manifest.step > step:
                    self.slots.uncommit(kind, rank, c.slot)
                    dropped.append(f"{kind} r{rank} step {c.manifest.step}")
        return dropped

    def load(self, plan: Any, state: dict[str, Any]) -> None:
        """As ``MemoryRestore.load``, after the last save's copies on the device: the
        restore overwrites the tensors they read (a rollback)."""
        if self._copies is not None:
            self._copies.fence()
        super().load(plan, state)

    def _device_copy(self, slot: str | None) -> Callable[[list[Any]], None] | None:
        """The standby's copier for a restore's host-to-device copies, when it makes this
        rank's copies (this rank has no slot page-locked then)."""
        client = self._copier
        if slot is None or client is None or not client.usable():
            return None

        def run(pieces: list[Any]) -> None:
            torch.cuda.current_stream().synchronize()  # nothing queued still uses them
            client.copy("h2d", slot, pieces).result(timeout=_COPIER_WAIT_S)
        return run

    def close(self) -> None:
        """Stop the commit thread (a save still in flight finishes, bounded by the group's
        timeout when a partner is gone) and unmap the slots."""
        if self._copies is not None:
            self._copies.close()
        if self._copier is not None:
            self._copier.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for slot in list(self._holds):  # a copy out of a slot is local and short
            self._await_hold(slot)
        self._copy = None
        if self._pending is None or self._pending.done():
            for pinned in self._pinned:
                pinned.release()
            self._pinned.clear()
        self.slots.close()
