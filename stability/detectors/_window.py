"""Running windows and runs of spiking values: the statistics every spike rule shares.

The mean and std are recomputed from the window on each call rather than kept as running sums:
the window is small (tens of values), the result then depends only on the values in the window
(so a restored state gives bit-identical thresholds), and no floating-point drift builds up.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ThresholdFn = Callable[[float, float], float]
"""(mean, std) of the window -> threshold; a value strictly above it is a spike."""


def usable(value: float | None) -> bool:
    """A value the statistics may consume: present and finite.

    Non-finite values are the nonfinite rule's business; letting them in would poison the window.
    """
    return value is not None and math.isfinite(value)


class RunningWindow:
    """The last ``size`` values of a series, with their mean and population std."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._values: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def full(self) -> bool:
        return len(self._values) == self.size

    def push(self, value: float) -> None:
        self._values.append(value)

    def mean(self) -> float:
        n = len(self._values)
        # Divide before summing so a window of values near the float maximum cannot overflow.
        return sum(v / n for v in self._values)

    def std(self) -> float:
        n = len(self._values)
        m = self.mean()
        # d * d, not d ** 2: float ** raises OverflowError where * gives inf.
        return math.sqrt(sum((v - m) * (v - m) / n for v in self._values))

    def state_dict(self) -> list[float]:
        return list(self._values)

    def load_state_dict(self, values: list[float]) -> None:
        # A smaller configured window after a restart keeps the newest values.
        self._values = deque((float(v) for v in values), maxlen=self.size)


@dataclass(frozen=True)
class Observation:
    """What one value did to a ``SpikeTracker``."""

    value: float
    mean: float | None  # of the window before this value; None until the window is full
    std: float | None
    threshold: float | None
    spiking: bool
    started: bool  # this value opened a spike
    ended_length: int  # length of the spike this value closed, 0 if none closed
    length: int  # length of the current spike after this value, 0 when not spiking
    onset_step: int | None  # first step of the current (or just closed) spike


class SpikeTracker:
    """Runs of consecutive values strictly above a threshold drawn from a running window.

    No spike is called until the window is full: with fewer values the running mean is not
    the rule's mean. With ``include_spikes=False`` a spiking value stays out of the window, so the
    threshold holds still for the whole spike and the run ends when the series returns below the
    level it left. ``observe(..., classify=False)`` (warm-up) feeds the window without calling
    spikes; every value then enters the window.
    """

    def __init__(self, window: int, threshold: ThresholdFn, include_spikes: bool) -> None:
        self.window = RunningWindow(window)
        self._threshold = threshold
        self._include_spikes = include_spikes
        self.length = 0
        self.onset_step: int | None = None

    def observe(self, step: int, value: float, classify: bool = True) -> Observation:
        mean = std = threshold = None
        if self.window.full:
            mean, std = self.window.mean(), self.window.std()
            threshold = self._threshold(mean, std)
        spiking = classify and threshold is not None and value > threshold
        started, ended, onset = False, 0, self.onset_step
        if spiking:
            if self.length == 0:
                self.onset_step = onset = step
                started = True
            self.length += 1
        elif self.length:
            # Outside classification (a restored state stepping back into warm-up) the run is
            # dropped silently: warm-up reports nothing.
            ended = self.length if classify else 0
            self.length, self.onset_step = 0, None
        if not spiking or self._include_spikes:
            self.window.push(value)
        return Observation(
            value, mean, std, threshold, spiking, started, ended, self.length, onset
        )

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window.state_dict(), "length": self.length, "onset": self.onset_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.load_state_dict(state["window"])
        self.length = int(state["length"])
        self.onset_step = None if state["onset"] is None else int(state["onset"])
