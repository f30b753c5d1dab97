"""StabilityMonitor as a whole: order, state round trips, summary, worst_action, SkipStepGuard."""

from __future__ import annotations

import json
import math

import pytest
from _stability_streams import noise, records, steady_grads

from stability import (
    Event,
    SkipStepGuard,
    StabilityConfig,
    StabilityMonitor,
    StepRecord,
    worst_action,
)
from stability.config import GradSpikeConfig, GrowthConfig, PersistentSpikeConfig


def rich_stream(n: int = 400) -> list[StepRecord]:
    """Spikes of several lengths, a NaN, a param-norm jump, a loss spike and a ramp to 4x."""
    grads: list[float] = steady_grads(n)
    for start, length in ((40, 1), (60, 3), (90, 7), (130, 2), (201, 1)):
        for s in range(start, start + length):
            grads[s] = 1.6
    for i in range(250, n):
        grads[i] = 1.0 + 3.0 * (i - 250) / (n - 250) + noise(i)
    grads[170] = math.inf
    losses = [2.0 + noise(i, 0.01) for i in range(n)]
    losses[150] = 4.0
    losses[171] = math.nan
    recs = []
    for i in range(n):
        param = None if i % 3 else 1600.0 + i + (2000.0 if i >= 201 else 0.0)
        recs.append(StepRecord(i, losses[i], grads[i], param_norm=param, lr=3e-4, tokens=4096))
    return recs


def dumps(events: list[Event]) -> list[str]:
    # Compare through JSON: NaN figures make Event equality useless.
    return [json.dumps(e.to_dict(), allow_nan=False) for e in events]


def test_rich_stream_produces_every_kind_in_detector_order():
    monitor = StabilityMonitor(StabilityConfig())
    per_step = [monitor.update(rec) for rec in rich_stream()]
    kinds = {e.kind for events in per_step for e in events}
    assert kinds == {
        "grad_spike",
        "grad_spike_end",
        "persistent_spike",
        "growth",
        "nonfinite",
        "loss_spike",
        "param_norm_jump",
    }
    order = ["loss.nonfinite", "grad_spike", "persistent_spike", "growth", "loss.spike"]
    order.append("param_norm")
    crowded = [events for events in per_step if len({e.rule for e in events}) > 1]
    assert crowded  # step 201: a grad spike and a param-norm jump
    for events in crowded:
        ranks = [order.index(e.rule) for e in events]
        assert ranks == sorted(ranks)


@pytest.mark.parametrize("split", [0, 1, 19, 20, 41, 62, 93, 170, 171, 300, 399])
def test_state_round_trip_gives_the_same_future_events(split):
    stream = rich_stream()
    config = StabilityConfig()
    straight = StabilityMonitor(config)
    expected = [e for rec in stream for e in straight.update(rec)]

    first = StabilityMonitor(config)
    before = [e for rec in stream[:split] for e in first.update(rec)]
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))
    second = StabilityMonitor(config)
    second.load_state_dict(state)
    after = [e for rec in stream[split:] for e in second.update(rec)]

    assert dumps(before + after) == dumps(expected)
    assert second.summary() == straight.summary()


def test_load_state_tolerates_a_changed_set_of_detectors():
    stream = rich_stream()[:100]
    full = StabilityMonitor(StabilityConfig())
    for rec in stream:
        full.update(rec)
    fewer = StabilityMonitor(StabilityConfig(growth=GrowthConfig(enabled=False)))
    fewer.load_state_dict(full.state_dict())
    assert fewer.summary()["growth_ratio"] is None
    assert fewer.summary()["spikes_total"] == full.summary()["spikes_total"]
    with pytest.raises(ValueError, match="version"):
        fewer.load_state_dict({**full.state_dict(), "version": 99})


def test_summary_is_the_operator_picture():
    monitor = StabilityMonitor(StabilityConfig())
    for rec in records(steady_grads(60, s40=2.0, s50=1.5, s51=1.5)):
        monitor.update(rec)
    monitor.update(StepRecord(60, math.nan, 1.002, param_norm=1600.0))
    s = monitor.summary()
    json.dumps(s, allow_nan=False)
    assert s["step"] == 60 and s["last_loss"] == "nan"
    assert s["last_grad_norm"] == 1.002 and s["last_param_norm"] == 1600.0
    assert s["spikes_total"] == 2 and s["longest_spike"] == 2
    assert s["current_spike_length"] == 0
    assert s["spike_length_histogram"]["1"] == 1 and s["spike_length_histogram"]["2"] == 1
    assert s["threshold"] == pytest.approx(s["running_mean"] + 0.1)
    assert s["lowest_grad_norm"] == 1.0
    assert s["growth_ratio"] == pytest.approx(1.002)


def test_worst_action_ordering():
    def ev(action: str) -> Event:
        return Event("k", 1, "r", action)

    assert worst_action([]) is None
    assert worst_action([ev("record")]) == "record"
    assert worst_action([ev("record"), ev("skip_step")]) == "skip_step"
    assert worst_action([ev("skip_step"), ev("lower_lr"), ev("record")]) == "lower_lr"
    assert worst_action([ev("lower_lr"), ev("rollback"), ev("skip_step")]) == "rollback"
    with pytest.raises(ValueError, match="unknown action"):
        worst_action([ev("explode")])


def test_skip_step_guard_skips_exactly_the_spike_step():
    config = StabilityConfig(grad_spike=GradSpikeConfig(action="skip_step"))
    guard = SkipStepGuard(config)
    assert guard.active
    grads = steady_grads(60, s40=2.0)
    decisions = [guard.should_skip(i, 2.0 + noise(i, 0.01), g) for i, g in enumerate(grads)]
    assert [i for i, skip in enumerate(decisions) if skip] == [40]
    assert [e.kind for e in guard.last_events] == []


def test_skip_step_guard_ranks_agree_and_restore():
    config = StabilityConfig(
        grad_spike=GradSpikeConfig(action="skip_step"),
        persistent_spike=PersistentSpikeConfig(action="skip_step", length=2),
    )
    grads = steady_grads(80, s40=2.0, s41=2.0, s42=2.0, s70=3.0)
    ranks = [SkipStepGuard(config) for _ in range(2)]
    decisions = [[g.should_skip(i, 2.0, x) for i, x in enumerate(grads[:50])] for g in ranks]
    assert decisions[0] == decisions[1]
    assert [i for i, d in enumerate(decisions[0]) if d] == [40, 41]
    restored = SkipStepGuard(config)
    restored.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    later = [restored.should_skip(i, 2.0, grads[i]) for i in range(50, 80)]
    assert [50 + i for i, d in enumerate(later) if d] == [70]


def test_skip_step_guard_is_inactive_with_default_actions():
    guard = SkipStepGuard(StabilityConfig())
    assert not guard.active
    assert not any(guard.should_skip(i, 2.0, g) for i, g in enumerate(steady_grads(60, s40=9.0)))
