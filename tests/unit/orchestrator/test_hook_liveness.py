"""Hang judging for ranks whose progress comes from the preload hook (no SDK): before their
first optimizer step no phase timeout applies, only liveness; after it, the usual rules."""

from __future__ import annotations

from orchestrator.config.schema import TimeoutsConfig
from orchestrator.supervisor.generation.hangs import TrainingTimeout, find_hangs
from orchestrator.supervisor.generation.progress import GenerationProgress, RankProgress

CFG = TimeoutsConfig(node_lost_s=10, phases={"init": 30})


def _gen(**rank: object) -> GenerationProgress:
    gen = GenerationProgress(generation=1)
    gen.ranks[0] = RankProgress(0, **rank)
    return gen


def test_a_hook_rank_that_never_stepped_is_not_judged_by_the_init_timeout() -> None:
    # Started 1000 s ago, still no optimizer step, beating: alive, so not hung.
    gen = _gen(phase="init", progress="hook", progress_seen=0.0, beat_received=995.0)
    assert find_hangs(gen, CFG, TrainingTimeout(CFG, None), now=1000.0) == []


def test_a_hook_rank_whose_beats_stop_is_hung_after_the_liveness_timeout() -> None:
    gen = _gen(phase="init", progress="hook", progress_seen=0.0, beat_received=988.0)
    [suspect] = find_hangs(gen, CFG, TrainingTimeout(CFG, None), now=1000.0)
    assert suspect.rank == 0 and suspect.silent and suspect.timeout_s == 10


def test_an_sdk_rank_in_init_keeps_the_init_timeout() -> None:
    gen = _gen(phase="init", progress="sdk", progress_seen=0.0, beat_received=999.0)
    [suspect] = find_hangs(gen, CFG, TrainingTimeout(CFG, None), now=1000.0)
    assert suspect.timeout_s == 30 and not suspect.silent


def test_a_hook_rank_that_stepped_is_judged_by_the_training_timeout() -> None:
    gen = _gen(phase="training", progress="hook", step=5, progress_seen=900.0,
               beat_received=999.0, step_interval_max=2.0)
    [suspect] = find_hangs(gen, CFG, TrainingTimeout(CFG, None), now=1000.0)
    assert suspect.timeout_s == CFG.training_floor_s and suspect.step == 5


def test_a_rank_tearing_down_after_its_last_beat_gets_the_start_up_timeout() -> None:
    # 5 s since its last step and beat, past the 2 s training timeout: it said it finished.
    cfg = TimeoutsConfig(node_lost_s=10, phases={"init": 30, "training": 2})
    gen = _gen(phase="training", progress="sdk", step=25, progress_seen=995.0,
               beat_received=995.0, finished=True)
    assert find_hangs(gen, cfg, TrainingTimeout(cfg, None), now=1000.0) == []
    gen.ranks[0].finished = False
    assert [s.rank for s in find_hangs(gen, cfg, TrainingTimeout(cfg, None), now=1000.0)] == [0]
