"""Phases of a script without the SDK, read from what it calls between its steps.

The preload hook counts a script's optimizer steps; between two of them the calibrated
training timeout (a few step intervals, a second or two) judges it. A script's evaluation,
its own saves and a data loader starting an epoch take longer than that and are no hang, so
the hook marks them, as the SDK's ``phase()`` would:

- ``nn.Module.eval()`` (``train(False)``) puts the rank in ``evaluating`` until
  ``train(True)`` or its next optimizer step;
- ``torch.save`` and ``torch.distributed.checkpoint.save`` run in ``checkpointing``;
- a new ``DataLoader`` iterator (an epoch's start: worker processes, shuffling, the first
  batches) puts the rank in ``loading`` until its next optimizer step.

Each acts only while the script reports no steps of its own (``Worker.progress == "hook"``:
a script using the SDK or a framework hook marks its phases itself), only on the rank's
main thread (a background saver is not the training thread) and only on the outermost call
(``eval()`` recurses into every submodule). Each phase's own timeout then applies
(``timeouts.phases``), and the time spent in it is not step time.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_MODULE = "torch.nn.modules.module"
_SERIALIZATION = "torch.serialization"
_DCP = "torch.distributed.checkpoint.state_dict_saver"
_DATALOADER = "torch.utils.data.dataloader"


class ScriptPhases:
    """Marks the phases of one rank's script on its worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._depth = threading.local()
        self._main = threading.main_thread()

    def _applies(self) -> bool:
        return self.worker.progress == "hook" and threading.current_thread() is self._main \
            and self.worker._step is not None  # before its first step the rank is in init

    def _outermost(self) -> bool:
        return getattr(self._depth, "n", 0) == 0

    def mode_changed(self, training: bool) -> None:
        """``Module.train(training)`` called from outside ``train`` itself."""
        if not self._applies():
            return
        phase = self.worker._phase
        if not training and phase == "training":
            self.worker.set_phase("evaluating")
        elif training and phase == "evaluating":
            self.worker.set_phase("training")

    def saving(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def save(*args: Any, **kwargs: Any) -> Any:
            if not self._outermost() or not self._applies() \
                    or self.worker._phase == "checkpointing":
                return fn(*args, **kwargs)
            self._depth.n = 1
            try:
                with self.worker.phase("checkpointing"):
                    return fn(*args, **kwargs)
            finally:
                self._depth.n = 0
        save._orchestrator_phase = True  # type: ignore[attr-defined]
        return save

    def new_epoch(self) -> None:
        if self._applies() and self.worker._phase == "training":
            self.worker.set_phase("loading")


def install(worker: Any) -> ScriptPhases:
    """Register the wrappers; each lands when the script imports its module."""
    from wrapt import register_post_import_hook

    phases = ScriptPhases(worker)

    def on_module(mod: Any) -> None:
        cls = mod.Module
        original = cls.train
        if getattr(original, "_orchestrator_phase", False):
            return

        @functools.wraps(original)
        def train(self: Any, mode: bool = True) -> Any:
            if not phases._outermost():
                return original(self, mode)
            phases._depth.n = 1
            try:
                return original(self, mode)
            finally:
                phases._depth.n = 0
                phases.mode_changed(bool(mode))

        train._orchestrator_phase = True  # type: ignore[attr-defined]
        cls.train = train

    def on_serialization(mod: Any) -> None:
        if not getattr(mod.save, "_orchestrator_phase", False):
            mod.save = phases.saving(mod.save)
            import torch

            torch.save = mod.save

    def on_dcp(mod: Any) -> None:
        if not getattr(mod.save, "_orchestrator_phase", False):
            mod.save = phases.saving(mod.save)
            import torch.distributed.checkpoint as dcp

            dcp.save = mod.save

    def on_dataloader(mod: Any) -> None:
        cls = mod.DataLoader
        original = cls.__iter__
        if getattr(original, "_orchestrator_phase", False):
            return

        @functools.wraps(original)
        def __iter__(self: Any) -> Any:
            it = original(self)
            phases.new_epoch()
            return it

        __iter__._orchestrator_phase = True  # type: ignore[attr-defined]
        cls.__iter__ = __iter__

    register_post_import_hook(on_module, _MODULE)
    register_post_import_hook(on_serialization, _SERIALIZATION)
    register_post_import_hook(on_dcp, _DCP)
    register_post_import_hook(on_dataloader, _DATALOADER)
    return phases
