"""PyTorch Lightning: a ``Callback`` and a few wrapped ``Trainer`` methods.

``attach(trainer)`` (or the preload hook, for every ``Trainer`` an unchanged script makes)
adds :class:`OrchestratorCallback` and wraps the trainer's ``fit`` (resume from the job's
newest committed checkpoint when the script names none) and ``save_checkpoint`` (the
``checkpointing`` phase around every save, the script's own ``ModelCheckpoint`` ones too).

Per optimizer step the callback takes the loss from ``on_before_backward`` (summed over
gradient accumulation), the gradient norm and the skip decision in
``on_before_optimizer_step`` (after backward, before Lightning clips and steps: an unclipped
norm, and dropping the gradients there skips the update), and reports the step record in
``on_train_batch_end``. Every ``checkpoint.interval_steps``, at the last step and at an
operator's stop, it saves through ``Trainer.save_checkpoint`` into the job's step directory
and rank 0 commits it (``checkpoints``). Validation runs in the ``evaluating`` phase.
Works with ``lightning.pytorch`` and ``pytorch_lightning`` alike.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

from orchestrator.worker.hooks.core import FrameworkHook

CKPT_NAME = "lightning.ckpt"
_ATTACHED = "_orchestrator_hook"
_classes: dict[str, type] = {}


def _package_of(trainer_or_module: Any) -> str:
    name = trainer_or_module.__name__ if isinstance(trainer_or_module, type(sys)) \
        else type(trainer_or_module).__module__
    return "lightning.pytorch" if name.startswith("lightning.pytorch") else "pytorch_lightning"


def callback_class(package: str = "") -> type:
    """``OrchestratorCallback`` for ``package`` (``lightning.pytorch`` or
    ``pytorch_lightning``: their ``Callback`` bases are different classes)."""
    if not package:
        package = "lightning.pytorch" if "lightning.pytorch" in sys.modules \
            or "pytorch_lightning" not in sys.modules and _importable("lightning") \
            else "pytorch_lightning"
    if package not in _classes:
        import importlib

        base = importlib.import_module(package).Callback
        _classes[package] = type("OrchestratorCallback", (_Callback, base), {})
    return _classes[package]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class _Callback:
    """The callback's body (mixed into the framework's ``Callback``)."""

    def __init__(self, hook: FrameworkHook | None = None) -> None:
        self.hook = hook
        self._losses: list[Any] = []
        self._reported = -1
        self._saved = -1
        self.tokens = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.hook is None:
            self.hook = FrameworkHook("lightning")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._reported = trainer.global_step

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.hook is not None:
            self.hook.set_phase("evaluating")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.hook is not None:
            # Back to the phase of a rank between steps (before its first of this process:
            # init, which the calibrated training timeout does not judge).
            self.hook.set_phase("training" if self.hook.worker._step is not None else "init")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        step = trainer.global_step
        if self.hook is not None and step > 0 and self._saved != step:
            self._save(trainer, step)
        if self.hook is not None:
            self.hook.set_phase("finishing")

    # -- per step ----------------------------------------------------------------------------
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.hook is None:
            return
        loss = sum(self._losses) if self._losses else None
        self._losses = []
        self.hook.before_update(trainer.global_step + 1, loss, pl_module.parameters())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.hook is None or step <= self._reported:
            return  # a micro-batch of gradient accumulation: no optimizer step yet
        self._reported = step
        self.tokens += _tokens(batch) * max(1, trainer.world_size)
        lr = None
        if trainer.optimizers:
            lr = trainer.optimizers[0].param_groups[0].get("lr")
        self.hook.after_update(step, lr=lr, tokens=self.tokens or None, epoch=trainer.current_epoch)
        ckpts = self.hook.checkpoints
        due = ckpts is not None and step % ckpts.interval == 0
        if due or self.hook.stopping:
            self._save(trainer, step)
        if self.hook.stopping:
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens = int(state.get("tokens", 0))

    # -- saves --------------------------------------------------------------------------------
    def _save(self, trainer: Any, step: int) -> None:
        ckpts = self.hook.checkpoints if self.hook is not None else None
        if ckpts is None:
            return
        t0 = time.perf_counter()
        with self.hook.phase("checkpointing"):
            path = ckpts.prepare(step)
            trainer.strategy.barrier("orchestrator-save")  # rank 0 cleared the directory
            trainer.save_checkpoint(os.path.join(path, CKPT_NAME))
            trainer.strategy.barrier("orchestrator-saved")  # every rank's files are there
            ckpts.commit(step, tokens=self.tokens, blocking_s=time.perf_counter() - t0,
                         framework="lightning")
        self._saved = step


def attach(trainer: Any, hook: FrameworkHook | None = None) -> Any:
    """Instrument one Lightning ``Trainer`` (idempotent); returns it."""
    if getattr(trainer, _ATTACHED, None) is not None:
        return trainer
    cb = callback_class(_package_of(trainer))(hook)
    trainer.callbacks.append(cb)
    setattr(trainer, _ATTACHED, cb)
    fit, save = trainer.fit, trainer.save_checkpoint

    @functools.wraps(fit)
    def fit_from_newest(*args: Any, **kwargs: Any) -> Any:
        if cb.hook is None:
            cb.hook = FrameworkHook("lightning")
        ckpts = cb.hook.checkpoints
        # fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path)
        if kwargs.get("ckpt_path") is None and len(args) < 5 and ckpts is not None:
            found = ckpts.newest()
            if found is not None:
                kwargs["ckpt_path"] = os.path.join(found[1], CKPT_NAME)
                cb._saved = found[0]
        return fit(*args, **kwargs)

    @functools.wraps(save)
    def save_in_phase(*args: Any, **kwargs: Any) -> Any:
        if cb.hook is None or cb.hook.worker._phase == "checkpointing":
            return save(*args, **kwargs)
        with cb.hook.phase("checkpointing"):
            return save(*args, **kwargs)

    trainer.fit = fit_from_newest
    trainer.save_checkpoint = save_in_phase
    return trainer


def patch_class(module: Any) -> None:
    """The preload hook's part: every ``Trainer`` of ``module`` is attached when made."""
    cls = module.Trainer
    if getattr(cls, "_orchestrator_patched", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        attach(self)

    cls.__init__ = __init__
    cls._orchestrator_patched = True


def _tokens(batch: Any) -> int:
    """Tokens (or samples) in a batch: its input ids' elements where it has them."""
    first = batch
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, list | tuple) and batch:
        first = batch[0]
    numel = getattr(first, "numel", None)
    return int(numel()) if callable(numel) else 0
