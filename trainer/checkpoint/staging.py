"""Staging buffers for asynchronous saves, ready before the first save.

DCP's async save copies the state into host memory (the staging) and writes the files from
there in its background thread; training blocks for that copy only. A writer made with
``cache_staged_state_dict`` keeps its buffers (pinned on CUDA) from one save to the next, but
allocates them in its first save: page-locking gigabytes per GPU takes seconds, which that
save would block for (a later one blocks for a copy, 0.15 s for 6.8 GB on an H200). On CPU
every save would allocate (and page-fault) a fresh copy. How the pages are locked is the
rank's allocator setting (``trainer.distributed.pin_by_registration``).

``StagingBuffers`` allocates the same buffers (``host_like``: the layout DCP's own
``_create_cpu_state_dict`` builds, without its copy of every DTensor to the host, on CUDA a
pageable copy of the whole state beside training) in a background thread once a generation
has taken its first step (the optimizer's state exists then, so the state's structure is final),
and hands them to the writer (``StagingWriter``) at the first save. The first save then
blocks for a copy, as every later one does. Should the buffers not fit the state at a save
(checked on the state dict the save stages anyway: no second ``state_dict()`` call), or
their allocation fail, they are dropped with a log line and the writer allocates as before.
With the memory tier on, the buffers are plain memory (``pinned=False``): a save copies into
them from the memory tier's copy, not from the device (``slot_source``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """What DCP's async save stages: each ``Stateful`` replaced by its ``state_dict()``."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def host_like(obj: Any, pinned: bool = False) -> Any:
    """Host buffers shaped like ``obj``'s tensors, never reading them: the layout DCP's
    ``_create_cpu_state_dict`` gives (a DTensor's buffer is a DTensor of the same spec over
    a host tensor of its shard's shape; a 0-d tensor is a 0-d host one; other values are
    kept), without the copy it makes of every DTensor to the host first. On CUDA that copy
    is the whole state through pageable memory (13.7 GB for the 1.14B model on one rank):
    seconds in which the training thread's kernel launches wait on the driver."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return DTensor(host_like(obj._local_tensor, pinned), obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return torch.zeros((), dtype=obj.dtype)
        if obj.numel() == 0:
            return torch.zeros(obj.size(), dtype=obj.dtype)
        return torch.empty(obj.size(), dtype=obj.dtype, pin_memory=pinned)
    if isinstance(obj, dict):
        return {k: host_like(v, pinned) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_like(v, pinned) for v in obj]
    if isinstance(obj, tuple):
        return tuple(host_like(v, pinned) for v in obj)
    return obj


class StagingBuffers:
    """One rank's staging buffers: ``prepare`` (training thread, once per generation) starts
    the allocation in the background; ``take`` (at the first save) waits for it and returns
    the buffers when they fit the state, else None."""

    def __init__(self, device: torch.device | None, log: Callable[[str], None],
                 pinned: bool = True) -> None:
        self.device = device  # CUDA: allocated with this device current, off its stream
        self.pinned = pinned and device is not None and device.type == "cuda"
        self.log = log
        self._thread: threading.Thread | None = None
        self._buffers: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self.prepare_s: float | None = None  # background seconds the allocation took
        self.wait_s = 0.0  # seconds the first save waited for it (0: ready in time)

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def preparing(self) -> bool:
        """The background allocation is still running (training steps run slower)."""
        return self._thread is not None and self._thread.is_alive()

    def prepare(self, state: dict[str, Any]) -> None:
        """Start allocating buffers shaped like ``state`` (no-op after the first call). The
        state dicts are taken here, on the training thread, between steps; the thread only
        reads their tensors' shapes and allocates."""
        if self._thread is not None:
            return
        template = plain_state(state)
        self._thread = threading.Thread(target=self._allocate, args=(template,),
                                        name="ckpt-staging", daemon=True)
        self._thread.start()

    def _allocate(self, template: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            if self.device is not None and self.device.type == "cuda":
                # Pinned memory is registered with the current device's context: this
                # thread's must be the rank's own.
                torch.cuda.set_device(self.device)
                buffers = host_like(template, pinned=self.pinned)
                if not self.pinned:
                    _touch(buffers)
                self._buffers = buffers
            else:
                buffers = host_like(template)
                # torch.empty only reserves the memory: its pages would be faulted in by
                # the first save's copy (seconds for GBs on a busy host). Touch them here.
                _touch(buffers)
                self._buffers = buffers
        except Exception as exc:  # noqa: BLE001 - reported at take(); saves allocate then
            self._error = exc
        self.prepare_s = time.perf_counter() - t0

    def take(self) -> dict[str, Any] | None:
        """The buffers, once allocated (None, with a log line, if that failed). Waits for a
        background allocation still running."""
        if self._thread is None:
            return None
        t0 = time.perf_counter()
        self._thread.join()
        self.wait_s = time.perf_counter() - t0
        buffers, self._buffers = self._buffers, None
        if self._error is not None or buffers is None:
            self.log(f"staging buffers could not be allocated ahead ({self._error}): the "
                     "save allocates them")
            return None
        return buffers


class StagingWriter(dcp.FileSystemWriter):
    """DCP's filesystem writer keeping its staging buffers across saves (given ones, or its
    own pinned ones made by its first save on CUDA), checked against the state dict each
    save stages: buffers that no longer fit are dropped, never copied into."""

    def __init__(self, path: str, *, buffers: dict[str, Any] | None, pinned: bool,
                 log: Callable[[str], None], thread_count: int) -> None:
        super().__init__(path, cache_staged_state_dict=True, thread_count=thread_count)
        self.state_dict_cache = buffers
        self._pinned = pinned
        self._log = log

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        cache = self.state_dict_cache
        if cache is not None and not fits(state_dict, cache):
            self._log("staging buffers no longer fit the state (its keys or shapes changed): "
                      "allocated again")
            self.state_dict_cache = cache = None
        if cache is None and not self._pinned:
            # DCP's kept buffers are pinned, which needs an accelerator: plain copies each
            # save from now on, as a CPU save made before buffers were kept.
            self.cache_staged_state_dict = False
        return super().stage(state_dict)


def fitting(live: dict[str, Any], buffers: dict[str, Any] | None,
            log: Callable[[str], None]) -> dict[str, Any]:
    """``buffers`` when they fit ``live`` (a plain state), else plain ones shaped like it."""
    if buffers is not None and fits(live, buffers):
        return buffers
    if buffers is not None:
        log("host buffers no longer fit the state (its keys or shapes changed): allocated "
            "again")
    return host_like(live)


def _touch(obj: Any) -> None:
    """Write every buffer once (zeros), so its pages exist before a save copies into it."""
    if isinstance(obj, dict):
        for v in obj.values():
            _touch(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _touch(v)
    elif isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", obj)  # a DTensor's own shard
        if local.numel():
            local.zero_()


def fits(state: Any, buffers: Any) -> bool:
    """Whether ``buffers`` can take a copy of ``state``: the same keys and list lengths, and
    for every tensor (a DTensor's own shard) the same shape and dtype. Reads metadata only.
    (torch's ``_check_state_dict_similarity`` copies every tensor while it compares.)"""
    if isinstance(state, dict):
        return isinstance(buffers, dict) and state.keys() == buffers.keys() and all(
            fits(v, buffers[k]) for k, v in state.items())
    if isinstance(state, list | tuple):
        return isinstance(buffers, list | tuple) and len(state) == len(buffers) and all(
            fits(a, b) for a, b in zip(state, buffers, strict=True))
    if isinstance(state, torch.Tensor):
        if not isinstance(buffers, torch.Tensor):
            return False
        a, b = getattr(state, "_local_tensor", state), getattr(buffers, "_local_tensor", buffers)
        return a.shape == b.shape and a.dtype == b.dtype
    return not isinstance(buffers, torch.Tensor | dict | list | tuple)
