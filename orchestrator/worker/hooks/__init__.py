"""Framework hooks: Lightning, the Hugging Face ``Trainer`` and torchtitan report to the
orchestrator through their own extension points.

Each hook (``lightning``, ``hf``, ``torchtitan``) is a small module over the shared
:class:`~orchestrator.worker.hooks.core.FrameworkHook`: per-step records (loss, grad norm,
learning rate, tokens), phases (evaluating, checkpointing), the stability module's skip
decision, the operator's checkpoint-before-stop, and saves that land in the orchestrator's
checkpoint layout (``checkpoints``). Nothing here imports a framework at import time: each
module imports its framework when used, and :func:`install` (called by the preload hook)
only registers post-import hooks, so a rank that never imports Lightning pays nothing.

One line in a script::

    trainer = Trainer(...)                             # Lightning or Hugging Face
    orchestrator.worker.hooks.attach(trainer)          # no-op outside the orchestrator

and under the orchestrator an unchanged script gets the same from the preload hook
(``job.framework_hooks``, on by default).
"""

from __future__ import annotations

from typing import Any

# module the framework's trainer lives in -> our module that instruments it
_TRAINER_MODULES = {
    "pytorch_lightning.trainer.trainer": "lightning",
    "lightning.pytorch.trainer.trainer": "lightning",
    "transformers.trainer": "hf",
    "torchtitan.trainer": "torchtitan",
}


def attach(trainer: Any) -> Any:
    """Instrument ``trainer`` (a Lightning ``Trainer``, a Hugging Face ``Trainer`` or a
    torchtitan ``Trainer``) for the orchestrator; returns it. Idempotent."""
    for cls in type(trainer).__mro__:
        name = _TRAINER_MODULES.get(cls.__module__)
        if name is not None:
            return _hook_module(name).attach(trainer)
    raise TypeError(f"{type(trainer).__module__}.{type(trainer).__qualname__}: not a trainer "
                    "of Lightning, Hugging Face transformers or torchtitan")


def _hook_module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"orchestrator.worker.hooks.{name}")


def install() -> None:
    """Attach every framework trainer this process creates (the preload hook's part): each
    trainer class is patched when its module is imported, never before."""
    from wrapt import register_post_import_hook

    for module, name in _TRAINER_MODULES.items():
        def on_import(mod: Any, name: str = name) -> None:
            _hook_module(name).patch_class(mod)

        register_post_import_hook(on_import, module)


__all__ = ["attach", "install"]
