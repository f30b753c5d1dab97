"""The worker SDK: the only part of ``orchestrator`` a training process imports.

A plain torchrun loop becomes fault-tolerant with a few lines::

    import orchestrator.worker as ow

    ow.init()                                  # heartbeats start (no-op outside orchestrator)
    with ow.phase("loading"):
        start = load_checkpoint_if_any()
    for step in range(start, steps):
        loss = train_step()
        ow.step_done(step + 1, loss=loss)      # progress, not mere liveness
        if (step + 1) % 100 == 0:
            with ow.phase("checkpointing"):
                save(step + 1)
    ow.shutdown()

It imports nothing of the supervisor side and never imports torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from orchestrator.worker.sdk import PHASES, Worker, WorkerContext, running_under_orchestrator

_worker: Worker | None = None


def init(**kwargs: Any) -> Worker:
    """Start this process's worker (idempotent) and return it. From here on the script
    reports its own steps (``step_done``), even where the preload hook started the worker."""
    global _worker
    if _worker is None:
        _worker = Worker(**kwargs).start()
    _worker.progress = "sdk"
    return _worker


def start_from_hook(env: Mapping[str, str]) -> Worker:
    """The preload hook's worker: steps come from optimizer steps until the script calls
    :func:`init` itself."""
    global _worker
    if _worker is None:
        _worker = Worker(env=env)
        _worker.progress = "hook"
        _worker.start()
    return _worker


def current() -> Worker:
    """The process's worker (started by the hook or by :func:`init`); starting it here
    counts as the script using the SDK."""
    return _worker if _worker is not None else init()


def context() -> WorkerContext:
    """This generation's facts: rank, generation, checkpoint root, skip windows, ..."""
    return current().ctx


def step_done(step: int, **metrics: Any) -> None:
    current().step_done(step, **metrics)


def set_phase(name: str) -> None:
    current().set_phase(name)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    with current().phase(name):
        yield


def event(name: str, **data: Any) -> None:
    current().event(name, **data)


def disturbed_while(busy: Callable[[], bool]) -> None:
    """Work beside training slows the steps until ``busy()`` is False: they are judged by
    the ``loading`` timeout and do not calibrate the hang timeout (see ``Worker``)."""
    current().disturbed_while(busy)


def recoverable(*, model: Any, optimizer: Any, loader: Any = None,
                extra: Mapping[str, Any] | None = None,
                regroup: Callable[[], None] | None = None) -> Any:
    """Register this rank's state for in-job recovery (``orchestrator.worker.recoverable``):
    kept in the node's memory tier, rolled back in place when a peer rank dies or hangs.
    Call after the script's process groups exist; returns the
    :class:`~orchestrator.worker.recoverable.Recoverable` whose ``restore``, ``step_done``
    and ``recover`` the training loop calls."""
    from orchestrator.worker.recoverable import Recoverable

    return Recoverable(current(), model=model, optimizer=optimizer, loader=loader,
                       extra=extra, regroup=regroup)


def shutdown() -> None:
    """Flush the last beat and stop the beat thread."""
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


__all__ = ["PHASES", "Worker", "WorkerContext", "context", "current", "disturbed_while", "event",
           "init", "phase", "recoverable", "running_under_orchestrator", "set_phase",
           "shutdown", "step_done"]
