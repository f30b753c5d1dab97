"""The collective timeout the ranks get: above every hang timeout that can judge them (so the
orchestrator acts first), and for a script of the user's own not the 30 minutes of the
longest phase it never reports (the README promises shorter than gloo's default)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config.schema import PhaseTimeouts, TimeoutsConfig
from orchestrator.supervisor.generation.hangs import TrainingTimeout, collective_timeout_s

GLOO_DEFAULT_S = 1800.0
CASES = 300


def test_defaults() -> None:
    cfg = TimeoutsConfig()
    training = TrainingTimeout(cfg, None)
    assert collective_timeout_s(cfg, training, own_script=True) == 360.0
    assert collective_timeout_s(cfg, training, own_script=True) < GLOO_DEFAULT_S
    # The built-in trainer reports compiling (1,800 s): its collectives wait that long.
    assert collective_timeout_s(cfg, training) == 1860.0


_SECONDS = st.floats(min_value=0.5, max_value=20_000, allow_nan=False)
_NODE_LOST = st.floats(min_value=1.5, max_value=20_000)  # above two default heartbeats


@settings(max_examples=CASES, deadline=None)
@given(init=_SECONDS, loading=_SECONDS, compiling=_SECONDS, checkpointing=_SECONDS,
       evaluating=_SECONDS, finishing=_SECONDS, node_lost=_NODE_LOST, floor=_SECONDS,
       interval=st.none() | st.floats(min_value=0.001, max_value=5_000, allow_nan=False))
def test_above_every_timeout_that_judges_the_ranks(init: float, loading: float,
                                                   compiling: float, checkpointing: float,
                                                   evaluating: float, finishing: float,
                                                   node_lost: float, floor: float,
                                                   interval: float | None) -> None:
    cfg = TimeoutsConfig(phases=PhaseTimeouts(
        init=init, loading=loading, compiling=compiling, checkpointing=checkpointing,
        evaluating=evaluating, finishing=finishing), node_lost_s=node_lost,
        training_floor_s=floor, training_floor_calibrated_s=min(floor, 1.0))
    training = TrainingTimeout(cfg, interval)
    script = collective_timeout_s(cfg, training, own_script=True)
    ours = collective_timeout_s(cfg, training)
    # A script's rank: liveness before its first step, training after, finishing at the end.
    assert script > max(init, finishing, node_lost, training.value())
    assert ours > max(init, loading, compiling, checkpointing, evaluating, finishing,
                      node_lost, training.value())
    assert script <= ours
