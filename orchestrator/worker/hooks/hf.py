"""Hugging Face ``Trainer`` (and what runs on it: TRL's trainers, accelerate underneath): a
``TrainerCallback`` and a few wrapped ``Trainer`` methods.

``attach(trainer)`` (or the preload hook, for every ``Trainer`` an unchanged script makes)
adds :class:`OrchestratorCallback` and wraps, on that trainer only:

- ``_clip_grad_norm``: the gradient norm before clipping (a callback sees the gradients
  only after), the norm the stability detectors need;
- ``train``: resume from the job's newest committed checkpoint when the script names none
  (``resume_from_checkpoint``): the model, optimizer, scheduler, RNG states and the data
  position the ``Trainer`` keeps in its checkpoint;
- ``_save_checkpoint``: every save (``save_strategy``'s and ours, every
  ``checkpoint.interval_steps`` and at an operator's stop) runs in the ``checkpointing``
  phase and its ``checkpoint-N`` directory is moved into the job's layout and committed
  (``checkpoints``);
- ``evaluate``: the ``evaluating`` phase;
- ``_run_epoch``: no epoch starts once ``max_steps`` are done (a resume from the final
  checkpoint trains no step more).

The loss of a step is the ``Trainer``'s running training loss since the step began (summed
over gradient accumulation), averaged over the ranks; the skip decision is taken in
``on_pre_optimizer_step`` by dropping the gradients (the scheduler still steps, as it does
for an update skipped by mixed precision).
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from typing import Any

from orchestrator.worker.hooks.core import FrameworkHook

_ATTACHED = "_orchestrator_hook"
_class: type | None = None


def callback_class() -> type:
    global _class
    if _class is None:
        from transformers import TrainerCallback

        _class = type("OrchestratorCallback", (_Callback, TrainerCallback), {})
    return _class


class _Callback:
    def __init__(self, trainer: Any, hook: FrameworkHook | None = None) -> None:
        self._trainer = weakref.ref(trainer)  # the trainer holds this callback
        self.hook = hook
        self._loss_at_begin: float = 0.0
        self.clip_norm: float | None = None

    @property
    def trainer(self) -> Any:
        return self._trainer()

    def _ensure(self) -> FrameworkHook:
        if self.hook is None:
            self.hook = FrameworkHook("hf")
        return self.hook

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._loss_at_begin = _running_loss(self.trainer)
        self.clip_norm = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hook = self._ensure()
        loss = _running_loss(self.trainer) - self._loss_at_begin
        model = kwargs.get("model") or self.trainer.model
        hook.before_update(state.global_step + 1, loss, model.parameters(),
                           grad_norm=self.clip_norm)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hook = self._ensure()
        step = state.global_step
        lr = None
        optimizer = kwargs.get("optimizer")
        if optimizer is not None and optimizer.param_groups:
            lr = optimizer.param_groups[0].get("lr")
        tokens = getattr(state, "num_input_tokens_seen", None) or None
        hook.after_update(step, lr=lr, tokens=tokens, epoch=state.epoch)
        ckpts = hook.checkpoints
        if ckpts is not None and (step % ckpts.interval == 0 or hook.stopping
                                  or step >= state.max_steps > 0):
            control.should_save = True
        if hook.stopping:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook is not None:
            self.hook.set_phase("finishing")


def attach(trainer: Any, hook: FrameworkHook | None = None) -> Any:
    """Instrument one Hugging Face ``Trainer`` (idempotent); returns it.

    Nothing here holds the trainer strongly (the callback and the wrapped methods reach it
    through a weak reference): a trainer the script drops is freed then, with its DDP
    model and the process group's references it keeps, as an unattached one is, not left
    to the garbage collection of the interpreter's shutdown."""
    if getattr(trainer, _ATTACHED, None) is not None:
        return trainer
    cb = callback_class()(trainer, hook)
    trainer.add_callback(cb)
    setattr(trainer, _ATTACHED, cb)
    ref = weakref.ref(trainer)
    for name, wrapper in _WRAPPERS.items():
        if hasattr(trainer, name):
            setattr(trainer, name, _bind(ref, cb, _unbound(trainer, name), wrapper))
    return trainer


