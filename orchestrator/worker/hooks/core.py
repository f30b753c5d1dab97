"""What every framework hook shares: step records, phases, the skip decision, the stop
request, and the framework's saves committed in the orchestrator's layout.

A framework hook calls, per optimizer step, :meth:`FrameworkHook.before_update` (after
backward, before the optimizer: the global loss and grad norm, the skip decision, the
stop request agreed by every rank) and :meth:`FrameworkHook.after_update` (the step record).
Everything else (where the framework keeps its loss, how it saves) stays in the
framework's module.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orchestrator.worker as ow
from orchestrator.worker.hooks.checkpoints import FrameworkCheckpoints


@dataclass
class Verdict:
    """The step's figures every rank agrees on, taken before the update."""

    step: int
    loss: float | None
    grad_norm: float | None
    skip: bool
    stop: bool


def total_grad_norm(parameters: Iterable[Any]) -> float | None:
    """The total L2 norm of the gradients (global where the framework reduced them: DDP's
    are identical on every rank; a DTensor's partial norm is reduced here)."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if getattr(p, "grad", None) is not None]
    if not grads:
        return None
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return float(total)


def drop_grads(parameters: Iterable[Any]) -> None:
    """Skip the coming update: an optimizer leaves a parameter without a gradient alone
    (zeroed gradients would still move it through momentum and weight decay)."""
    for p in parameters:
        p.grad = None


class FrameworkHook:
    """One rank's link between a framework's training loop and the worker SDK."""

    def __init__(self, framework: str, worker: Any = None) -> None:
        self.framework = framework
        self.worker = worker if worker is not None else ow.current()
        # From here on the framework reports the rank's steps, not the preload hook's
        # optimizer count (which would report each step a second time).
        self.worker.progress = "sdk"
        self.ctx = self.worker.ctx
        cfg = self.ctx.job_config() if self.ctx.managed else {}
        self.guard = _skip_guard(cfg.get("stability"))
        self.checkpoints = FrameworkCheckpoints.from_job(self.ctx, cfg, self.worker)
        self.skipped = 0
        self._verdict: Verdict | None = None
        self._t_step: float | None = None
        self.stopping = False  # the operator's stop was agreed: save and end

    # -- per step ----------------------------------------------------------------------------
    def before_update(self, step: int, loss: Any, parameters: Iterable[Any],
                      grad_norm: float | None = None) -> Verdict:
        """After backward, before the optimizer's step ``step``: the global loss (a mean over
        the ranks) and grad norm, whether to skip the update (the stability module's
        ``skip_step`` rules, the same answer on every rank) and whether the operator asked
        for a stop (any rank's request, agreed in the same reduction). ``grad_norm``: the
        framework's own (global, before clipping) where it computed one."""
        params = list(parameters)
        local = _number(loss)
        asked = bool(getattr(self.worker, "checkpoint_requested", False))
        mean, stop = _agree(local, asked, params)
        norm = grad_norm if grad_norm is not None else total_grad_norm(params)
        skip = False
        if self.guard is not None and mean is not None:
            skip = self.guard.should_skip(step, mean, norm)
        if skip:
            drop_grads(params)
            self.skipped += 1
            self.worker.event("stability_skip", step=step, loss=_finite(mean),
                              grad_norm=_finite(norm))
        self._verdict = Verdict(step, mean, norm, skip, stop)
        return self._verdict

    def after_update(self, step: int, **metrics: Any) -> None:
        """The step is done: its record goes to the supervisor (rank 0's), its interval
        to the hang calibration (every rank's)."""
        v = self._verdict if self._verdict is not None and self._verdict.step == step else None
        now = time.perf_counter()
        record: dict[str, Any] = {"framework": self.framework}
        if v is not None:
            record["loss"] = v.loss
            if v.grad_norm is not None:
                record["grad_norm"] = v.grad_norm
            if v.skip:
                record["skipped"] = True
            self.stopping = self.stopping or v.stop
        if self._t_step is not None:
            record["step_time"] = round(now - self._t_step, 6)
        self._t_step = now
        record.update({k: val for k, val in metrics.items() if val is not None})
        self.worker.step_done(step, **record)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self.worker.phase(name):
            yield

    def set_phase(self, name: str) -> None:
        self.worker.set_phase(name)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().float().mean().item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _agree(loss: float | None, asked: bool, params: list[Any]) -> tuple[float | None, bool]:
    """One all-reduce for both: the mean loss over the ranks and whether any rank was asked
    to stop. Outside a process group, this rank's own values."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return loss, asked
    device = torch.device("cpu")
    if dist.get_backend() == "nccl" and params:
        device = params[0].device
    flag = torch.tensor([0.0 if loss is None else loss, 1.0 if asked else 0.0,
                         0.0 if loss is None else 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(flag)
    total, asks, counted = flag.tolist()
    mean = total / counted if counted else None
    return mean, asks > 0


def _skip_guard(stability: dict[str, Any] | None) -> Any:
    """The stability module's worker-side guard when a rule's action is ``skip_step``."""
    if not stability:
        return None
    from stability import SkipStepGuard
    from stability.config import StabilityConfig

    cfg = StabilityConfig.model_validate(stability)
    if "skip_step" not in cfg.rule_actions().values():
        return None
    return SkipStepGuard(cfg)
