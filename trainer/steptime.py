"""The step-time breakdown of the step records: data wait, forward+backward, optimizer,
checkpoint block.

The loop times the data wait and the whole backend step with ``time.perf_counter`` (it did
before); the optimizer's share comes from torch's global optimizer step pre/post hooks, two
clock reads per optimizer step, so every backend (DeepSpeed's engine, NxD's optimizer, ours)
is timed without a change to its ``Stepper``. ``fwd_bwd_s`` is the rest of the backend step:
forward, backward, the gradient norm and clipping. The checkpoint block (``ckpt_block_s``) is
the checkpointer's own figure.

Host times: no synchronisation is added (that would cost what the breakdown must not). On an
accelerator, kernels launched in one section may still run in the next, where the next read
of a value waits for them: the loss and the gradient norm are read every step, so forward and
backward end there, while the optimizer's kernels finish inside the next step's forward.
"""

from __future__ import annotations

import time
from typing import Any


class OptimizerTimer:
    """Seconds spent inside optimizer ``step`` calls since the last :meth:`take`."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._t0: float | None = None
        self._handles: list[Any] = []

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._t0 is not None:
            self._seconds += time.perf_counter() - self._t0
            self._t0 = None

    def install(self) -> OptimizerTimer:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles = [register_optimizer_step_pre_hook(self._pre),
                         register_optimizer_step_post_hook(self._post)]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> float | None:
        """The optimizer seconds since the last take (None: no optimizer step ran)."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds if seconds > 0 else None
