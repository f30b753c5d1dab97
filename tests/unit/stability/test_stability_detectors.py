"""Detectors over synthetic streams, with the exact events expected."""

from __future__ import annotations

import math

import pytest
from _stability_streams import noise, records, steady_grads

from stability import StabilityConfig, StabilityMonitor, StepRecord
from stability.config import GradSpikeConfig, GrowthConfig, LossSpikeConfig, ParamNormConfig
from stability.detectors import (
    GradSpikeDetector,
    GrowthDetector,
    LossSpikeDetector,
    ParamNormDetector,
)


def run(monitor: StabilityMonitor, recs: list[StepRecord]) -> list:
    return [e for rec in recs for e in monitor.update(rec)]


def kinds(events) -> list[tuple[str, int]]:
    return [(e.kind, e.step) for e in events]


def test_single_step_spike_is_one_spike_of_length_one():
    monitor = StabilityMonitor(StabilityConfig())
    grads = steady_grads(60, s40=2.0)
    events = run(monitor, records(grads))
    assert kinds(events) == [("grad_spike", 40), ("grad_spike_end", 41)]
    onset, end = events
    r = sum(grads[20:40]) / 20
    assert onset.figures["running_mean"] == pytest.approx(r)
    assert onset.figures["threshold"] == pytest.approx(r + 0.1)
    assert onset.figures["grad_norm"] == 2.0
    assert onset.action == "record" and onset.rule == "grad_spike"
    assert end.figures["length"] == 1 and end.figures["onset_step"] == 40
    assert end.action == "record"


def test_three_step_spike_has_length_three():
    monitor = StabilityMonitor(StabilityConfig())
    events = run(monitor, records(steady_grads(60, s40=1.5, s41=1.8, s42=1.3)))
    assert kinds(events) == [("grad_spike", 40), ("grad_spike_end", 43)]
    assert events[1].figures["length"] == 3
    summary = monitor.summary()
    assert summary["spike_length_histogram"]["3"] == 1
    assert summary["spikes_total"] == 1 and summary["longest_spike"] == 3


def test_threshold_is_strict_and_return_to_threshold_ends_the_spike():
    config = GradSpikeConfig(window=2, margin=0.5)
    det = GradSpikeDetector(config)
    out = [det.update(StepRecord(i, 1.0, g)) for i, g in enumerate([1.0, 1.0, 1.5, 2.0, 1.5])]
    assert out[2] == []  # 1.5 is not above 1.0 + 0.5
    assert [e.kind for e in out[3]] == ["grad_spike"]
    assert [e.kind for e in out[4]] == ["grad_spike_end"]  # back at (not below) the threshold


def test_no_spike_until_window_is_full():
    det = GradSpikeDetector(GradSpikeConfig(window=20), warmup_steps=0)
    grads = steady_grads(40, s5=5.0, s19=5.0, s20=5.0)
    out = [e for i, g in enumerate(grads) for e in det.update(StepRecord(i, 2.0, g))]
    # Steps 0..19 see fewer than 20 values (r undefined): the 5.0s at steps 5 and 19 are not
    # spikes and enter the window. Step 20 is the first measured, against a mean including them.
    assert kinds(out) == [("grad_spike", 20), ("grad_spike_end", 21)]
    assert out[0].figures["running_mean"] == pytest.approx(sum(grads[:20]) / 20)


def test_nothing_fires_during_warmup_but_statistics_accumulate():
    config = StabilityConfig(warmup_steps=20, grad_spike=GradSpikeConfig(window=5))
    monitor = StabilityMonitor(config)
    grads = steady_grads(20, s8=9.0, s9=9.0, s10=9.0, s11=9.0, s12=9.0, s17=4.0)
    recs = records(grads)
    recs[12] = StepRecord(12, 40.0, 9.0, param_norm=100.0)
    recs[13] = StepRecord(13, 2.0, grads[13], param_norm=500.0)
    assert run(monitor, recs) == []
    # Every warm-up value entered the window, the 4.0 at step 17 included.
    assert monitor.summary()["running_mean"] == pytest.approx(sum(grads[15:20]) / 5)
    assert monitor.summary()["current_spike_length"] == 0


