"""Hang detection: a timeout per phase, the training one calibrated from observed steps.

A rank is hung when it has made no progress (no new step, no phase change) for longer than
its current phase allows. Heartbeats alone do not count as progress: the worker SDK's beat
thread keeps beating while a training thread is stuck in a collective, and that is exactly
the case to catch.

The training timeout calibrates itself::

    timeout = max(floor, training_multiplier * pace)

where the pace is what each rank's SDK measures (``contracts.pace``: the second-largest of
its last 200 step intervals past its generation's warm-up, so one slow step that does not
recur never calibrates it), the smallest of the ranks' (they step in lockstep: a rank's wait
for a peer's save is no step time), the largest reported over the job's last
``calibration_horizon_steps`` step intervals, the value carried over from earlier
generations through the journal's ``calibration`` events counting as measured when this
supervisor started. The floor starts at ``training_floor_s`` (high: the first steps of a job
say little of its pace) and comes down to ``training_floor_calibrated_s`` once
``calibration_steps`` step intervals have been measured (this generation's and earlier
ones'): a 0.2 s step then has its hang found within 3 x the step interval + 2 s, not after
the fixed floor's 30.

A rank within its generation's warm-up (its first ``WARMUP_STEPS`` step intervals, which its
SDK does not measure) is judged by at least the start-up floor: a restart's compile and
page-locking are no hang, whatever the tight value carried from before. Steps a rank's SDK was
told are disturbed by work beside them (buffers page-locked in the background) are not
measured either, and run in the ``loading`` phase. Until any interval is known (the first
steps of a job), the ``init`` phase's timeout applies. A checkpoint's blocking part runs in
the ``checkpointing`` phase with its own timeout, and a slow first step runs in ``init`` (the
SDK switches a rank to ``training`` at its first ``step_done``), so neither trips the training
timeout. The fixed ``timeouts.phases.training`` overrides calibration when set.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from orchestrator.config.schema import TimeoutsConfig
from orchestrator.contracts.phases import BUSY_PHASES
from orchestrator.supervisor.generation.progress import GenerationProgress, RankProgress

# A new calibration is journaled only when the timeout moves by more than this fraction,
# so a job's journal gets a handful of these, not one per heartbeat.
_JOURNAL_CHANGE = 0.2
# Largest-interval changes remembered within the horizon (a change comes at most once per
# beat of the rank holding the largest; the oldest beyond this are dropped).
_MAX_HISTORY = 4096


@dataclass(frozen=True)
class Suspect:
    rank: int
    phase: str
    step: int | None
    idle_s: float
    beat_age_s: float | None  # None: never beat in this generation
    timeout_s: float
    silent: bool  # no heartbeat for several intervals: the process is stopped or frozen

    def describe(self) -> str:
        where = f"rank {self.rank} made no progress for {self.idle_s:.1f} s in phase " \
                f"{self.phase} (timeout {self.timeout_s:.1f} s, last step {self.step})"
        if self.beat_age_s is None:
            return where + "; it never sent a heartbeat"
        if self.silent:
            return where + f"; no heartbeat for {self.beat_age_s:.1f} s (process stopped " \
                           "or frozen)"
        return where + "; its heartbeats continue (training thread blocked)"


class TrainingTimeout:
    """The calibrated training timeout, carried across generations.

    Its interval is the largest pace the ranks reported over the last
    ``calibration_horizon_steps`` step intervals of the job, not the largest ever: a slower
    pace (a restart on a slower node) raises the timeout for that long, then drops out. The
    value carried from earlier generations (the journal's last ``calibration``) counts as
    measured at the start of this supervisor's run.
    """

    def __init__(self, cfg: TimeoutsConfig, carried_max_interval: float | None,
                 carried_intervals: int = 0) -> None:
        self.cfg = cfg
        self._carried = max(0, carried_intervals)
        self._by_generation: dict[int, int] = {}
        # (intervals measured when it was reported, the ranks' largest interval then),
        # oldest first; entries past the horizon are dropped as new ones come.
        self._history: collections.deque[tuple[int, float]] = collections.deque()
        if carried_max_interval:
            self._history.append((self._carried, carried_max_interval))
        self._journaled: float | None = self.value() if carried_max_interval else None
        self._journaled_intervals = self._carried

    @property
    def max_interval(self) -> float | None:
        """The largest step interval reported within the horizon (None: none yet)."""
        # An entry holds until the next one: it is past the horizon once the next one is.
        horizon = self.intervals - self.cfg.calibration_horizon_steps
        while len(self._history) > 1 and self._history[1][0] <= horizon:
            self._history.popleft()
        return max((v for _, v in self._history), default=None)

    def observe(self, gen: GenerationProgress) -> None:
        """What ``gen``'s ranks report now: its intervals measured and its pace."""
        first, last = gen.first_step, gen.last_step
        if first is not None and last is not None and 0 <= first <= last:
            count = last - first
            if count > self._by_generation.get(gen.generation, 0):
                self._by_generation[gen.generation] = count
        interval = gen.pace
        if interval is not None and interval > 0 and \
                (not self._history or self._history[-1][1] != interval):
            self._history.append((self.intervals, interval))
            # Bounded however many changes come between two horizons' worth of steps.
            while len(self._history) > _MAX_HISTORY:
                self._history.popleft()

    @property
    def intervals(self) -> int:
        """Step intervals measured over the job (this supervisor's and the journal's)."""
        return self._carried + sum(self._by_generation.values())

    def floor(self) -> float:
        low = self.cfg.training_floor_calibrated_s
        if low is not None and self.intervals >= self.cfg.calibration_steps:
            return low
        return self.cfg.training_floor_s

    def value(self) -> float:
        if self.cfg.phases.training is not None:
            return self.cfg.phases.training
        interval = self.max_interval
        if interval is None:
            return self.cfg.phases.init
        return max(self.floor(), self.cfg.training_multiplier * interval)

    def needs_journal(self) -> bool:
        """True once the value moved enough since it was last journaled, or while the floor
        is still up, once more intervals were measured: a restart carries the count from
        the journal, and a generation killed before the floor came down must not make the
        next one measure its intervals again."""
        if self.max_interval is None:
            return False
        now = self.value()
        counting = self._journaled_intervals < self.cfg.calibration_steps \
            and self.intervals > self._journaled_intervals
        if self._journaled is None or counting or abs(now - self._journaled) > \
                _JOURNAL_CHANGE * self._journaled:
            self._journaled, self._journaled_intervals = now, self.intervals
            return True
        return False


def silent_after_s(heartbeat_interval_s: float) -> float:
    """How long a rank may go without a beat before it counts as silent: three missed
    beats, and never under a second (a beat may wait behind a busy loop that long)."""
    return max(3 * heartbeat_interval_s, 1.0)


def phase_timeout(cfg: TimeoutsConfig, phase: str | None, training: TrainingTimeout,
                  warming: bool = False) -> float:
    """The timeout of ``phase``; ``warming``: a rank within its generation's first step
    intervals (``contracts.pace.WARMUP_STEPS``), which its SDK does not measure, gets at
    least the start-up floor, not the tight value an earlier generation calibrated."""
    if phase == "training":
        if warming and cfg.phases.training is None:
            return max(cfg.training_floor_s, training.value())
        return training.value()
    return float(getattr(cfg.phases, phase or "init", None) or cfg.phases.init)


def any_overdue(gen: GenerationProgress, cfg: TimeoutsConfig, training: TrainingTimeout,
                now: float) -> bool:
    """Whether any rank may be past its phase's timeout, from the rank idle longest in each
    phase (O(phases), not O(ranks)): ``find_hangs`` then names and orders the suspects (and
    applies the longer limit of a finishing rank). Ranks judged by liveness alone (a script
    without the SDK before its first step) send the check to ``find_hangs`` every time."""
    training.observe(gen)
    if gen.unstepped_hooks:
        return True
    for phase, idle in gen.idle.items():
        oldest = idle.oldest()
        if oldest is not None and now - oldest[1] > phase_timeout(cfg, phase, training):
            return True
    return False


def find_hangs(gen: GenerationProgress, cfg: TimeoutsConfig, training: TrainingTimeout,
               now: float) -> list[Suspect]:
    """Ranks past their phase's timeout, the first to stop progressing first.

    Order: ranks that stopped beating (a stopped or frozen process is the likeliest culprit
    of a collective hang), then the lowest step (the others wait for it), then the one idle
    longest. Once one rank is past its timeout, a rank that stopped beating at the same step
    or below is named with it, past its own timeout or not (``_silent_peers``).
    """
    hung = []
    training.observe(gen)
    for rp in gen.ranks.values():
        suspect = _check(rp, cfg, training, now)
        if suspect is not None:
            hung.append(suspect)
    if hung and not all(s.silent for s in hung):
        # A rank still beating that waits past the training timeout while a peer is in a
        # longer phase (rank 0 of a script saving or evaluating alone, the others blocked in
        # their next collective) waits for that peer: it is not hung, until a training
        # timeout after the peer left that phase (its step reaches us a beat later). The
        # busy peer is judged by its own phase's timeout; a rank that stopped beating is
        # named as ever.
        busy = _busy_peer(gen, cfg, training, now)
        ended = gen.busy_ended
        hung = [s for s in hung if s.silent or s.phase != "training" or not (
            busy or (ended is not None and now - ended <= s.timeout_s))]
    if hung:
        hung.extend(_silent_peers(hung, gen, cfg, training, now))
    hung.sort(key=lambda s: (not s.silent, s.step if s.step is not None else -1, -s.idle_s))
    return hung


def _busy_peer(gen: GenerationProgress, cfg: TimeoutsConfig, training: TrainingTimeout,
               now: float) -> bool:
    """Whether a rank that still beats is in a busy phase within its timeout."""
    quiet = silent_after_s(cfg.heartbeat_interval_s)
    for phase in BUSY_PHASES:
        ranks = gen.idle.get(phase)
        if ranks is None:
            continue
        for rank, since in ranks.items():
            rp = gen.ranks.get(rank)
            if rp is not None and rp.beat_received is not None \
                    and now - rp.beat_received <= quiet \
                    and now - since <= phase_timeout(cfg, phase, training):
                return True
    return False


def _silent_peers(hung: list[Suspect], gen: GenerationProgress, cfg: TimeoutsConfig,
                  training: TrainingTimeout, now: float) -> list[Suspect]:
    """Ranks not yet past their own timeout that stopped beating, at or below the lowest
    step of ``hung``. A SIGSTOPped rank and its peer blocked in their next collective stop
    at the same step, but the supervisor sees each rank's step when that rank's agent next
    beats (0.5 s apart at most): when the peer's was seen first, the peer crossed the
    timeout alone and was named as the hang, and the node replaced was the healthy one
    (seen on a loaded CI host). A rank that stopped beating is the likelier culprit."""
    named = {s.rank for s in hung}
    steps = [s.step for s in hung if s.step is not None]
    floor = min(steps) if steps else None
    quiet = silent_after_s(cfg.heartbeat_interval_s)
    peers = []
    for rp in gen.ranks.values():
        if rp.rank in named or rp.finished or rp.progress_seen is None \
                or rp.beat_received is None or now - rp.beat_received <= quiet:
            continue
        if floor is not None and (rp.step is None or rp.step > floor):
            continue
        peers.append(Suspect(rp.rank, rp.phase or "init", rp.step, now - rp.progress_seen,
                             now - rp.beat_received,
                             phase_timeout(cfg, rp.phase, training, rp.warming), silent=True))
    return peers


def _check(rp: RankProgress, cfg: TimeoutsConfig, training: TrainingTimeout,
           now: float) -> Suspect | None:
    if rp.progress_seen is None:
        return None
    limit = phase_timeout(cfg, rp.phase, training, rp.warming)
    if rp.finished:
        # Past its last step and tearing down (process groups, interpreter exit), whatever
        # phase a script of its own last reported: the finishing phase's timeout.
        limit = max(limit, cfg.phases.finishing)
    if rp.progress == "hook" and rp.step is None:
        # A script without the SDK before its first optimizer step (or one that never
        # steps one): no phase applies to it, only liveness; its beats stopping is the hang.
        limit = cfg.node_lost_s
        if rp.beat_received is not None and now - rp.beat_received <= limit:
            return None
    idle = now - rp.progress_seen
    if idle <= limit:
        return None
    beat_age = None if rp.beat_received is None else now - rp.beat_received
    silent = beat_age is None or beat_age > silent_after_s(cfg.heartbeat_interval_s)
    return Suspect(rp.rank, rp.phase or "init", rp.step, idle, beat_age, limit, silent)


def collective_timeout_s(cfg: TimeoutsConfig, training: TrainingTimeout,
                         own_script: bool = False) -> float:
    """torch.distributed's timeout: above every hang timeout that can judge the ranks, so we
    act first.

    The orchestrator dumps stacks and names the stuck rank; a collective that times out
    first would only kill the rank with a less useful error. It is a backstop, never NCCL's
    ten-minute default. The built-in trainer reports every phase, so the longest phase
    timeout counts (compiling's 1,800 s by default). A script of the user's own is judged by
    liveness before its first step and by the training timeout after it (the preload hook
    reports no loading, compiling or checkpointing phase): the start-up phase, the training
    and finishing timeouts and the node-loss silence bound it (360 s by default), not gloo's
    30 minutes. A script that reports longer phases through the SDK and waits in a collective
    meanwhile passes its own ``timeout=`` to ``init_process_group`` (kept as given).
    """
    phases = cfg.phases
    if own_script:
        longest = max(phases.init, phases.finishing, cfg.node_lost_s, training.value())
    else:
        longest = max(phases.init, phases.loading, phases.compiling, phases.checkpointing,
                      phases.evaluating, phases.finishing, cfg.node_lost_s, training.value())
    return longest + 60.0
