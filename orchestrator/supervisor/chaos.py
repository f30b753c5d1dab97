"""Fault injection: which rank gets which signal at which step, each exactly once per job.

Step kills are carried out by the rank itself (the worker SDK signals its own process right
after the step, so the kill lands on that exact step, not a heartbeat later); the
supervisor decides which are still due and hands only those to each generation, and the
rank's ``chaos`` event (sent before the signal) marks one fired in the journal, so a
restart that trains the same step again does not fire it twice, even across a supervisor
restart. Interval kills are sent by the supervisor through the agent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from orchestrator.config.schema import ChaosConfig


@dataclass(frozen=True)
class Injection:
    id: str
    rank: int
    signal: str
    step: int | None  # the step that triggered it (None for interval kills)


class ChaosDriver:
    def __init__(self, cfg: ChaosConfig, world_size: int, fired: set[str]) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.fired = set(fired)
        self._rng = random.Random(cfg.seed)
        # Resolve "random" ranks up front from the seed, so a restarted supervisor picks the
        # same ranks as the one before it.
        self._targets = [spec.rank if spec.rank != "random" else self._rng.randrange(world_size)
                         for spec in cfg.kill]
        self._interval_count = sum(1 for f in fired if f.startswith("interval-"))
        self._interval_started: float | None = None

    def pending(self) -> list[dict[str, object]]:
        """Step kills not yet fired, with their ranks resolved, for the next generation."""
        return [{"id": f"kill-{i}", "rank": self._targets[i], "step": spec.step,
                 "signal": spec.signal}
                for i, spec in enumerate(self.cfg.kill) if f"kill-{i}" not in self.fired]

    def mark_fired(self, key: str) -> None:
        self.fired.add(key)

    def due_interval(self, running_since: float | None, now: float) -> list[Injection]:
        """A random-rank kill every ``kill_interval_s`` seconds of RUNNING."""
        interval = self.cfg.kill_interval_s
        if interval is None or running_since is None:
            self._interval_started = None
            return []
        if self._interval_started is None:
            self._interval_started = running_since
        if now - self._interval_started < interval:
            return []
        self._interval_started = now
        self._interval_count += 1
        key = f"interval-{self._interval_count}"
        self.fired.add(key)
        return [Injection(key, self._rng.randrange(self.world_size), "SIGKILL", None)]
