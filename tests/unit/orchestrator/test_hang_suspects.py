"""Who a hang names: a rank that stopped beating is named first, even when its blocked peer
crossed the timeout first (each rank's step is seen when its own agent next beats)."""

from __future__ import annotations

from orchestrator.config.schema import TimeoutsConfig
from orchestrator.supervisor.generation.hangs import TrainingTimeout, find_hangs
from orchestrator.supervisor.generation.progress import GenerationProgress, RankProgress

CFG = TimeoutsConfig(training_floor_s=2.0, training_multiplier=3.0,
                     heartbeat_interval_s=0.5)


def _gen(*ranks: RankProgress) -> GenerationProgress:
    """Ranks that reported 0.3 s steps: the training timeout is the 2 s floor."""
    gen = GenerationProgress(generation=1)
    for rp in ranks:
        gen.ranks[rp.rank] = rp
        if rp.progress_seen is not None:  # as a beat files it: by phase, oldest first
            phase, rp.phase = rp.phase, None
            gen.progressed(rp, phase, rp.progress_seen)
        gen.report_interval(rp.rank, 0.3)
    return gen


def _stopped_and_blocked(stopped_seen: float, now: float) -> list:
    """Rank 0 blocked in step 24's collective (beating), rank 1 SIGSTOPped after step 23:
    its last beat carried step 23 and was seen at ``stopped_seen``."""
    gen = _gen(
        RankProgress(0, step=23, phase="training", progress_seen=100.0, beat_received=now - 0.1),
        RankProgress(1, step=23, phase="training", progress_seen=stopped_seen,
                     beat_received=stopped_seen))
    return find_hangs(gen, CFG, TrainingTimeout(CFG, None), now)


def test_the_stopped_rank_is_named_first_though_its_step_was_seen_after_its_peers() -> None:
    """Seen on a loaded CI host: the blocked peer's step 23 reached the supervisor 0.4 s
    before the stopped rank's, so only the peer was past 2 s, and it was named alone."""
    suspects = _stopped_and_blocked(stopped_seen=100.4, now=102.05)
    assert [s.rank for s in suspects] == [1, 0]
    first = suspects[0]
    assert first.silent and first.step == 23 and round(first.idle_s, 2) == 1.65
    assert "no heartbeat for 1.6 s (process stopped or frozen)" in first.describe()


def test_a_rank_that_still_beats_is_not_added_nor_one_past_the_suspects_step() -> None:
    gen = _gen(
        RankProgress(0, step=23, phase="training", progress_seen=100.0, beat_received=102.0),
        RankProgress(1, step=23, phase="training", progress_seen=100.4, beat_received=101.9),
        RankProgress(2, step=24, phase="training", progress_seen=100.5, beat_received=100.5))
    suspects = find_hangs(gen, CFG, TrainingTimeout(CFG, None), 102.05)
    assert [s.rank for s in suspects] == [0]


def test_no_hang_no_one_named_however_silent() -> None:
    """A silent rank alone, not past its timeout, is the node-loss check's or a later
    judgement's: nothing is named before some rank is past its timeout."""
    gen = _gen(
        RankProgress(0, step=23, phase="training", progress_seen=100.0, beat_received=101.8),
        RankProgress(1, step=23, phase="training", progress_seen=100.0, beat_received=100.0))
    assert find_hangs(gen, CFG, TrainingTimeout(CFG, None), 101.9) == []


def test_a_rank_waiting_for_a_peer_that_is_loading_is_not_a_hang() -> None:
    """After an in-job recovery the replacement page-locks its buffers beside its first
    steps (phase ``loading``, its own timeout); the survivor, blocked in ``training`` in
    the collective that waits for it, was named a hang 1.8 s in (2 x H100)."""
    gen = _gen(
        RankProgress(0, step=121, phase="training", progress_seen=100.0, beat_received=104.9),
        RankProgress(1, step=121, phase="loading", progress_seen=100.1, beat_received=104.9))
    for rp in list(gen.ranks.values()):  # as the tracker files them by phase
        phase, seen = rp.phase, rp.progress_seen
        rp.phase = None
        gen.progressed(rp, phase, seen)
    assert find_hangs(gen, CFG, TrainingTimeout(CFG, None), 105.0) == []
    # The busy peer stops beating: the wait is a hang again, and the silent peer is named.
    gen.ranks[1].beat_received = 101.0
    assert [s.rank for s in find_hangs(gen, CFG, TrainingTimeout(CFG, None), 105.0)] == [1, 0]
