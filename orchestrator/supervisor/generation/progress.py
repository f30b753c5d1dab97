"""Training progress as the supervisor sees it: per-rank beats and rank 0's step records.

Rank 0's step records are appended to ``steps.jsonl`` in the run directory (the stability
replay and the goodput ground truth read them); a ``progress`` journal event is written at
most every ``journal_every_s`` seconds and at each generation's first step, so the journal
stays small while ``status`` and the books still see where training stood.

Each generation keeps its ranks' last progress oldest-first per phase
(``GenerationProgress.idle``), so the hang check looks at one rank per phase instead of all
of them, and each rank's latest step pace in a heap, so the job's (``pace``) is read without
a scan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.clock import Clock
from orchestrator.contracts.events import Envelope, Event, FirstStep, Progress
from orchestrator.contracts.pace import WARMUP_STEPS
from orchestrator.contracts.phases import BUSY_PHASES
from orchestrator.contracts.protocol import RankInfo
from orchestrator.contracts.steprecord import StepRecord, encode_stored
from orchestrator.supervisor.deadlines import OldestFirst


@dataclass
class RankProgress:
    rank: int
    step: int | None = None
    first_step: int | None = None  # the first step it reported in this generation
    phase: str | None = None
    last_step_ts: float | None = None  # worker wall clock
    beat_received: float | None = None  # our monotonic clock, when a new beat arrived
    beat_ts: float | None = None  # the worker's timestamp of its newest beat
    progress_seen: float | None = None  # monotonic time the step or phase last changed
    step_interval_max: float | None = None
    progress: str | None = None  # "hook": steps are the preload hook's optimizer count
    finished: bool = False  # sent its last beat; tearing down
    recoverable: bool = False  # can rejoin the next generation in place (in-job recovery)

    @property
    def warming(self) -> bool:
        """Within its generation's first ``WARMUP_STEPS`` step intervals: the ones its SDK
        does not measure (``orchestrator.contracts.pace``), judged by the start-up floor."""
        return self.step is not None and self.first_step is not None \
            and self.step - self.first_step < WARMUP_STEPS


@dataclass
class GenerationProgress:
    generation: int
    first_step: int | None = None
    first_step_ts: float | None = None
    last_step: int | None = None
    last_step_ts: float | None = None
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    # phase -> ranks in that phase by the time they last made progress
    idle: dict[str | None, OldestFirst[int]] = field(default_factory=dict)
    # Each rank's latest report of its step pace (``orchestrator.contracts.pace``), kept so the
    # smallest is read without a scan.
    intervals: OldestFirst[int] = field(default_factory=OldestFirst)
    # Ranks of a script without the SDK before its first step: judged by liveness, not by
    # a phase's timeout, so the oldest-first pre-check cannot speak for them.
    unstepped_hooks: set[int] = field(default_factory=set)
    # When a rank last left a busy phase: its peers waiting for it are not hung until a
    # training timeout after that (``hangs.find_hangs``).
    busy_ended: float | None = None

    @property
    def pace(self) -> float | None:
        """The job's step pace: the smallest the ranks report now. The ranks of a
        distributed job step in lockstep, so their intervals agree, except where a rank's
        own work was left out of its steps (its save, its evaluation: phases of their own)
        while its peers, blocked in their next collective, measured the wait. The peers'
        wait is covered by the busy-peer rule (``hangs.find_hangs``); the smallest pace is
        the steps' own."""
        low = self.intervals.oldest()
        return low[1] if low is not None else None

    def report_interval(self, rank: int, interval: float | None) -> None:
        if interval is None or interval <= 0:
            self.intervals.discard(rank)
        else:
            self.intervals.set(rank, interval)

    def progressed(self, rp: RankProgress, phase: str | None, at: float) -> None:
        """``rp`` made progress at ``at`` (now in ``phase``): move it in ``idle``."""
        if rp.phase != phase and rp.phase in BUSY_PHASES:
            self.busy_ended = at
        if rp.phase != phase and rp.phase in self.idle:
            self.idle[rp.phase].discard(rp.rank)
        rp.phase, rp.progress_seen = phase, at
        ranks = self.idle.get(phase)
        if ranks is None:  # not ``setdefault``: that built a throwaway heap on every beat
            ranks = self.idle[phase] = OldestFirst()
        ranks.set(rp.rank, at)


