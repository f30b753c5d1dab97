"""One calibration for every rank: the worker SDK's step pace (``contracts.pace``) through
the supervisor's progress and hang check, on a fake clock.

A simulated rank (a real ``Worker``, its beats captured instead of sent) steps on a schedule;
its beats reach the supervisor's ``ProgressTracker`` a relay later (the agent's beat), and
the hang check runs every supervisor tick. What is asserted is what an operator sees: how
long after a rank stopped its hang was found, and that no healthy rank ever was.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.schema import TimeoutsConfig
from orchestrator.contracts.pace import PACE_WINDOW, WARMUP_STEPS, StepPace
from orchestrator.contracts.protocol import RankInfo
from orchestrator.supervisor.generation.parts import TICK_S
from orchestrator.supervisor.generation.hangs import TrainingTimeout, any_overdue, find_hangs
from orchestrator.supervisor.generation.progress import GenerationProgress, ProgressTracker, RankProgress
from orchestrator.worker.sdk import Worker
from tests.fakes import FakeClock

# The schema's defaults: multiplier 3, floor 30 s coming down to 1 s after 10 intervals.
DEFAULTS = TimeoutsConfig()
BEAT_S = 0.5  # the worker's beat, and the agent's relay of it
DT = 0.05  # the simulation's resolution (beats, ticks and steps fall on it)
HYPOTHESIS_CASES = 150


class _Worker(Worker):
    """A worker whose beats are kept, not sent."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(env={"RANK": "0"}, clock=clock.time)
        self.sent: list[dict[str, Any]] = []

    def _send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True


class Rank:
    """One rank under the supervisor's eyes: steps on ``intervals``, beats every BEAT_S,
    relayed by its agent BEAT_S / 2 later, checked every TICK_S."""

    def __init__(self, tmp: Path, cfg: TimeoutsConfig, *, hook: bool = False,
                 generation: int = 1, training: TrainingTimeout | None = None,
                 clock: FakeClock | None = None) -> None:
        self.cfg, self.hook, self.generation = cfg, hook, generation
        self.clock = clock or FakeClock()
        self.worker = _Worker(self.clock)
        if hook:
            self.worker.progress = "hook"
        self.tracker = ProgressTracker(tmp / f"steps-{generation}.jsonl", self.clock,
                                       lambda e: e)
        self.tracker.start_generation(generation, 1)
        self.training = training or TrainingTimeout(cfg, None)
        self.step = 0
        self.stopped_at: float | None = None
        self.found_at: float | None = None
        self.suspects: list[Any] = []
        self._next_beat = self.clock.t + BEAT_S
        self._next_tick = self.clock.t + TICK_S
        self._pending: list[tuple[float, dict[str, Any]]] = []

    def _beat(self) -> None:
        self.worker.beat_now()
        self._pending.append((self.clock.t + BEAT_S / 2, self.worker.sent[-1]))

    def _relay(self) -> None:
        due = [m for t, m in self._pending if t <= self.clock.t + 1e-9]
        self._pending = [(t, m) for t, m in self._pending if t > self.clock.t + 1e-9]
        for msg in due:
            self.tracker.on_records(self.generation, msg["records"])
            self.tracker.on_ranks(self.generation, [RankInfo(
                rank=0, local_rank=0, step=msg["step"], phase=msg["phase"],
                beat_ts=msg["ts"], step_interval_max=msg["interval_max"],
                progress=msg["progress"], finished=msg["finished"])])

    def _advance(self, seconds: float) -> None:
        end = self.clock.t + seconds
        while self.clock.t < end - 1e-9:
            self.clock.advance(min(DT, end - self.clock.t))
            if self.stopped_at is None and self.clock.t >= self._next_beat - 1e-9:
                self._beat()
                self._next_beat += BEAT_S
            self._relay()
            if self.clock.t >= self._next_tick - 1e-9:
                self._next_tick += TICK_S
                gen = self.tracker.current
                now = self.clock.monotonic()
                if any_overdue(gen, self.cfg, self.training, now):
                    self.suspects = find_hangs(gen, self.cfg, self.training, now)
                    if self.suspects:
                        self.found_at = now
                        return

    def run(self, intervals: list[float]) -> bool:
        """Step once per interval (the first step at once); False at a (false) hang."""
        for interval in [0.0, *intervals]:
            self._advance(interval)
            if self.found_at is not None:
                return False
            self.step += 1
            if self.hook:
                self.worker.optimizer_stepped(self.step)
            else:
                self.worker.step_done(self.step)
        return True

    def stop(self, limit_s: float = 120.0) -> float | None:
        """SIGSTOP right after its last step: seconds until the hang is found."""
        self.stopped_at = self.clock.t
        self._advance(limit_s)
        return None if self.found_at is None else self.found_at - self.stopped_at