def test_nonfinite_loss_fires_immediately_even_during_warmup():
    monitor = StabilityMonitor(StabilityConfig(warmup_steps=20))
    recs = records(steady_grads(10))
    recs[3] = StepRecord(3, math.nan, 1.0)
    recs[5] = StepRecord(5, 2.0, math.inf)
    events = run(monitor, recs)
    assert kinds(events) == [("nonfinite", 3), ("nonfinite", 5)]
    assert events[0].action == "rollback" and events[0].rule == "loss.nonfinite"
    assert events[0].to_dict()["loss"] == "nan"
    assert events[1].to_dict()["grad_norm"] == "inf"


def test_nonfinite_grad_norm_does_not_poison_the_window():
    monitor = StabilityMonitor(StabilityConfig())
    grads = steady_grads(60, s40=2.0)
    grads[30] = math.nan
    events = [e for e in run(monitor, records(grads)) if e.kind != "nonfinite"]
    assert kinds(events) == [("grad_spike", 40), ("grad_spike_end", 41)]


def test_persistent_spike_fires_once_at_length_n():
    monitor = StabilityMonitor(StabilityConfig.model_validate(
        {"persistent_spike": {"action": "rollback"}}))
    grads = steady_grads(70, **{f"s{s}": 1.6 for s in range(40, 48)})
    events = run(monitor, records(grads))
    assert kinds(events) == [
        ("grad_spike", 40),
        ("persistent_spike", 44),
        ("grad_spike_end", 48),
    ]
    persistent = events[1]
    assert persistent.action == "rollback"
    assert persistent.figures["length"] == 5 and persistent.figures["onset_step"] == 40
    assert events[2].figures["length"] == 8


def test_spikes_kept_out_of_the_mean_measure_the_full_length():
    # A 20-step plateau 0.3 above the base: with spikes in the mean, r climbs towards the
    # plateau and the spike is declared over after 14 steps, while g is still 0.3 up.
    grads = steady_grads(90, **{f"s{s}": 1.3 for s in range(40, 60)})
    lengths = {}
    for include in (False, True):
        config = StabilityConfig(grad_spike=GradSpikeConfig(include_spikes_in_mean=include))
        ends = [e for e in run(StabilityMonitor(config), records(grads)) if e.kind.endswith("end")]
        lengths[include] = ends[0].figures["length"]
    assert lengths == {False: 20, True: 14}


def test_relative_mode():
    config = GradSpikeConfig(mode="relative", rel_margin=0.5, window=10)
    det = GradSpikeDetector(config)
    out = []
    for i, g in enumerate(steady_grads(30, base=2.0, s20=2.9, s25=3.2)):
        out += det.update(StepRecord(i, 1.0, g))
    # r ~ 2.002: 2.9 < r * 1.5 ~ 3.003 < 3.2
    assert kinds(out) == [("grad_spike", 25), ("grad_spike_end", 26)]
    assert out[0].figures["threshold"] == pytest.approx(out[0].figures["running_mean"] * 1.5)


def test_zscore_mode():
    config = GradSpikeConfig(mode="zscore", zscore_k=3.0, window=20)
    det = GradSpikeDetector(config)
    grads = steady_grads(40, s30=1.1)  # noise std ~0.0014: 1.1 is ~70 std out
    out = [e for i, g in enumerate(grads) for e in det.update(StepRecord(i, 1.0, g))]
    assert kinds(out) == [("grad_spike", 30), ("grad_spike_end", 31)]
    f = out[0].figures
    assert f["threshold"] == pytest.approx(f["running_mean"] + 3.0 * f["std"])
    window = grads[10:30]
    mean = sum(window) / 20
    std = math.sqrt(sum((x - mean) ** 2 for x in window) / 20)
    assert f["std"] == pytest.approx(std)


def test_slow_ramp_to_three_and_a_half_times_warns_once():
    grads = [1.0 + noise(i) for i in range(30)]
    grads += [1.0 + 2.5 * i / 300 + noise(i) for i in range(300)]
    grads += [3.5 + noise(i) for i in range(50)]
    events = run(StabilityMonitor(StabilityConfig()), records(grads))
    growth = [e for e in events if e.kind == "growth"]
    assert len(growth) == 1
    first_over = next(i for i, g in enumerate(grads) if i >= 20 and g / 1.0 > 3.0)
    assert growth[0].step == first_over
    assert growth[0].figures["lowest"] == 1.0
    assert growth[0].figures["ratio"] > 3.0


