"""torchtitan: its ``Trainer`` has no callback API, so the hook wraps the methods its
training loop (``Trainer.train``) calls, on one trainer instance:

- ``forward_backward_step``: each micro-batch's loss (summed over gradient accumulation);
- ``optimizers.step``: the skip decision just before the update (torchtitan has clipped by
  then and its ``clip_grad_norm_`` returned the norm before clipping, which
  ``_clip_grad_norm`` keeps), the global loss and the operator's stop request agreed by
  every rank;
- ``train_step``: the step record once the step is done (loss, grad norm, LR, tokens);
- ``checkpointer.save``: the ``checkpointing`` phase, and torchtitan's ``step-N`` directory
  (DCP) moved into the job's layout and committed (sync saves: an async save's directory
  is committed at the next save, once its files are there);
- ``checkpointer.load``: the newest committed checkpoint, linked where torchtitan looks;
- ``validator.validate``: the ``evaluating`` phase.

Tested against this interface (tests/unit/orchestrator/test_framework_hooks_unit.py), not
against torchtitan itself: torchtitan 0.3 does not run on a CPU-only host (its device
falls back to ``cuda`` and ``Trainer.__init__`` calls ``torch.cuda.set_device``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from orchestrator.worker.hooks.core import FrameworkHook

_ATTACHED = "_orchestrator_hook"


class _State:
    def __init__(self, hook: FrameworkHook) -> None:
        self.hook = hook
        self.loss: Any = None
        self.grad_norm: float | None = None
        self.saved: set[int] = set()


def attach(trainer: Any, hook: FrameworkHook | None = None) -> Any:
    """Instrument one torchtitan ``Trainer`` (idempotent); returns it."""
    if getattr(trainer, _ATTACHED, None) is not None:
        return trainer
    state = _State(hook or FrameworkHook("torchtitan"))
    setattr(trainer, _ATTACHED, state)
    h = state.hook
    fwd_bwd, train_step = trainer.forward_backward_step, trainer.train_step
    opt_step = trainer.optimizers.step
    save, load = trainer.checkpointer.save, trainer.checkpointer.load

    @functools.wraps(fwd_bwd)
    def forward_backward_step(*args: Any, **kwargs: Any) -> Any:
        loss = fwd_bwd(*args, **kwargs)
        detached = loss.detach()
        state.loss = detached if state.loss is None else state.loss + detached
        return loss

    @functools.wraps(opt_step)
    def optimizers_step(*args: Any, **kwargs: Any) -> Any:
        params = [p for m in trainer.model_parts for p in m.parameters()]
        h.before_update(trainer.step, state.loss, params, grad_norm=state.grad_norm)
        return opt_step(*args, **kwargs)

    @functools.wraps(train_step)
    def step_and_report(*args: Any, **kwargs: Any) -> Any:
        state.loss, state.grad_norm = None, None
        out = train_step(*args, **kwargs)
        lr = None
        opts = getattr(trainer.optimizers, "optimizers", None) or []
        if opts and opts[0].param_groups:
            lr = opts[0].param_groups[0].get("lr")
        h.after_update(trainer.step, lr=lr, tokens=getattr(trainer, "ntokens_seen", None))
        ckpts = h.checkpoints
        if h.stopping and ckpts is not None:
            checkpointer_save(trainer.step, last_step=True)
            trainer.config.training.steps = trainer.step  # the loop ends after this step
        return out

    @functools.wraps(save)
    def checkpointer_save(curr_step: int, last_step: bool = False, **kwargs: Any) -> Any:
        ckpts = h.checkpoints
        with h.phase("checkpointing"):
            out = save(curr_step, last_step=last_step, **kwargs)
            folder = getattr(trainer.checkpointer, "folder", None)
            source = os.path.join(folder, f"step-{curr_step}") if folder else None
            if ckpts is not None and source and os.path.isdir(source) \
                    and curr_step not in state.saved:
                _barrier()
                ckpts.adopt(curr_step, source)
                ckpts.commit(curr_step, tokens=getattr(trainer, "ntokens_seen", 0),
                             framework="torchtitan")
                state.saved.add(curr_step)
                _barrier()
        return out

    @functools.wraps(load)
    def checkpointer_load(step: int = -1, **kwargs: Any) -> Any:
        ckpts = h.checkpoints
        folder = getattr(trainer.checkpointer, "folder", None)
        if ckpts is not None and folder and step == -1:
            found = ckpts.newest()
            if found is not None:
                step, path = found
                link = os.path.join(folder, f"step-{step}")
                if ckpts.rank == 0 and not os.path.exists(link):
                    os.makedirs(folder, exist_ok=True)
                    os.symlink(path, link)
                _barrier()
                state.saved.add(step)
        return load(step=step, **kwargs)

    trainer.forward_backward_step = forward_backward_step
    trainer.train_step = step_and_report
    trainer.optimizers.step = optimizers_step
    trainer.checkpointer.save = checkpointer_save
    trainer.checkpointer.load = checkpointer_load
    validator = getattr(trainer, "validator", None)
    if validator is not None and hasattr(validator, "validate"):
        validate = validator.validate

        @functools.wraps(validate)
        def validate_in_phase(*args: Any, **kwargs: Any) -> Any:
            with h.phase("evaluating"):
                return validate(*args, **kwargs)

        validator.validate = validate_in_phase
    return trainer


def keep_grad_norm(trainer: Any, norm: Any) -> None:
    """What torchtitan's ``clip_grad_norm_`` returned (the norm before clipping)."""
    state = getattr(trainer, _ATTACHED, None)
    if state is not None and norm is not None:
        state.grad_norm = float(norm)


def patch_class(module: Any) -> None:
    """The preload hook's part: every torchtitan ``Trainer`` is attached when made, and the
    norm its ``clip_grad_norm_`` returns (before clipping) is kept for its step record."""
    import weakref

    cls = module.Trainer
    if getattr(cls, "_orchestrator_patched", False):
        return
    init = cls.__init__
    made: weakref.WeakSet[Any] = weakref.WeakSet()

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        attach(self)
        made.add(self)

    cls.__init__ = __init__
    cls._orchestrator_patched = True
    dist_utils = getattr(module, "dist_utils", None)
    clip = getattr(dist_utils, "clip_grad_norm_", None)
    if clip is not None:
        @functools.wraps(clip)
        def clip_and_keep(*args: Any, **kwargs: Any) -> Any:
            norm = clip(*args, **kwargs)
            for trainer in list(made):
                keep_grad_norm(trainer, norm)
            return norm

        dist_utils.clip_grad_norm_ = clip_and_keep


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
