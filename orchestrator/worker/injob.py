"""In-job recovery, the rank's side that needs no torch: the agent's ``recover`` order and
the wait for it.

When a peer rank dies or hangs, the surviving ranks are not restarted. The supervisor starts
a new generation with the same members; each survivor's agent writes it a ``recover`` line
on the local socket (the new generation's number and the rank's whole environment for it:
rendezvous address and port, generation variables). The SDK's order thread parses it
(:meth:`RecoverOrder.parse`) and hands it to :class:`InJob`, which at once runs the abort
callbacks the training code registered (aborting its process groups unblocks a training
thread stuck in a collective with the dead peer, without a collective of its own). The
training thread, having met the failed collective, waits for the order
(:meth:`InJob.wait`), rebuilds its process groups from the order's environment, restores
the newest state every rank holds, and trains on in the same interpreter: its imports,
device context and compiled graphs stay (``trainer.rejoin`` does this for our trainer).

A rank registers for this path with :meth:`InJob.enable`; its beats then say
``recoverable``, and the supervisor takes the in-job path only when every live rank of the
generation does. A rank that never registers gets the full restart.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Bounds on an order's environment: far above a real rank's (a few hundred variables, tens
# of kB), low enough that a broken line cannot swell a rank's memory.
_MAX_VARS = 4096
_MAX_VALUE = 1 << 16
_MAX_TOTAL = 1 << 21
_MAX_GENERATION = 1 << 31
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")


class BadRecoverOrder(ValueError):
    """A ``recover`` line from the agent that is not a valid order."""


@dataclass(frozen=True)
class RecoverOrder:
    """Join generation ``generation`` in place, with ``env`` as this rank's environment."""

    generation: int
    env: dict[str, str]

    @classmethod
    def parse(cls, obj: Any) -> RecoverOrder:
        """The order in ``obj`` (a decoded JSON line), or :class:`BadRecoverOrder`."""
        if not isinstance(obj, dict) or obj.get("t") != "recover":
            raise BadRecoverOrder("not a recover order")
        gen = obj.get("generation")
        if not isinstance(gen, int) or isinstance(gen, bool) or not 1 <= gen <= _MAX_GENERATION:
            raise BadRecoverOrder(f"recover order: generation must be an integer in "
                                  f"[1, {_MAX_GENERATION}], not {str(gen)[:40]!r}")
        env = obj.get("env")
        if not isinstance(env, dict) or len(env) > _MAX_VARS:
            raise BadRecoverOrder(f"recover order: env must be an object of at most "
                                  f"{_MAX_VARS} variables")
        total = 0
        for key, value in env.items():
            if not isinstance(key, str) or not _NAME.match(key):
                raise BadRecoverOrder(f"recover order: {str(key)[:40]!r} is not a variable "
                                      "name")
            if not isinstance(value, str) or len(value) > _MAX_VALUE or "\x00" in value:
                raise BadRecoverOrder(f"recover order: {key} is not a string of at most "
                                      f"{_MAX_VALUE} characters without NUL")
            total += len(key) + len(value)
        if total > _MAX_TOTAL:
            raise BadRecoverOrder(f"recover order: env holds {total} characters, more than "
                                  f"{_MAX_TOTAL}")
        for needed in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if needed not in env:
                raise BadRecoverOrder(f"recover order: env has no {needed}")
        return cls(generation=gen, env=dict(env))

    def line(self) -> dict[str, Any]:
        """The order as the agent writes it (the inverse of :meth:`parse`)."""
        return {"t": "recover", "generation": self.generation, "env": self.env}


class InJob:
    """One rank's in-job recovery: the registered abort callbacks, the pending order.

    Thread-safe: the order thread delivers, the training thread waits and takes.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._order: RecoverOrder | None = None
        self._aborts: list[Callable[[], None]] = []
        self.enabled = False
        self.errors: list[str] = []  # abort callbacks that raised (said in the recovery)
        # When the newest order arrived (time.perf_counter; None until one came): where a
        # survivor's first second of a recovery goes.
        self.delivered_at: float | None = None

    def enable(self, abort: Callable[[], None]) -> None:
        """Take the in-job path: ``abort`` is called from the order thread when an order
        comes (it must not run a collective; aborting the process groups is what it is
        for). From now on the rank's beats say ``recoverable``."""
        with self._cond:
            self._aborts.append(abort)
            self.enabled = True

    def disable(self) -> None:
        """Leave the in-job path (a failure the rank cannot recover from in place)."""
        with self._cond:
            self._aborts.clear()
            self.enabled = False

    def deliver(self, order: RecoverOrder, current_generation: int) -> bool:
        """An order from the agent: kept (the newest wins) and the aborts run; False for an
        order of a generation this rank is already in or past."""
        with self._cond:
            if order.generation <= current_generation or (
                    self._order is not None and order.generation <= self._order.generation):
                return False
            self._order = order
            self.delivered_at = time.perf_counter()
            aborts = list(self._aborts)
            self._cond.notify_all()
        for abort in aborts:
            try:
                abort()
            except Exception as exc:  # noqa: BLE001 - reported with the recovery
                self.errors.append(f"{type(exc).__name__}: {exc}"[:500])
        return True

    def pending(self) -> RecoverOrder | None:
        with self._cond:
            return self._order

    def wait(self, timeout: float) -> RecoverOrder | None:
        """The pending order, waiting up to ``timeout`` seconds for one; None if none came."""
        with self._cond:
            self._cond.wait_for(lambda: self._order is not None, timeout=timeout)
            return self._order

    def take(self) -> RecoverOrder | None:
        """The pending order, now consumed (the rank is acting on it)."""
        with self._cond:
            order, self._order = self._order, None
            return order