class ProgressTracker:
    """Folds heartbeats into per-rank progress and records rank 0's step stream."""

    def __init__(self, steps_path: Path, clock: Clock,
                 record_event: Callable[[Event], Envelope],
                 journal_every_s: float = 5.0) -> None:
        self._steps_path = steps_path
        self._clock = clock
        self._record_event = record_event
        self._journal_every_s = journal_every_s
        self._last_journaled = float("-inf")
        self.current: GenerationProgress | None = None
        self.last_record: StepRecord | None = None
        self.tokens = 0
        # The newest step every rank holds in the memory tier, as rank 0's records say.
        self.memory_step: int | None = None

    def start_generation(self, generation: int, world_size: int,
                         first_step_known: bool = False) -> None:
        """Every rank starts "in progress" at launch, so one that never beats still times out
        (in the ``init`` phase). ``first_step_known``: re-attaching to a generation whose
        first step is already journaled (after a supervisor restart)."""
        now = self._clock.monotonic()
        self.current = GenerationProgress(generation)
        if first_step_known:
            self.current.first_step = -1
        for rank in range(world_size):
            rp = self.current.ranks[rank] = RankProgress(rank)
            self.current.progressed(rp, None, now)

    def on_ranks(self, generation: int | None, infos: list[RankInfo]) -> None:
        gen = self.current
        if gen is None or generation != gen.generation:
            return
        now = self._clock.monotonic()
        for info in infos:
            rp = gen.ranks.get(info.rank)
            if rp is None:
                rp = gen.ranks[info.rank] = RankProgress(info.rank)
                gen.progressed(rp, info.phase, now)
            if info.beat_ts is not None and info.beat_ts != rp.beat_ts:
                rp.beat_received, rp.beat_ts = now, info.beat_ts
            if info.step != rp.step or info.phase != rp.phase:
                gen.progressed(rp, info.phase, now)
            rp.step = info.step
            if rp.first_step is None or (info.step is not None and info.step < rp.first_step):
                rp.first_step = info.step
            rp.last_step_ts = info.last_step_ts
            if info.step_interval_max != rp.step_interval_max:
                rp.step_interval_max = info.step_interval_max
                gen.report_interval(info.rank, info.step_interval_max)
            rp.progress = info.progress
            rp.finished = info.finished
            rp.recoverable = info.recoverable
            if info.progress == "hook" and info.step is None:
                gen.unstepped_hooks.add(info.rank)
            else:
                gen.unstepped_hooks.discard(info.rank)

    def on_records(self, generation: int | None, records: list[StepRecord]) -> bool:
        """Rank 0's step records (typed, admitted, each step once): append to steps.jsonl,
        note first/last step, journal. Returns whether they were taken (False for a
        generation other than the current one)."""
        gen = self.current
        if not records or gen is None or generation != gen.generation:
            return False
        with open(self._steps_path, "a") as f:
            f.write("".join(encode_stored(rec, generation) for rec in records))
        last = records[-1]
        self.last_record = last
        for rec in records:
            mem = rec.get("memory_step")
            if isinstance(mem, int) and not isinstance(mem, bool) and 0 <= mem <= 2**53:
                self.memory_step = mem if self.memory_step is None else max(self.memory_step,
                                                                              mem)
        tokens = last.get("tokens")
        if tokens is not None:
            self.tokens = tokens
        if gen.first_step is None:
            first = records[0]
            gen.first_step, gen.first_step_ts = first["step"], first.get("ts")
            self._record_event(FirstStep(generation=generation, step=first["step"],
                                         step_ts=first.get("ts")))
        gen.last_step, gen.last_step_ts = last["step"], last.get("ts")
        now = self._clock.monotonic()
        if now - self._last_journaled >= self._journal_every_s:
            self.journal_progress()
        return True

    def journal_progress(self) -> None:
        gen = self.current
        if gen is None or gen.last_step is None:
            return
        self._last_journaled = self._clock.monotonic()
        self._record_event(Progress(generation=gen.generation, step=gen.last_step,
                                    tokens=max(0, self.tokens)))

    def rank_steps(self) -> dict[int, int | None]:
        gen = self.current
        return {} if gen is None else {r: p.step for r, p in gen.ranks.items()}