def _bound(intervals: list[float]) -> float:
    """The target: 3 x the step interval (its median) + 2 s."""
    return 3 * statistics.median(intervals) + 2.0


def test_one_slow_early_step_does_not_raise_the_bound_for_the_rest_of_the_job(
        tmp_path: Path) -> None:
    """A 0.24 s-step job with one 1.06 s step early (2 x H100: it held the timeout at 3.19 s
    and a SIGSTOP was found in 3.42 s against a 2.71 s bound)."""
    steady = [0.24] * 60
    intervals = [0.24] * 8 + [1.06] + steady
    rank = Rank(tmp_path, DEFAULTS)
    assert rank.run(intervals)
    assert rank.training.value() == pytest.approx(1.0)  # max(1 s floor, 3 x 0.24)
    found = rank.stop()
    assert found is not None and found <= _bound(intervals)
    assert found >= rank.training.value()  # never before the timeout


def test_the_old_largest_interval_rule_misses_the_bound_with_the_same_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same job measured by the largest recent interval (the SDK's rule before the pace):
    the bound is missed, which is what the test above guards against."""
    monkeypatch.setattr(StepPace, "value",
                        lambda self: max(self._window) if self._window else None)
    intervals = [0.24] * 8 + [1.06] + [0.24] * 60
    rank = Rank(tmp_path, DEFAULTS)
    assert rank.run(intervals)
    found = rank.stop()
    assert found is not None and found > _bound(intervals)


def test_a_slow_step_that_recurs_is_part_of_the_pace_and_no_false_alarm(
        tmp_path: Path) -> None:
    """Synchronous logging every 4 steps takes 1.5 s: its first two occurrences fall under
    the start-up floor, and once seen twice it is the pace, so every later one is covered."""
    intervals = ([0.1] * 3 + [1.5]) * 25
    rank = Rank(tmp_path, DEFAULTS)
    assert rank.run(intervals), "a recurring slow step was taken for a hang"
    assert rank.training.value() == pytest.approx(4.5)
    found = rank.stop()
    assert found is not None and found <= 3 * 1.5 + 2.0


def test_a_restarts_warm_up_is_judged_by_the_start_up_floor_then_the_tight_value(
        tmp_path: Path) -> None:
    """Generation 2 carries a tight 1 s timeout; its first steps (a compile, page-locking)
    take 2.5 s each and are no hang; past the warm-up a stop is found within the bound."""
    cfg = DEFAULTS
    carried = TrainingTimeout(cfg, 0.24, carried_intervals=300)
    assert carried.value() == pytest.approx(1.0)
    rank = Rank(tmp_path, cfg, generation=2, training=carried)
    warm_up = [2.5] * WARMUP_STEPS
    assert rank.run(warm_up + [0.24] * 40), "a restart's warm-up was taken for a hang"
    found = rank.stop()
    assert found is not None and found <= _bound([0.24] * 40)
    # A stop inside the warm-up is judged by the start-up floor.
    early = Rank(tmp_path, cfg, generation=3, training=TrainingTimeout(cfg, 0.24, 300),
                 clock=FakeClock(t=5000.0))
    assert early.run([2.5])
    assert early.stop() is not None
    assert early.suspects[0].timeout_s == cfg.training_floor_s


def test_a_script_without_the_sdk_gets_the_same_bound_from_its_optimizer_steps(
        tmp_path: Path) -> None:
    """The preload hook's optimizer-step count, a long first step (init, judged by
    liveness), a warm-up, then 0.3 s steps: a stop is found near 3 x step + 2 s."""
    rank = Rank(tmp_path, DEFAULTS, hook=True)
    intervals = [4.0, 2.0, 1.2] + [0.3] * 50
    assert rank.run(intervals)
    found = rank.stop()
    assert found is not None and found <= _bound(intervals)


def test_a_slower_pace_is_followed_after_two_of_its_steps(tmp_path: Path) -> None:
    """A job whose steps become 2.5x slower for good (a longer sequence length): no false
    alarm (each slow step is within 3x the pace before it), and the new pace sets the bound."""
    rank = Rank(tmp_path, DEFAULTS)
    assert rank.run([0.4] * 40 + [1.0] * 40)
    assert rank.training.value() == pytest.approx(3.0)
    found = rank.stop()
    assert found is not None and found <= _bound([1.0] * 40)


@settings(max_examples=HYPOTHESIS_CASES, deadline=None)
@given(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=0, max_size=400),
       st.integers(0, 5), st.integers(2, 50))
def test_the_pace_ignores_the_warm_up_and_one_outlier_and_covers_the_rest(
        intervals: list[float], warmup: int, window: int) -> None:
    pace = StepPace(window=window, warmup=warmup)
    for x in intervals:
        pace.add(x)
    measured = intervals[warmup:][-window:]
    value = pace.value()
    if len(measured) < 2:
        assert value is None
        return
    ordered = sorted(measured)
    assert value == ordered[-2]
    # Every measured interval but the single largest is covered by the pace.
    assert sum(x > value for x in measured) <= 1
    assert pace.warming == (len(intervals) < warmup)


def test_unmeasured_intervals_count_toward_the_warm_up_and_bad_ones_are_dropped() -> None:
    pace = StepPace(warmup=2)
    pace.add(9.0, measured=False)
    pace.add(9.0)
    assert pace.value() is None and not pace.warming
    pace.add(float("inf"))
    pace.add(-1.0)
    pace.add(0.5)
    assert pace.intervals() == [0.5] and pace.value() is None  # seen once: no pace yet
    pace.add(0.25)
    assert pace.value() == 0.25
    with pytest.raises(ValueError):
        StepPace(window=1)
    assert PACE_WINDOW >= 100 and WARMUP_STEPS >= 1


@settings(max_examples=30, deadline=None)
@given(pace=st.integers(1, 40), slow=st.integers(20, 160), at=st.integers(WARMUP_STEPS, 7),
       stop_after=st.integers(40, 150))
def test_never_a_false_alarm_and_a_stop_found_within_the_bound_after_one_slow_step(
        tmp_path_factory: pytest.TempPathFactory, pace: float, slow: float, at: int,
        stop_after: int) -> None:
    """Whatever the pace, wherever one slow step lands before the floor comes down (after it,
    a step slower than the tight timeout is a hang by definition): the job runs without a
    false alarm, and a stop once the floor is down is found within 3 x step + 2 s."""
    pace, slow = pace * DT, max(slow, pace) * DT  # 0.05-2 s steps, one of 1-8 s
    intervals = [pace] * at + [slow] + [pace] * stop_after
    rank = Rank(tmp_path_factory.mktemp("pace"), DEFAULTS)
    assert rank.run(intervals)
    found = rank.stop()
    assert found is not None and found <= _bound(intervals)


def test_a_rank_waiting_for_a_peer_that_saves_or_evaluates_alone_is_not_hung() -> None:
    """A script whose rank 0 saves and evaluates alone: rank 1 waits in its next collective,
    past the training timeout, while rank 0 is in ``checkpointing``. Rank 1 is not hung;
    rank 0 is judged by its phase's timeout, and a rank that stops beating is still found."""
    cfg = TimeoutsConfig(training_floor_s=2.0, training_multiplier=3,
                         phases={"checkpointing": 20})
    clock = FakeClock()
    gen = GenerationProgress(generation=1, first_step=1, last_step=100)
    for rank in (0, 1):
        rp = gen.ranks[rank] = RankProgress(rank, progress="hook", step=100, first_step=1,
                                           beat_received=clock.monotonic())
        gen.progressed(rp, "training", clock.monotonic())
    training = TrainingTimeout(cfg, 0.2, carried_intervals=100)
    gen.progressed(gen.ranks[0], "checkpointing", clock.monotonic())
    for _ in range(50):  # 10 s: both keep beating, rank 1 makes no progress
        clock.advance(TICK_S)
        for rp in gen.ranks.values():
            rp.beat_received = clock.monotonic()
        assert find_hangs(gen, cfg, training, clock.monotonic()) == []
    # Rank 0's save ends; rank 1's next step reaches us a beat later: not hung meanwhile,
    # but hung once a training timeout has passed since the save ended.
    gen.progressed(gen.ranks[0], "training", clock.monotonic())
    clock.advance(0.5)
    for rp in gen.ranks.values():
        rp.beat_received = clock.monotonic()
    assert find_hangs(gen, cfg, training, clock.monotonic()) == []
    clock.advance(1.7)
    for rp in gen.ranks.values():
        rp.beat_received = clock.monotonic()
    assert [s.rank for s in find_hangs(gen, cfg, training, clock.monotonic())] == [1, 0]
    gen.progressed(gen.ranks[0], "checkpointing", clock.monotonic())
    clock.advance(21.0)  # rank 0's save is past its own timeout: it is named
    for rp in gen.ranks.values():
        rp.beat_received = clock.monotonic()
    names = [(s.rank, s.phase) for s in find_hangs(gen, cfg, training, clock.monotonic())]
    assert set(names) == {(0, "checkpointing"), (1, "training")}
    # A rank that stopped beating while its peer saves is found at its own timeout.
    gen.progressed(gen.ranks[0], "checkpointing", clock.monotonic())
    gen.progressed(gen.ranks[1], "training", clock.monotonic())
    clock.advance(2.2)
    gen.ranks[0].beat_received = clock.monotonic()
    [suspect] = find_hangs(gen, cfg, training, clock.monotonic())
    assert suspect.rank == 1 and suspect.silent and suspect.idle_s == pytest.approx(2.2)