def test_growth_rearms_only_after_falling_back():
    det = GrowthDetector(GrowthConfig(ratio=3.0, rearm_fraction=0.9))
    series = [1.0, 3.1, 2.95, 3.05, 2.8, 3.2, 1.0, 3.3]
    out = [e for i, g in enumerate(series) for e in det.update(StepRecord(i, 1.0, g))]
    # 2.95 does not re-arm (above 2.7), 2.8 does not either; 1.0 does.
    assert kinds(out) == [("growth", 1), ("growth", 7)]


def test_growth_lowest_is_taken_after_warmup():
    det = GrowthDetector(GrowthConfig(), warmup_steps=5)
    series = [0.1, 0.1, 0.1, 0.1, 0.1, 1.0, 1.1, 2.0]
    out = [e for i, g in enumerate(series) for e in det.update(StepRecord(i, 1.0, g))]
    assert out == []
    assert det.summary()["lowest_grad_norm"] == 1.0


def test_param_norm_jump():
    det = ParamNormDetector(ParamNormConfig(jump_ratio=1.5))
    norms = [1600.0, None, 1610.0, 1200.0, None, 2500.0, 2510.0]
    out = []
    for i, p in enumerate(norms):
        out += det.update(StepRecord(i, 2.0, 1.0, param_norm=p))
    # 1610 -> 1200 is a drop (not flagged); 1200 -> 2500 across a skipped record jumps 2.08x.
    assert kinds(out) == [("param_norm_jump", 5)]
    assert out[0].figures == {"param_norm": 2500.0, "previous": 1200.0, "ratio": 2500 / 1200}


def test_loss_spike_one_event_per_run():
    det = LossSpikeDetector(LossSpikeConfig(window=20, zscore_k=6.0))
    losses = [2.0 + noise(i, 0.01) for i in range(60)]
    losses[30] = losses[31] = 3.0
    out = [e for i, x in enumerate(losses) for e in det.update(StepRecord(i, x))]
    assert kinds(out) == [("loss_spike", 30)]
    f = out[0].figures
    assert f["threshold"] == pytest.approx(f["running_mean"] + 6.0 * f["std"])


def test_loss_spike_ratio_criterion():
    det = LossSpikeDetector(LossSpikeConfig(window=5, zscore_k=None, ratio=1.2))
    losses = [2.0, 2.0, 2.0, 2.0, 2.0, 2.3, 2.5, 2.0]
    out = [e for i, x in enumerate(losses) for e in det.update(StepRecord(i, x))]
    assert kinds(out) == [("loss_spike", 6)]
    # 2.3 (1.15x) stays under the bar and enters the window: mean 2.06 by step 6.
    assert out[0].figures["threshold"] == pytest.approx(2.06 * 1.2)


def test_histogram_counts_and_overflow_bucket():
    spikes = {40: 1, 50: 1, 60: 2, 70: 12}
    grads = steady_grads(120)
    for start, length in spikes.items():
        for s in range(start, start + length):
            grads[s] = 1.5
    config = StabilityConfig(grad_spike=GradSpikeConfig(histogram_max_length=10))
    monitor = StabilityMonitor(config)
    run(monitor, records(grads))
    summary = monitor.summary()
    hist = summary["spike_length_histogram"]
    assert hist["1"] == 2 and hist["2"] == 1 and hist[">10"] == 1
    assert sum(hist.values()) == 4
    assert summary["spikes_total"] == 4 and summary["longest_spike"] == 12


def test_histogram_saved_under_another_k_folds_into_the_overflow_bucket():
    grads = steady_grads(120)
    for s in [*range(40, 43), *range(60, 72)]:
        grads[s] = 1.5
    det = GradSpikeDetector(GradSpikeConfig(histogram_max_length=10))
    for i, g in enumerate(grads):
        det.update(StepRecord(i, 2.0, g))
    assert det.histogram()["3"] == 1 and det.histogram()[">10"] == 1
    smaller = GradSpikeDetector(GradSpikeConfig(histogram_max_length=2))
    smaller.load_state_dict(det.state_dict())
    assert smaller.histogram() == {"1": 0, "2": 0, ">2": 2}
