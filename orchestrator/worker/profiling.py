"""Profiling on demand, in the rank: ``torch.profiler`` over the steps the supervisor names.

The operator's ``orchestrator profile`` becomes a per-node order in the assignment; the agent
hands each of its ranks a ``profile`` line on the local socket; the worker SDK's beat thread
reads it (:meth:`ProfileOrder.parse`) and arms a :class:`ProfileSession`. The training thread
only meets the session at its step boundaries (``step_done``, or the preload hook's optimizer
count): it starts ``torch.profiler`` when the step before ``start_step`` is done, marks each
step, and after ``steps`` steps stops it and writes the trace. With no order armed the
training thread pays one attribute test per step.

Every rank profiles the same steps: the supervisor picks ``start_step`` ahead of the newest
step any rank reported, far enough for the order to reach every rank first (see
``orchestrator.supervisor.profiles``). A rank that gets the order late starts at its next
step and says so (``first_step`` > ``start_step`` in its ``profile_written`` event).

Traces: ``RUN_DIR/profiles/<start_step>/rank-K/trace.json`` (Chrome trace format, which
Perfetto and chrome://tracing open). No operator table is written beside it: the profiler's
``key_averages()`` takes seconds of Python in the training thread (8 s for 5 steps of a
small CPU model) where stopping and exporting the trace take well under one. This module
imports torch only when a profile starts.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The most steps a profile may cover (``orchestrator.contracts.protocol.MAX_PROFILE_STEPS``; the
# worker does not import the protocol module, and a test holds the two equal).
MAX_STEPS = 200
_MAX_ID = 1 << 31
_MAX_STEP = 1 << 53


class BadOrder(ValueError):
    """A profile line from the agent that is not a valid order."""


def _int(obj: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadOrder(f"profile order: {key} must be an integer in [{low}, {high}], "
                       f"not {str(value)[:40]!r}")
    return value


@dataclass(frozen=True)
class ProfileOrder:
    """One rank's profile order, as parsed from the agent's line."""

    id: int
    start_step: int
    steps: int

    @classmethod
    def parse(cls, obj: Any) -> ProfileOrder:
        """The order in ``obj`` (a decoded JSON line), or :class:`BadOrder` naming the field."""
        if not isinstance(obj, dict) or obj.get("t") != "profile":
            raise BadOrder("not a profile order")
        return cls(id=_int(obj, "id", 1, _MAX_ID), start_step=_int(obj, "start_step", 0,
                                                                      _MAX_STEP),
                   steps=_int(obj, "steps", 1, MAX_STEPS))

    def line(self) -> dict[str, Any]:
        """The order as the agent writes it (the inverse of :meth:`parse`)."""
        return {"t": "profile", "id": self.id, "start_step": self.start_step,
                "steps": self.steps}


def trace_dir(run_dir: str | Path, start_step: int, rank: int) -> Path:
    return Path(run_dir) / "profiles" / str(start_step) / f"rank-{rank}"


def warm_up() -> None:
    """Import what ``torch.profiler``'s start imports (it touches ``torch._inductor``, seconds
    of imports the first time). Called on the training thread at the first step end after
    the order, ahead of the profile's first step, and never on the beat thread: torch's
    modules imported from two threads at once fail with "partially initialized module"
    (the training thread's first optimizer imports ``torch._dynamo``, which imports
    ``torch._inductor.utils``). Only where the process has imported torch already."""
    if "torch" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        import torch.profiler  # noqa: F401
        import torch._inductor.config  # noqa: F401


def _activities(torch: Any) -> list[Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


class ProfileSession:
    """One armed order: started, stepped and written from the training thread's step ends.

    ``send(name, **data)`` reports ``profile_written`` or ``profile_failed``; a failure
    (no torch, a full disk) is reported, never raised into the training loop."""

    def __init__(self, order: ProfileOrder, rank: int, run_dir: str | Path,
                 send: Callable[..., None], clock: Callable[[], float] = time.perf_counter,
                 make_profiler: Callable[[], Any] | None = None) -> None:
        self.order = order
        self.rank = rank
        self.out = trace_dir(run_dir, order.start_step, rank)
        self._send = send
        self._clock = clock
        self._make = make_profiler or self._torch_profiler
        self._prof: Any = None
        self._prof_started = 0.0
        self._marker: Any = None  # the open ``ProfilerStep#<step>`` range
        self.first_step: int | None = None
        self.stepped = 0
        self.done = False
        self._warmed = False

    @staticmethod
    def _torch_profiler() -> Any:
        import torch

        return torch.profiler.profile(activities=_activities(torch), record_shapes=True,
                                      profile_memory=True, with_stack=False)

    def on_step(self, step: int) -> float:
        """``step`` just finished. Returns the seconds spent here (profiler start or
        export), which are not the training step's own time."""
        if self.done:
            return 0.0
        t0 = self._clock()
        try:
            if not self._warmed:
                self._warmed = True
                warm_up()
            if self._prof is None:
                if step + 1 >= self.order.start_step:
                    self._prof = self._make()
                    self._prof.start()
                    self.first_step = step + 1
                    self._prof_started = self._clock()
                    self._mark(step + 1)
            else:
                self._close_marker()
                self.stepped += 1
                if self.stepped >= self.order.steps:
                    self._finish(step)
                else:
                    self._mark(step + 1)
        except Exception as exc:  # noqa: BLE001 - a profile must never stop training
            self._fail(exc)
        return self._clock() - t0

    def _mark(self, step: int) -> None:
        """Open the range of ``step`` (named as torch.profiler's own step markers, which
        trace viewers and analysis tools know, with the training step's number)."""
        from torch.autograd.profiler import record_function

        self._marker = record_function(f"ProfilerStep#{step}")
        self._marker.__enter__()

    def _close_marker(self) -> None:
        marker, self._marker = self._marker, None
        if marker is not None:
            marker.__exit__(None, None, None)

    def _finish(self, last_step: int) -> None:
        prof, self._prof = self._prof, None
        profiled_s = self._clock() - self._prof_started
        prof.stop()
        t0 = self._clock()
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / "trace.json"
        prof.export_chrome_trace(str(trace))
        self.done = True
        self._send("profile_written", id=self.order.id, start_step=self.order.start_step,
                   first_step=self.first_step, last_step=last_step, path=str(trace),
                   bytes=trace.stat().st_size, profiled_s=round(profiled_s, 6),
                   export_s=round(self._clock() - t0, 6))

    def _fail(self, exc: BaseException) -> None:
        self.done = True
        with contextlib.suppress(Exception):
            self._close_marker()
        if self._prof is not None:
            with contextlib.suppress(Exception):  # already failing: stop what stops
                self._prof.stop()
            self._prof = None
        self._send("profile_failed", id=self.order.id, start_step=self.order.start_step,
                   error=f"{type(exc).__name__}: {exc}"[:4000])

    def abandon(self) -> None:
        """The rank is closing mid-profile: stop the profiler, say so."""
        if not self.done and self._prof is not None:
            self._fail(RuntimeError("the rank finished before the profile's last step"))
