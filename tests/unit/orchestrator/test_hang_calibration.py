"""A shorter path to a found hang: the training timeout's floor comes down to the measured step
scale (so a hang is found within 3 x the step interval + 2 s), a rank past its last step is
judged by the ``finishing`` timeout, and the first restart in a window does not back off.
Everything runs on the fake clock: detection is asserted to the supervisor's tick."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.schema import RestartConfig, TimeoutsConfig
from orchestrator.journal.view import JobView
from orchestrator.supervisor.generation.parts import TICK_S
from orchestrator.supervisor.generation.hangs import TrainingTimeout, any_overdue, find_hangs
from orchestrator.supervisor.policy import RestartPolicy
from orchestrator.supervisor.generation.progress import GenerationProgress, RankProgress
from tests.fakes import FakeClock

FAST = TimeoutsConfig(training_floor_s=30, training_multiplier=3,
                      training_floor_calibrated_s=1.0, calibration_steps=20)
HYPOTHESIS_CASES = 200


def _gen(clock: FakeClock, first: int = 1) -> GenerationProgress:
    gen = GenerationProgress(generation=1, first_step=first, last_step=first)
    rp = gen.ranks[0] = RankProgress(0, progress="sdk", beat_received=clock.monotonic())
    gen.progressed(rp, "training", clock.monotonic())
    rp.step = first
    return gen


def _step(gen: GenerationProgress, clock: FakeClock, interval: float, interval_max: float,
          beat: bool = True) -> None:
    """Rank 0 finishes its next step ``interval`` seconds after the last one."""
    clock.advance(interval)
    rp = gen.ranks[0]
    rp.step = (rp.step or 0) + 1
    rp.step_interval_max = interval_max
    gen.report_interval(0, interval_max)
    gen.last_step = rp.step
    if beat:
        rp.beat_received = clock.monotonic()
    gen.progressed(rp, "training", clock.monotonic())


def _found_after(gen: GenerationProgress, cfg: TimeoutsConfig, training: TrainingTimeout,
                 clock: FakeClock, limit_s: float) -> float | None:
    """Tick as the supervisor does (every TICK_S) until a hang is found; seconds taken."""
    start = clock.monotonic()
    while clock.monotonic() - start <= limit_s:
        if any_overdue(gen, cfg, training, clock.monotonic()) and \
                find_hangs(gen, cfg, training, clock.monotonic()):
            return clock.monotonic() - start
        clock.advance(TICK_S)
    return None


def test_the_floor_starts_high_and_comes_down_after_calibration_steps() -> None:
    clock = FakeClock()
    gen, training = _gen(clock), TrainingTimeout(FAST, None)
    for _ in range(19):
        _step(gen, clock, 0.2, 0.25)
        training.observe(gen)
    assert training.intervals == 19 and training.value() == 30  # still the start-up floor
    _step(gen, clock, 0.2, 0.25)
    training.observe(gen)
    assert training.intervals == 20 and training.value() == 1.0  # max(1.0, 3 x 0.25)
    # A slower pace raises it above the low floor: 3 x the largest interval.
    _step(gen, clock, 2.0, 2.0)
    training.observe(gen)
    assert training.value() == pytest.approx(6.0)


def test_a_fast_stepping_rank_that_stops_is_found_within_3_steps_plus_2_s() -> None:
    clock = FakeClock()
    gen, training = _gen(clock), TrainingTimeout(FAST, None)
    for _ in range(30):
        _step(gen, clock, 0.2, 0.23)
        assert not any_overdue(gen, FAST, training, clock.monotonic())
    found = _found_after(gen, FAST, training, clock, 60.0)  # SIGSTOP right after a step
    assert found is not None and found <= 3 * 0.23 + 2.0
    assert found >= training.value()  # never before the timeout: no false alarm
    # The same job without the calibrated floor waits out the fixed 30 s floor.
    fixed = TimeoutsConfig(training_floor_s=30, training_multiplier=3,
                           training_floor_calibrated_s=None)
    clock2 = FakeClock()
    gen2, training2 = _gen(clock2), TrainingTimeout(fixed, None)
    for _ in range(30):
        _step(gen2, clock2, 0.2, 0.23)
    slow = _found_after(gen2, fixed, training2, clock2, 60.0)
    assert slow is not None and slow >= 30.0


def test_one_slow_step_raises_the_timeout_for_the_horizon_not_for_good() -> None:
    """2 x H200: one 4 s step after a restart kept a 0.23 s-step job's timeout at 12 s for
    the rest of the job, and a SIGSTOP was found in 12.5 s (target 2.7 s)."""
    cfg = FAST.model_copy(update={"calibration_horizon_steps": 100})
    clock = FakeClock()
    gen, training = _gen(clock), TrainingTimeout(cfg, 0.23, carried_intervals=200)
    _step(gen, clock, 4.0, 4.0)  # the slow step, in the SDK's window of the rank's steps
    training.observe(gen)
    assert training.value() == pytest.approx(12.0)
    for _ in range(50):  # the SDK's window passes it; the horizon still holds it
        _step(gen, clock, 0.2, 4.0)
        training.observe(gen)
    for _ in range(100):
        _step(gen, clock, 0.2, 0.23)
        training.observe(gen)
    # The slow step's report held until 0.23 came; 99 intervals since: within the horizon.
    assert training.value() == pytest.approx(12.0)
    _step(gen, clock, 0.2, 0.23)
    training.observe(gen)
    assert training.value() == 1.0  # max(1.0, 3 x 0.23): the slow step is forgotten
    found = _found_after(gen, cfg, training, clock, 60.0)
    assert found is not None and found <= 3 * 0.23 + 2.0


@settings(max_examples=HYPOTHESIS_CASES, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.floats(0.05, 30.0)), min_size=1,
                max_size=30), st.integers(1, 300))
def test_the_timeout_covers_every_interval_reported_within_the_horizon(
        reports: list[tuple[int, float]], horizon: int) -> None:
    """Whatever the ranks report, the timeout is 3 x the largest interval reported within
    the last ``horizon`` steps (never less: no false hang on a pace seen that recently)."""
    cfg = FAST.model_copy(update={"calibration_horizon_steps": horizon})
    clock = FakeClock()
    gen, training = _gen(clock), TrainingTimeout(cfg, None)
    seen: list[tuple[int, float]] = []  # (intervals measured when reported, interval)
    for steps, interval in reports:
        for _ in range(steps):
            _step(gen, clock, 0.1, interval)
            training.observe(gen)
            seen.append((training.intervals, interval))
    now = training.intervals
    # An interval reported at count c holds until the next report; within the horizon if
    # the next report came after now - horizon.
    live = [v for i, (c, v) in enumerate(seen)
            if i + 1 == len(seen) or seen[i + 1][0] > now - horizon]
    assert training.max_interval == pytest.approx(max(live))


def test_calibration_is_carried_across_generations_and_old_journals_start_high() -> None:
    assert TrainingTimeout(FAST, 0.25, carried_intervals=25).value() == 1.0
    assert TrainingTimeout(FAST, 0.25, carried_intervals=5).value() == 30
    # A journal written before the count existed (calibration without ``intervals``).
    view = JobView.from_events([{"kind": "calibration", "max_interval_s": 0.25,
                                 "training_timeout_s": 10.0, "ts": 5.0}])
    assert view.calibration.get("intervals") is None
    assert TrainingTimeout(FAST, view.calibration["max_interval_s"],
                           view.calibration.get("intervals") or 0).value() == 30
    # Each generation's intervals add up; a generation is counted once however often seen.
    clock = FakeClock()
    training = TrainingTimeout(FAST, 0.25, carried_intervals=5)
    for generation in (2, 3):
        gen = _gen(clock, first=100)
        gen.generation = generation
        gen.last_step = 108
        training.observe(gen)
        training.observe(gen)
    assert training.intervals == 5 + 8 + 8 and training.value() == 1.0


def test_a_calibrated_floor_above_the_floor_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="training_floor_calibrated_s"):
        TimeoutsConfig(training_floor_s=2, training_floor_calibrated_s=5)


def test_a_rank_past_its_last_step_is_judged_by_the_finishing_timeout() -> None:
    cfg = TimeoutsConfig(training_floor_s=2, training_multiplier=3,
                         phases={"finishing": 40})
    clock = FakeClock()
    gen, training = _gen(clock), TrainingTimeout(cfg, None)
    for _ in range(25):
        _step(gen, clock, 0.2, 0.2)
    gen.progressed(gen.ranks[0], "finishing", clock.monotonic())  # the final commit, teardown
    clock.advance(39.0)  # far past the 2 s training timeout
    assert find_hangs(gen, cfg, training, clock.monotonic()) == []
    clock.advance(1.5)
    [suspect] = find_hangs(gen, cfg, training, clock.monotonic())
    assert suspect.phase == "finishing" and suspect.timeout_s == 40


@settings(max_examples=HYPOTHESIS_CASES, deadline=None)
@given(intervals=st.lists(st.floats(0.01, 5.0), min_size=1, max_size=60),
       floor=st.floats(2.0, 60.0), low=st.floats(0.2, 2.0), multiplier=st.floats(1.5, 6.0),
       steps=st.integers(1, 40))
def test_never_a_hang_while_steps_keep_their_pace_and_found_right_after(
        intervals: list[float], floor: float, low: float, multiplier: float,
        steps: int) -> None:
    """Whatever the pace, floors and multiplier: no rank stepping within its reported
    largest interval is ever suspected, and one that stops is found one tick after its
    timeout (the supervisor's check interval), never before."""
    cfg = TimeoutsConfig(training_floor_s=floor, training_multiplier=multiplier,
                         training_floor_calibrated_s=low, calibration_steps=steps)
    clock = FakeClock()
    gen, training = _gen(clock), TrainingTimeout(cfg, None)
    largest = 0.0
    for interval in intervals:
        largest = max(largest, interval)
        _step(gen, clock, interval, largest)
        assert not find_hangs(gen, cfg, training, clock.monotonic())
    timeout = training.value()
    assert timeout == pytest.approx(max(low if len(intervals) >= steps else floor,
                                        multiplier * largest))
    found = _found_after(gen, cfg, training, clock, timeout + 1.0)
    assert found is not None and timeout < found <= timeout + TICK_S + 1e-9


def _failures(*at: float) -> JobView:
    events: list[dict] = [{"kind": "generation_launched", "generation": 1, "ts": 0.0}]
    for i, ts in enumerate(at):
        events.append({"kind": "failure", "cause": "worker_exit", "generation": i + 1,
                       "newest_checkpoint_step": None, "ts": ts})
        events.append({"kind": "generation_launched", "generation": i + 2, "ts": ts})
    return JobView.from_events(events)


def test_the_first_restart_in_a_window_does_not_back_off() -> None:
    policy = RestartPolicy(RestartConfig(backoff_initial_s=1, backoff_multiplier=2,
                                         backoff_max_s=30, backoff_window_s=600,
                                         max_restarts_without_progress=10))
    clock = FakeClock(t=10_000.0)
    at = [clock.time()]
    assert policy.decide(_failures(*at)).delay_s == 0.0  # the job's first failure
    clock.advance(100)  # a second one inside the window backs off (no progress: 2 in a row)
    at.append(clock.time())
    assert policy.decide(_failures(*at)).delay_s == 2.0
    clock.advance(30)
    at.append(clock.time())
    assert policy.decide(_failures(*at)).delay_s == 4.0
    clock.advance(600.5)  # past the window since the one before: at once again
    at.append(clock.time())
    assert policy.decide(_failures(*at)).delay_s == 0.0
    never = RestartPolicy(RestartConfig(backoff_initial_s=1, backoff_window_s=0))
    assert never.decide(_failures(10.0)).delay_s == 1.0  # window 0: always back off