def test_the_jobs_pace_is_the_smallest_rank_pace_a_peers_waits_do_not_set_it() -> None:
    """Rank 0 saves and evaluates alone (left out of its steps); rank 1 measured its waits for
    it as steps, twice, so its own pace is the wait. The job's pace is rank 0's."""
    gen = GenerationProgress(generation=1, first_step=1, last_step=200)
    gen.report_interval(0, 0.3)
    gen.report_interval(1, 4.3)
    training = TrainingTimeout(DEFAULTS, None, carried_intervals=200)
    training.observe(gen)
    assert gen.pace == 0.3 and training.value() == pytest.approx(1.0)
    gen.report_interval(0, None)  # a rank with no pace yet does not count
    assert gen.pace == 4.3


def test_the_interval_count_is_journaled_until_the_floor_is_down_so_a_restart_carries_it(
        ) -> None:
    """A generation killed before the floor came down: its measured intervals still count
    for the next one (the journal's ``calibration`` events carry the count), so a restart
    does not wait for ten more intervals with the 30 s floor."""
    training = TrainingTimeout(DEFAULTS, None)
    gen = GenerationProgress(generation=1, first_step=1, last_step=1)
    gen.report_interval(0, 0.2)
    journaled = []
    for last in range(2, 20):
        gen.last_step = last
        training.observe(gen)
        if training.needs_journal():
            journaled.append(training.intervals)
    assert journaled == list(range(1, DEFAULTS.calibration_steps + 1))
    assert TrainingTimeout(DEFAULTS, 0.2, carried_intervals=6).value() == 30
    assert TrainingTimeout(DEFAULTS, 0.2, carried_intervals=journaled[-1]).value() == 1.0
