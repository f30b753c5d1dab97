"""The preload hook: progress and stacks from any training script, with no code change.

``orchestrator/worker/preload/sitecustomize.py`` calls :func:`install` at interpreter
start-up in every rank the agent starts. It

- starts the worker SDK's heartbeat thread (``orchestrator.worker``'s shared worker);
- counts optimizer steps through torch's global optimizer step post hook, once
  ``torch.optim`` is imported, and reports them as the rank's steps: the rank's phase turns
  ``training`` at its first optimizer step and the step intervals calibrate the hang timeout;
- installs the faulthandler stack dump on SIGUSR1 (the SDK's, into the run's ``stacks/``);
- under ``job.framework_hooks`` (on by default), attaches the orchestrator's hook to every
  Lightning, Hugging Face or torchtitan ``Trainer`` the script makes
  (``orchestrator.worker.hooks``): step records, phases, the skip decision and saves in the
  job's checkpoint layout;
- marks what a script without the SDK does between its steps (``scriptphases``): an
  evaluation and a save run in their own phases, not under the tight training timeout;
- sets torch.distributed's default collective timeout to the supervisor's choice
  (``ORCH_COLLECTIVE_TIMEOUT_S``) once ``torch.distributed`` is imported, so a script that
  passes no timeout gets ours instead of gloo's 30 minutes.

A script that also uses the SDK (``orchestrator.worker.init()``) takes over its steps and
phases: from then on the hook's optimizer count is ignored. The hook imports neither torch
nor anything heavy itself; it acts when the script imports torch. It runs only in the rank's
own process (``ORCH_HOOK_PID``): a DataLoader worker or a subprocess the script starts
inherits the environment but sends nothing.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import weakref
from collections.abc import MutableMapping
from typing import Any

from orchestrator.contracts import env as ec

_OPTIMIZER_MODULE = "torch.optim.optimizer"
# The worker event a rank sends with its optimizer's step count at its first step.
RESUME_EVENT = "optimizer_resume"
_C10D_MODULE = "torch.distributed.distributed_c10d"


class StepCounter:
    """Optimizer steps of this process; the rank's step is the most-stepped optimizer's count
    (a GAN's two optimizers, or a model split over two, step once per iteration each)."""

    def __init__(self, on_step: Any, on_resume: Any = None) -> None:
        self._counts: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._on_step = on_step
        self._on_resume = on_resume
        self.steps = 0

    def __call__(self, optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
        if _creating_state_for_dcp():
            return
        with self._lock:
            n = self._counts.get(optimizer, 0) + 1
            self._counts[optimizer] = n
            advanced = n > self.steps
            if advanced:
                self.steps = n
        if advanced and n == 1 and self._on_resume is not None:
            before = optimizer_state_step(optimizer)
            if before is not None:  # the steps the optimizer had taken before this process
                self._on_resume(before - 1)
        if advanced:
            self._on_step(n)


# DCP's state-dict helpers (``get_/set_optimizer_state_dict``, used by torchtitan, Lightning's
# FSDP2 path and our trainer) create an empty optimizer's state by stepping it once with zero
# gradients and lr 0. That is no training step: counted, it would make every rank report a
# resume from step 0, and a stateless optimizer's (SGD's) count grow by one at every save.
_DCP_INIT = ("_init_optim_state", "torch.distributed.checkpoint.state_dict")
_DCP_INIT_DEPTH = 8  # frames between the step's post hooks and the helper that stepped


def _creating_state_for_dcp() -> bool:
    frame = sys._getframe(2)  # past this function and the hook's __call__
    for _ in range(_DCP_INIT_DEPTH):
        if frame is None:
            return False
        if (frame.f_code.co_name, frame.f_globals.get("__name__")) == _DCP_INIT:
            return True
        frame = frame.f_back
    return False


def optimizer_state_step(optimizer: Any) -> int | None:
    """The optimizer's own step count (Adam, AdamW and most others keep ``step`` in each
    parameter's state, restored with ``load_state_dict``); None for one that keeps none
    (plain SGD)."""
    try:
        for state in optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None:
                return int(step.item() if hasattr(step, "item") else step)
    except Exception:  # noqa: BLE001 - an optimizer of its own kind: nothing to say
        return None
    return None


def set_default_collective_timeout(c10d: Any, seconds: float) -> None:
    """torch.distributed's default timeout for every backend (a call passing its own
    ``timeout=`` keeps it)."""
    timeout = datetime.timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def install(env: MutableMapping[str, str] | None = None) -> bool:
    """Install the hook in this process; False when it does not apply (not a managed rank,
    or a child of one)."""
    env = os.environ if env is None else env
    agent = ec.AgentEnv.from_env(env)
    if not agent.managed:
        return False
    owner = ec.get_int(env, ec.HOOK_PID, None)
    if owner is not None and owner != os.getpid():
        return False  # a child of the rank: the rank itself reports
    env[ec.HOOK_PID] = str(os.getpid())
    import orchestrator.worker as ow
    from orchestrator.worker import exitgc

    worker = ow.start_from_hook(env)
    # atexit runs last-registered first: the last beat, then the process groups freed.
    exitgc.register()
    atexit.register(ow.shutdown)
    _register_torch_hooks(worker, ec.GenerationEnv.from_env(env).collective_timeout_s)
    if _framework_hooks_wanted(agent.config_path):
        from orchestrator.worker import hooks

        hooks.install()
    from orchestrator.worker import scriptphases

    scriptphases.install(worker)
    return True


def _framework_hooks_wanted(config_path: str | None) -> bool:
    """``job.framework_hooks`` of the job's resolved config (on unless the job says no)."""
    if not config_path:
        return True
    import json

    try:
        with open(config_path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return True  # the trainer's own config check reports a broken file
    job = data.get("job") if isinstance(data, dict) else None
    return not (isinstance(job, dict) and job.get("framework_hooks") is False)


def _register_torch_hooks(worker: Any, collective_timeout_s: float | None) -> None:
    from wrapt import register_post_import_hook

    def resumed_at(step: int) -> None:
        # Compared across ranks by the supervisor: ranks that resume from different
        # checkpoints (a per-node working directory) go apart and fail later.
        worker.event(RESUME_EVENT, step=step)

    counter = StepCounter(worker.optimizer_stepped, resumed_at)

    def on_optimizer(module: Any) -> None:
        module.register_optimizer_step_post_hook(counter)

    register_post_import_hook(on_optimizer, _OPTIMIZER_MODULE)
    if collective_timeout_s is not None:
        def on_c10d(module: Any) -> None:
            set_default_collective_timeout(module, collective_timeout_s)

        register_post_import_hook(on_c10d, _C10D_MODULE)

