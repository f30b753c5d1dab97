"""Fault injection driven by the supervisor: signal a rank once it reaches a step.

Injections are decided here, not in the worker, so each fires exactly once per job even
though the step it names is trained again after the restart it causes; the journal's
``chaos`` events make that survive a supervisor restart too. The kill lands within one
heartbeat of the step, which is all a fault-tolerance test needs.
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

    def due(self, rank_steps: dict[int, int | None]) -> list[Injection]:
        """Injections whose step has been reached by their target rank."""
        out = []
        for i, spec in enumerate(self.cfg.kill):
            key = f"kill-{i}"
            if key in self.fired:
                continue
            step = rank_steps.get(self._targets[i])
            if step is not None and step >= spec.step:
                self.fired.add(key)
                out.append(Injection(key, self._targets[i], spec.signal, step))
        return out

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
