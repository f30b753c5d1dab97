"""StepRecord and Event: tolerant parsing, strict JSON output, round trips."""

from __future__ import annotations

import json
import math

import pytest

from stability import Event, StepRecord


def test_from_dict_tolerates_missing_and_extra_keys():
    rec = StepRecord.from_dict({"step": 7, "loss": 2.5, "mfu": 0.4, "grad_norm": None})
    assert rec == StepRecord(step=7, loss=2.5)


def test_from_dict_reads_every_field():
    data = {
        "step": 3.0,
        "loss": 1,
        "grad_norm": 0.5,
        "param_norm": 1600,
        "lr": 3e-4,
        "tokens": 4096,
        "step_time": 0.25,
    }
    rec = StepRecord.from_dict(data)
    assert rec == StepRecord(3, 1.0, 0.5, 1600.0, 3e-4, 4096, 0.25)
    assert isinstance(rec.step, int) and isinstance(rec.loss, float)


@pytest.mark.parametrize(
    ("given", "check"),
    [
        ("nan", math.isnan),
        ("NaN", math.isnan),
        ("inf", lambda x: x == math.inf),
        ("Infinity", lambda x: x == math.inf),
        ("-inf", lambda x: x == -math.inf),
        (math.nan, math.isnan),
        (-math.inf, lambda x: x == -math.inf),
    ],
)
def test_from_dict_reads_non_finite_values(given, check):
    rec = StepRecord.from_dict({"step": 1, "loss": given, "grad_norm": given})
    assert check(rec.loss) and check(rec.grad_norm)


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"loss": 1.0}, "step"),
        ({"step": 1}, "loss"),
        ({"step": 1.5, "loss": 1.0}, "step"),
        ({"step": 1, "loss": "high"}, "loss"),
        ({"step": 1, "loss": True}, "loss"),
        ({"step": 1, "loss": 1.0, "grad_norm": [1]}, "grad_norm"),
        ({"step": 1, "loss": 1.0, "tokens": 2.5}, "tokens"),
        ({"step": 1, "loss": 10**400}, "loss"),
    ],
)
def test_from_dict_errors_name_the_key(data, names):
    with pytest.raises(ValueError, match=names):
        StepRecord.from_dict(data)


def test_record_to_dict_round_trips_and_is_strict_json():
    rec = StepRecord(5, math.nan, math.inf, None, 1e-4, 10, None)
    data = rec.to_dict()
    assert data == {"step": 5, "loss": "nan", "grad_norm": "inf", "lr": 1e-4, "tokens": 10}
    back = StepRecord.from_dict(json.loads(json.dumps(data, allow_nan=False)))
    assert math.isnan(back.loss) and back.grad_norm == math.inf and back.tokens == 10


def test_event_to_dict_flattens_figures_and_encodes_non_finite():
    event = Event("nonfinite", 9, "loss.nonfinite", "rollback", {"loss": math.nan, "n": 3})
    data = event.to_dict()
    assert data == {
        "kind": "nonfinite",
        "step": 9,
        "rule": "loss.nonfinite",
        "action": "rollback",
        "loss": "nan",
        "n": 3,
    }
    json.dumps(data, allow_nan=False)
    back = Event.from_dict(data)
    assert math.isnan(back.figures["loss"]) and back.figures["n"] == 3
    assert back.kind == "nonfinite" and back.step == 9


def test_event_figures_are_copied_and_may_not_shadow_reserved_keys():
    figures = {"ratio": -math.inf}
    event = Event("growth", 1, "growth", "record", figures)
    figures["ratio"] = 0.0
    assert event.to_dict()["ratio"] == "-inf"
    with pytest.raises(ValueError, match="reserved"):
        Event("growth", 1, "growth", "record", {"step": 2})
