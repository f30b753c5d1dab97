"""Loading a verified memory-tier copy into a fresh state: what is checked is what is loaded.

The plan (``memory.MemoryTier.plan``) verified the copy: its signed manifest and the BLAKE3
digest of every segment. The one part of a copy that is deserialized, its ``objects`` blob
(the state tree, ``torch.save``), is copied out of shared memory into this process first, and
that private copy is checked against the manifest's own digest of the blob before
``torch.load(weights_only=True)`` reads it: a writer of the node's memory directory that
changes the blob after the plan verified it is refused here. The tensor segments are raw
bytes copied into tensors of the shape and dtype the model has, never deserialized.
"""

from __future__ import annotations

import ctypes
import io
import time
from collections.abc import Callable
from typing import Any

import blake3
import torch

from trainer.checkpoint import memory_format as mf
from trainer.checkpoint.memory_slots import Pinned


def objects_digest(blob: bytes | memoryview) -> str:
    """The manifest's digest of a copy's objects blob."""
    return "blake3:" + blake3.blake3(blob).hexdigest()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# Host copies go through memmove: torch's copy_ into a tensor over the mapping runs on its
# OpenMP threads, which on a busy host crawled at 30-100 MB/s where one memmove did 4+ GB/s.
def _from_slot(data: Any, offset: int, dst: torch.Tensor, dtype: torch.dtype) -> None:
    """Copy the segment at ``offset`` into ``dst`` (shape and dtype already checked)."""
    nbytes = dst.numel() * dst.element_size()
    if dst.device.type == "cpu" and dst.is_contiguous():
        anchor = ctypes.c_char.from_buffer(data, offset)
        ctypes.memmove(dst.data_ptr(), ctypes.addressof(anchor), nbytes)
        del anchor
    else:
        src = torch.frombuffer(data, dtype=dtype, count=dst.numel(), offset=offset)
        dst.copy_(src.view(dst.shape), non_blocking=True)


def await_copies(devices: set[torch.device]) -> None:
    """Wait until the copies this thread queued to or from ``devices`` (GPUs) have landed:
    each device's current stream, where they were queued. Not the whole device, whose sync
    also waits for every other stream's work (another thread's copies, NCCL's streams),
    which these copies do not need."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def object_tree(data: Any, m: mf.MemoryManifest) -> dict[str, Any]:
    """The copy's state tree, from a private copy of its blob checked against the
    manifest (ValueError otherwise)."""
    if m.objects_digest is None:
        raise ValueError("the manifest has no digest of its object tree (an older format)")
    blob = bytes(memoryview(data)[m.objects.offset:m.objects.offset + m.objects.nbytes])
    if objects_digest(blob) != m.objects_digest:
        raise ValueError("the object tree changed since the copy was verified")
    tree = torch.load(io.BytesIO(blob), weights_only=True)
    if not isinstance(tree, dict) or sorted(tree) != m.keys:
        raise ValueError("the copy's object tree does not name its parts")
    return tree


def load_copy(data: Any, m: mf.MemoryManifest, state: dict[str, Any], *,
              pin: Pinned | None = None, cuda: bool = False,
              marks: dict[str, float] | None = None,
              device_copy: Callable[[list[tuple[torch.Tensor, int]]], None] | None = None
              ) -> float:
    """Each tensor segment of ``data`` straight into the tensor the fresh ``state`` holds
    at its place, then each part's ``load_state_dict``; returns the seconds the copies
    took. Raises ValueError when the layout does not match. ``marks`` gets the wall-clock
    ends of its parts: ``load_copies_issued``, ``load_copies_landed``, ``load_parts_loaded``.
    ``device_copy``: makes the copies into contiguous GPU tensors, all at once (``(tensor,
    offset in data)`` each; the standby's copier, ``copier``)."""
    at = marks if marks is not None else {}
    if sorted(state) != m.keys:
        raise ValueError(f"state parts {sorted(state)} differ from the copy's {m.keys}")
    tree = object_tree(data, m)
    copy_s = 0.0
    devices: set[torch.device] = set()

    def fill(i: int, target: Any, path: str) -> Any:
        nonlocal copy_s
        if not 0 <= i < len(m.segments) or not isinstance(target, torch.Tensor):
            raise ValueError(f"{path}: no tensor to restore segment {i} into")
        seg, local = m.segments[i], _local(target)
        if list(local.shape) != seg.shape or _dtype_name(local) != seg.dtype:
            raise ValueError(f"{path}: {seg.dtype}{seg.shape} in memory, "
                             f"{_dtype_name(local)}{list(local.shape)} here")
        if seg.nbytes and device_copy is not None and local.is_cuda and local.is_contiguous():
            batch.append((local, seg.offset))
        elif seg.nbytes:
            c0 = time.perf_counter()
            with torch.no_grad():
                _from_slot(data, seg.offset, local, getattr(torch, seg.dtype))
            copy_s += time.perf_counter() - c0
            if local.is_cuda:
                devices.add(local.device)
        return target

    filled = {}
    batch: list[tuple[torch.Tensor, int]] = []
    try:
        for key in m.keys:
            filled[key] = mf.unflatten(tree[key], state[key].state_dict(), fill, key)
        if batch:
            c0 = time.perf_counter()
            device_copy(batch)  # type: ignore[misc]
            copy_s += time.perf_counter() - c0
        at["load_copies_issued"] = time.time()
        if cuda:
            await_copies(devices)
        at["load_copies_landed"] = time.time()
    finally:
        if pin is not None:
            pin.release()
    for key in m.keys:
        state[key].load_state_dict(filled[key])
    at["load_parts_loaded"] = time.time()
    return copy_s
