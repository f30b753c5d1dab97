"""A durable save whose tensors come from the memory tier's copy of the same step.

With the memory tier on, a step that saves durably copies its state into the memory tier
first: that device-to-host copy, into the agent's shared memory (page-locked by registering
it, ``memory_slots.Pinned``), is the only one training waits for. The durable save then takes
every tensor from that copy instead of the device: a thread of the checkpointer copies the
slot's segments into host buffers of plain memory (``fill``; kept from one save to the next)
and DCP writes the files from those. No rank allocates page-locked memory of its own for
its saves, so a dying rank holds less of it for the GPU driver to release (the driver's
global lock is held while it does: every GPU allocation on the node waits), and a warm
standby that takes over has none to page-lock.

The slot stays as it is until the copy out of it ends (``SlotCopy.hold``: the memory tier's
next save into that slot waits), about a second for 6.8 GB, never the whole write: the
files are written from the buffers (tens of seconds for GBs), and the memory tier goes on
saving into its other slot, then this one, meanwhile.

``check`` (on the training thread) and ``pair`` (in the copy-out thread, with the buffers)
match each tensor of the state with its segment of the copy: the parts in sorted order, each
tree walked as the memory tier walked it (``memory_format.flatten``), each pair checked for
dtype, shape and size before a byte moves. A copy that fails the check is a reason, and the
save stages from the device as without the memory tier.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint import memory_format as mf

# The copy out of the slot is split into pieces of this size, spread over a few threads
# (ctypes' memmove lets go of the GIL): one thread moved 4-10 GB/s.
PIECE_BYTES = 64 << 20
MAX_THREADS = 4


@dataclass(frozen=True)
class SlotCopy:
    """The memory tier's copy of ``step`` in one of its slots (its bytes landed, or
    landing beside the next step: ``landed`` waits for them); ``hold``
    keeps the slot as it is until the given future is done. ``plain``: each part's state
    dict that the copy was made from (a durable save of the step writes its plain values,
    and asks no part for its state dict again: for a sharded optimizer that costs tens of
    milliseconds of the training thread)."""

    step: int
    buf: mmap.mmap
    keys: tuple[str, ...]
    segments: tuple[mf.Segment, ...]
    hold: Callable[[concurrent.futures.Future], None]
    plain: dict[str, Any]
    landed: Callable[[], Any] | None = None  # waits until the copy's bytes have landed


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def with_buffers(live: Any, buffers: Any, where: str) -> Any:
    """``live`` (a part's state dict now) with each tensor replaced by the tensor at the
    same place of ``buffers``; ValueError where their structure, shapes or dtypes differ."""
    if isinstance(live, dict):
        if not isinstance(buffers, dict) or live.keys() != buffers.keys():
            raise ValueError(f"{where}: keys differ")
        return {k: with_buffers(v, buffers[k], f"{where}.{k}") for k, v in live.items()}
    if isinstance(live, list | tuple):
        if not isinstance(buffers, list | tuple) or len(live) != len(buffers):
            raise ValueError(f"{where}: lengths differ")
        out = [with_buffers(a, b, f"{where}[{i}]")
               for i, (a, b) in enumerate(zip(live, buffers, strict=True))]
        return type(live)(out) if isinstance(live, tuple) else out
    if isinstance(live, torch.Tensor):
        if not isinstance(buffers, torch.Tensor):
            raise ValueError(f"{where}: no buffer")
        a, b = local_tensor(live), local_tensor(buffers)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{where}: a buffer of {b.dtype}{list(b.shape)} for "
                             f"{a.dtype}{list(a.shape)}")
        return buffers
    return live


def _against(tree: dict[str, Any], copy: SlotCopy, host: bool
             ) -> list[tuple[torch.Tensor, mf.Segment]] | str:
    """Each tensor of ``tree`` (its parts in sorted order, walked as the memory tier walks
    them) with its segment of ``copy``, or why they do not correspond. ``host``: each must
    be contiguous host memory too (a buffer to copy into). Reads metadata only."""
    keys = tuple(sorted(tree))
    if keys != copy.keys:
        return f"the copy holds parts {list(copy.keys)}, the state {list(keys)}"
    tensors: list[torch.Tensor] = []
    for k in keys:
        mf.flatten(tree[k], tensors, lambda v: isinstance(v, torch.Tensor))
    if len(tensors) != len(copy.segments):
        return f"{len(tensors)} tensors in the state, {len(copy.segments)} in the copy"
    pairs = []
    for i, (t, seg) in enumerate(zip(tensors, copy.segments, strict=True)):
        local = local_tensor(t)
        if host and (local.device.type != "cpu" or not local.is_contiguous()):
            return f"tensor {i}: its buffer is not contiguous host memory"
        nbytes = local.numel() * local.element_size()
        if (str(local.dtype).removeprefix("torch.") != seg.dtype or list(local.shape) != seg.shape
                or nbytes != seg.nbytes or seg.offset + nbytes > len(copy.buf)):
            return (f"tensor {i}: {local.dtype}{list(local.shape)} in the state, "
                    f"{seg.dtype}{seg.shape} ({seg.nbytes} bytes) in the copy")
        pairs.append((local, seg))
    return pairs


def check(copy: SlotCopy) -> str | None:
    """Why the copy's segments do not describe the state dicts it was made from (None:
    they do). Metadata only: for the training thread, before a save is started."""
    got = _against(copy.plain, copy, host=False)
    return got if isinstance(got, str) else None


def pair(copy: SlotCopy, buffers: dict[str, Any]
         ) -> tuple[dict[str, Any], list[tuple[torch.Tensor, mf.Segment]]]:
    """The state dict to write (the copy's state dicts, each tensor replaced by the buffer
    at its place) and each buffer with its segment; ValueError where they do not fit. In
    the copy-out thread: it first waits for the copy's bytes to land (``copy.landed``)."""
    if copy.landed is not None:
        copy.landed()
    try:
        staged = {k: with_buffers(v, buffers[k], k) for k, v in copy.plain.items()}
    except KeyError as exc:
        raise ValueError(f"no buffers for part {exc}") from None
    got = _against(staged, copy, host=True)
    if isinstance(got, list):
        return staged, got
    raise ValueError(got)


def pieces(pairs: list[tuple[torch.Tensor, mf.Segment]], base: int,
           piece: int = PIECE_BYTES) -> list[tuple[int, int, int]]:
    """(destination, source, size) of every piece to copy; ``base`` is the slot's address."""
    out = []
    for t, seg in pairs:
        dst = t.data_ptr()
        for at in range(0, seg.nbytes, piece):
            out.append((dst + at, base + seg.offset + at, min(piece, seg.nbytes - at)))
    return out


def fill(buf: mmap.mmap, pairs: list[tuple[torch.Tensor, mf.Segment]],
         threads: int | None = None) -> int:
    """Copy each segment of ``buf`` into its buffer; the bytes copied."""
    if not pairs:
        return 0
    anchor = ctypes.c_char.from_buffer(buf)  # the mapping's address (held while it lives)
    try:
        todo = pieces(pairs, ctypes.addressof(anchor))
        n = threads or min(MAX_THREADS, os.cpu_count() or 1, len(todo))
        if n <= 1:
            for dst, src, size in todo:
                ctypes.memmove(dst, src, size)
        else:
            with concurrent.futures.ThreadPoolExecutor(n, "ckpt-slot-copy") as pool:
                list(pool.map(lambda p: ctypes.memmove(*p), todo))
    finally:
        del anchor
    return sum(size for _, _, size in todo)
