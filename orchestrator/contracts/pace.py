"""A rank's step pace: the one number that calibrates its hang timeout.

The supervisor's training timeout is ``max(floor, training_multiplier x pace)``
(``supervisor.generation.hangs``). The pace must cover every step interval a healthy rank will take
again, and nothing that will not recur; the worker SDK measures it (every rank, with the SDK,
a framework hook or only the preload hook's optimizer-step count) and the supervisor reads
it from the beats (``interval_max``). Two rules keep a slow step that does not recur from
raising the timeout for the rest of a job (one 1.06 s step of a 0.24 s-step job held a
SIGSTOPped rank's detection at 3.4 s against a 2.7 s bound, 2 x H100):

- **Warm-up.** The first :data:`WARMUP_STEPS` step intervals of each process (a generation)
  are not measured: a (re)start's compile and recompiles, the optimizer's lazily created
  state, the allocator's growth, page-locking and the data loader's first batches say
  nothing of the pace. The supervisor judges a rank in them by the start-up floor
  (``training_floor_s``), never by the tight calibrated value a restart carries.
- **Seen twice.** The pace is the second-largest interval of the rank's last
  :data:`PACE_WINDOW` measured intervals: a one-off (a compile, a collection, a page fault
  storm) is never the pace, and a slow step that recurs within the window (synchronous
  logging every N steps, a noisy host's stalls) is, so its next occurrence is no false
  alarm. Read as a quantile, it is about the 99.5th percentile of the last 200 intervals.

This module imports only the standard library: the worker SDK imports it in every rank, the
supervisor reads :data:`WARMUP_STEPS` from it.
"""

from __future__ import annotations

import collections
import heapq
import math

# Step intervals of each process that do not calibrate (see the module docstring). Three:
# a compiled model's first two steps (compile, then the recompile with grads) and the first
# step with the optimizer's state, all seen slow on GPUs; more would keep a restarted rank
# on the start-up floor for longer.
WARMUP_STEPS = 3
# Intervals the pace is read from: long enough that a slow step recurring every few hundred
# steps' worth of seconds is remembered between its occurrences, short enough to scan at
# every beat (200 floats, microseconds).
PACE_WINDOW = 200


class StepPace:
    """The step intervals of one rank, as its hang timeout's calibration sees them."""

    def __init__(self, window: int = PACE_WINDOW, warmup: int = WARMUP_STEPS) -> None:
        if window < 2 or warmup < 0:
            raise ValueError("window >= 2 and warmup >= 0")
        self._window: collections.deque[float] = collections.deque(maxlen=window)
        self._warmup = warmup
        self.offered = 0  # intervals seen, measured or not

    def add(self, interval: float, measured: bool = True) -> None:
        """One more step interval; ``measured=False`` for one that does not calibrate (slowed
        by declared work beside training), which still counts toward the warm-up."""
        self.offered += 1
        if measured and self.offered > self._warmup and math.isfinite(interval) \
                and interval >= 0:
            self._window.append(interval)

    @property
    def warming(self) -> bool:
        """Still in the warm-up: the next interval will not be measured."""
        return self.offered < self._warmup

    def intervals(self) -> list[float]:
        """The measured intervals of the window, oldest first."""
        return list(self._window)

    def value(self) -> float | None:
        """The pace: the second-largest measured interval of the window; None before two are
        measured (the supervisor remembers what a rank reported for its horizon: a first
        measured interval that is a one-off must not be reported even once)."""
        if len(self._window) < 2:
            return None
        return heapq.nlargest(2, self._window)[1]