def _unbound(trainer: Any, name: str) -> Any:
    """``trainer.name`` as a function taking the trainer first (no reference to it kept)."""
    bound = getattr(trainer, name)
    if getattr(bound, "__self__", None) is trainer:
        return bound.__func__
    return lambda _trainer, *args, **kwargs: bound(*args, **kwargs)  # the script's own


def _bind(ref: Any, cb: Any, original: Any, wrapper: Any) -> Any:
    @functools.wraps(original)
    def method(*args: Any, **kwargs: Any) -> Any:
        return wrapper(ref(), cb, original, *args, **kwargs)

    return method


def _clip_and_keep(trainer: Any, cb: Any, clip: Any, *args: Any, **kwargs: Any) -> Any:
    norm = clip(trainer, *args, **kwargs)
    cb.clip_norm = float(norm) if norm is not None else None
    return norm


def _train_from_newest(trainer: Any, cb: Any, train: Any, *args: Any, **kwargs: Any) -> Any:
    ckpts = cb._ensure().checkpoints
    if not args and kwargs.get("resume_from_checkpoint") in (None, False) \
            and ckpts is not None:
        found = ckpts.newest()
        if found is not None:
            kwargs["resume_from_checkpoint"] = found[1]
    return train(trainer, *args, **kwargs)


def _run_epoch_unless_done(trainer: Any, cb: Any, run_epoch: Any, *args: Any,
                           **kwargs: Any) -> Any:
    """No epoch starts once ``max_steps`` are done. The ``Trainer`` tests for the end only
    after a step: resumed from its final checkpoint (a job restarted after its last save),
    it would train one step past ``max_steps`` (at learning rate 0 on a decaying schedule:
    the same parameters, but one step more counted, reported and saved)."""
    state = trainer.state
    if 0 < state.max_steps <= state.global_step:
        trainer.control.should_training_stop = True
        return None
    return run_epoch(trainer, *args, **kwargs)


def _save_into_layout(trainer: Any, cb: Any, save: Any, model: Any, trial: Any = None,
                      *args: Any, **kwargs: Any) -> Any:
    hook = cb._ensure()
    step = trainer.state.global_step
    t0 = time.perf_counter()
    with hook.phase("checkpointing"):
        out = save(trainer, model, trial, *args, **kwargs)
        ckpts = hook.checkpoints
        if ckpts is not None:
            _barrier()  # every rank's files (its RNG state) are written
            source = os.path.join(trainer._get_output_dir(trial=trial), f"checkpoint-{step}")
            ckpts.adopt(step, source)
            ckpts.commit(step, tokens=getattr(trainer.state, "num_input_tokens_seen", 0),
                         blocking_s=time.perf_counter() - t0, framework="hf")
            _barrier()  # no rank goes on (or resumes) before the commit
    return out


def _evaluate_in_phase(trainer: Any, cb: Any, evaluate: Any, *args: Any, **kwargs: Any) -> Any:
    with cb._ensure().phase("evaluating"):
        return evaluate(trainer, *args, **kwargs)


# The Trainer's methods wrapped on an attached instance (``_run_epoch``: transformers 5's
# epoch loop, where there is one).
_WRAPPERS = {"_clip_grad_norm": _clip_and_keep, "train": _train_from_newest,
             "_run_epoch": _run_epoch_unless_done, "_save_checkpoint": _save_into_layout,
             "evaluate": _evaluate_in_phase}


def patch_class(module: Any) -> None:
    """The preload hook's part: every ``Trainer`` (and subclass) is attached when made."""
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


def _running_loss(trainer: Any) -> float:
    loss = getattr(trainer, "_tr_loss", None)
    if loss is None:
        return 0.0
    return float(loss.detach().float().item()) if hasattr(loss, "detach") else float(loss)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
