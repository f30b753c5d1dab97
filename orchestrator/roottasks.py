"""A process's root tasks, supervised the way kopf runs an operator's (``aiotasks.py``).

Each root task has a name. The first to fail (raise) stops the others, and its error is
raised to the caller as :class:`RootTaskFailed`: the agent exits non-zero with it instead of
heartbeating on with a dead assignment loop, and the supervisor stops instead of driving a
job whose books or loop-lag watch died silently. A task that returns normally (the agent's
orphan watch after asking it to exit) stops nothing by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class RootTaskFailed(RuntimeError):
    """Root task ``name`` raised ``error``."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(f"root task {name!r} failed: {type(error).__name__}: {error}")
        self.name = name
        self.error = error


class RootTasks:
    """Named root tasks: started together, stopped together."""

    def __init__(self, coros: dict[str, Coroutine[Any, Any, Any]], owner: str = "agent",
                 ) -> None:
        self.owner = owner
        self.tasks = {name: asyncio.create_task(coro, name=f"{owner}:{name}")
                      for name, coro in coros.items()}

    async def wait(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set (return) or a root task fails (raise RootTaskFailed, after
        cancelling the others)."""
        stopper = asyncio.create_task(stop.wait(), name=f"{self.owner}:stop")
        try:
            pending = set(self.tasks.values())
            while not stop.is_set():
                done, pending = await asyncio.wait({*pending, stopper},
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is stopper or task.cancelled():
                        continue
                    error = task.exception()
                    if error is not None:
                        await self.cancel()
                        raise RootTaskFailed(self._name(task), error) from error
                pending.discard(stopper)
                if not pending:
                    return
        finally:
            stopper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopper

    def _name(self, task: asyncio.Task) -> str:
        return next(n for n, t in self.tasks.items() if t is task)

    async def cancel(self, grace: float = 5.0) -> None:
        """Cancel every root task and wait up to ``grace`` for them to end."""
        live = [t for t in self.tasks.values() if not t.done()]
        for task in live:
            task.cancel()
        if live:
            await asyncio.wait(live, timeout=grace)
