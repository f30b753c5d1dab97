"""Property tests: detectors take any input without raising, and their state stays bounded."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from stability import StabilityConfig, StabilityMonitor, StepRecord

# database=None: no .hypothesis directory written into the checkout.
PROPERTY = settings(max_examples=150, deadline=None, database=None)

CONFIGS = [
    StabilityConfig(),
    StabilityConfig.model_validate(
        {
            "warmup_steps": 0,
            "grad_spike": {"mode": "zscore", "window": 2, "histogram_max_length": 1},
            "persistent_spike": {"length": 1},
            "loss": {"spike": {"window": 2, "ratio": 1.1}},
            "growth": {"rearm_fraction": 1.0},
        }
    ),
    StabilityConfig.model_validate(
        {
            "warmup_steps": 3,
            "grad_spike": {"mode": "relative", "window": 4, "include_spikes_in_mean": True},
            "loss": {"spike": {"window": 3, "zscore_k": None, "ratio": 1.5}},
        }
    ),
]

any_float = st.floats(allow_nan=True, allow_infinity=True)
small_float = st.floats(min_value=-3.0, max_value=3.0)
value = st.one_of(any_float, small_float, st.sampled_from([0.0, 1.0, 1e308, -1e308, 5e-324]))
optional = st.none() | value
step_record = st.tuples(st.integers(-2, 40), value, optional, optional)
streams = st.lists(step_record, max_size=120)


def build(stream: list[tuple[int, float, float | None, float | None]]) -> list[StepRecord]:
    """Records whose steps advance by the drawn increments (which may go backwards)."""
    out, step = [], 0
    for increment, loss, grad, param in stream:
        step += increment
        out.append(StepRecord(step, loss, grad, param_norm=param))
    return out


def leaves(obj) -> int:
    if isinstance(obj, dict):
        return sum(leaves(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(leaves(v) for v in obj)
    return 1


def longest_list(obj) -> int:
    if isinstance(obj, dict):
        return max((longest_list(v) for v in obj.values()), default=0)
    if isinstance(obj, list):
        return max([len(obj), *(longest_list(v) for v in obj)])
    return 0


def bound(config: StabilityConfig) -> int:
    g = config.grad_spike
    # Two grad windows (grad_spike and persistent_spike keep one each), the loss window, the
    # histogram, and a few dozen scalars.
    return 2 * g.window + config.loss.spike.window + g.histogram_max_length + 1 + 40


@PROPERTY
@given(st.sampled_from(CONFIGS), streams)
def test_monitor_never_raises_and_state_is_bounded_strict_json(config, stream):
    monitor = StabilityMonitor(config)
    g = config.grad_spike
    max_list = max(g.window, config.loss.spike.window, g.histogram_max_length + 1)
    for rec in build(stream):
        for event in monitor.update(rec):
            json.dumps(event.to_dict(), allow_nan=False)
        state = monitor.state_dict()
        assert longest_list(state) <= max_list
        assert leaves(state) <= bound(config)
    json.dumps(monitor.state_dict(), allow_nan=False)
    json.dumps(monitor.summary(), allow_nan=False)


@PROPERTY
@given(st.sampled_from(CONFIGS), streams, st.integers(0, 120))
def test_restored_state_continues_identically(config, stream, split):
    recs = build(stream)
    split = min(split, len(recs))
    straight = StabilityMonitor(config)
    expected = [json.dumps(e.to_dict()) for rec in recs for e in straight.update(rec)]
    first = StabilityMonitor(config)
    got = [json.dumps(e.to_dict()) for rec in recs[:split] for e in first.update(rec)]
    second = StabilityMonitor(config)
    second.load_state_dict(json.loads(json.dumps(first.state_dict(), allow_nan=False)))
    got += [json.dumps(e.to_dict()) for rec in recs[split:] for e in second.update(rec)]
    assert got == expected
    assert second.summary() == straight.summary()


def test_state_size_does_not_grow_with_stream_length():
    rng = random.Random(0)
    monitor = StabilityMonitor(CONFIGS[0])
    sizes = {}
    for step in range(20_000):
        g = 1.0 + rng.random() * (5.0 if rng.random() < 0.05 else 0.05)
        monitor.update(StepRecord(step, 2.0 + rng.random(), g, param_norm=1600.0 + step))
        if step in (999, 19_999):
            sizes[step] = leaves(monitor.state_dict())
    assert sizes[999] == sizes[19_999]
    assert monitor.summary()["spikes_total"] > 100  # the stream did exercise the spike path
