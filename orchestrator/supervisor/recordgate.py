"""Which of rank 0's step records the supervisor takes: each step once, at a bounded rate.

Admission (``supervisor.gateway.admission``) decides who may send records at all: the node holding
rank 0, for the current generation. What such a node sends is then taken here, in order:

- steps only move forward within a generation: a record whose step is not past the last one
  taken is a resent beat's (the agent keeps records whose beat it could not confirm) and is
  dropped, changing nothing;
- at most ``per_s`` records a second, with a burst of ``BURST_S`` seconds' worth (a token
  bucket on the service clock): one beat of 100,000 records appended 23 MiB to
  ``steps.jsonl`` in 6.5 s. Records past it are dropped and counted; intake journals them
  as ``message_rejected``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.contracts.steprecord import StepRecord

# Seconds' worth of records a burst may hold (an agent catching up after the supervisor was
# away sends at most 1,000 a beat).
BURST_S = 5.0


@dataclass(frozen=True)
class Taken:
    records: list[StepRecord]
    repeated: int  # steps already taken (a resent beat): dropped, not a problem
    over_rate: int  # dropped: past the rate


class RecordGate:
    def __init__(self, per_s: float, monotonic: Callable[[], float]) -> None:
        self.per_s = per_s
        self.burst = max(1.0, per_s * BURST_S)
        self._monotonic = monotonic
        self._tokens = self.burst
        self._at: float | None = None
        self._generation: int | None = None
        self.last_step: int | None = None

    def take(self, generation: int, records: list[StepRecord]) -> Taken:
        if generation != self._generation:
            self._generation, self.last_step = generation, None
        fresh: list[StepRecord] = []
        last = self.last_step
        for rec in records:
            if last is None or rec["step"] > last:
                fresh.append(rec)
                last = rec["step"]
        now = self._monotonic()
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        allowed = min(len(fresh), int(self._tokens))
        self._tokens -= allowed
        kept = fresh[:allowed]
        if kept:
            self.last_step = kept[-1]["step"]
        return Taken(kept, len(records) - len(fresh), len(fresh) - allowed)
