"""The memory tier's device-to-host copies, landing beside the next step.

A save on a GPU issues its copies on a stream of its own, after everything the training
stream has queued (the step's update), and returns at once: the next step's forward and
backward only read what is copied, so they run while the bytes move (13.7 GB took 0.27 s
of a 0.22 s step at the host link's 51 GB/s on one H200, every step waiting for it). What
changes the copied tensors waits for the copies on the device, never on the host: torch's
optimizer step pre-hook makes the training stream wait for their event (``fence``), and
so does a restore into the same tensors. What reads the slot on the host (the commit's
digest, a durable save's copy out of it) waits for the event first (``Landing.wait``).
When the rank's standby makes the copies (``copier``), a ``CopierLanding`` stands for them.
Without a GPU the copies are memory moves, done when ``save`` returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

# How often a host thread waiting for the copies looks again (and at its cancel flag).
POLL_S = 0.002


@dataclass(frozen=True)
class Landing:
    """One save's copies: ``event`` is recorded on the copy stream after the last."""

    event: torch.cuda.Event
    device: torch.device

    def landed(self) -> bool:
        return self.event.query()

    def wait(self, cancel: threading.Event | None = None) -> bool:
        """Until the copies have landed (True), or ``cancel`` is set first (False). Polls,
        so an in-job recovery's cancel ends a wait behind a collective that will not end."""
        while not self.event.query():
            if cancel is not None and cancel.is_set():
                return False
            time.sleep(POLL_S)
        return True

    def fence(self) -> None:
        """Make the training stream wait for the copies (the host does not)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CopierLanding:
    """One save's copies made by the standby's copier (``copier``): ``future`` resolves
    when they have landed, or fails when they were not made (the save is then not
    committed). The fence waits on the host: no event of another process is waited for on
    this GPU (one whose process died would never complete)."""

    def __init__(self, future: Future, log: Callable[[str], None]) -> None:
        self.future, self.log = future, log
        self.failed: str | None = None

    def landed(self) -> bool:
        return self.future.done()

    def wait(self, cancel: threading.Event | None = None) -> bool:
        while True:
            try:
                self.future.result(timeout=POLL_S * 5)
                return True
            except FutureTimeout:
                if cancel is not None and cancel.is_set():
                    return False
            except Exception as exc:  # noqa: BLE001 - a copy not made: not committed
                if self.failed is None:
                    self.failed = f"{type(exc).__name__}: {exc}"
                    self.log(f"memory tier: the standby's copies failed ({self.failed}); "
                             "this save is not committed")
                return False

    def fence(self) -> None:
        self.wait()


class CopyStream:
    """One rank's stream for the memory tier's copies, and the fence before each optimizer
    step (torch's global step pre-hook: every optimizer of the process, ours included)."""

    def __init__(self, device: torch.device) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.last: Landing | CopierLanding | None = None
        self._hook = register_optimizer_step_pre_hook(lambda *_: self.fence())

    def begin(self) -> torch.cuda.StreamContext:
        """Enter to issue copies: they start after the training stream's queued work. A
        temporary made inside (``contiguous``) is allocated on the copy stream, so its
        memory is not reused by the training stream before the copy has read it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def end(self) -> Landing:
        event = torch.cuda.Event()
        event.record(self.stream)
        self.last = Landing(event, self.device)
        return self.last

    def fence(self) -> None:
        """Make the training stream wait for the last save's copies (the host does not)."""
        landing = self.last
        if landing is None:
            return
        if landing.landed():
            self.last = None
            return
        landing.fence()

    def close(self) -> None:
        self._hook.remove()
