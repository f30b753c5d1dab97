"""The stability config section: defaults from the study, loud and precise rejections."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from stability import StabilityConfig


def test_defaults_are_the_study_rules():
    c = StabilityConfig()
    assert c.warmup_steps == 20
    g = c.grad_spike
    assert (g.enabled, g.mode, g.window, g.margin) == (True, "absolute", 20, 0.1)
    assert g.action == "record"
    assert g.zscore_k == 3.0 and g.include_spikes_in_mean is False
    assert (c.growth.ratio, c.growth.action) == (3.0, "record")
    assert (c.persistent_spike.length, c.persistent_spike.action) == (5, "record")
    assert c.loss.nonfinite.action == "rollback"
    assert (c.loss.spike.zscore_k, c.loss.spike.action) == (6.0, "record")
    assert (c.param_norm.jump_ratio, c.param_norm.action) == (1.5, "record")
    r = c.rollback
    assert (r.skip_batches, r.lr_scale, r.max_rollbacks, r.window_steps) == (50, 1.0, 3, 1000)


def _all_fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield prefix + name, field
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _all_fields(annotation, f"{prefix}{name}.")


def test_every_field_has_a_description():
    missing = [name for name, field in _all_fields(StabilityConfig) if not field.description]
    assert missing == []


def test_the_spike_decision_is_documented_in_the_field():
    description = StabilityConfig.model_fields["grad_spike"].annotation.model_fields[
        "include_spikes_in_mean"
    ].description
    assert "hide" in description


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"grad_spike": {"window": 1}}, "grad_spike.window"),
        ({"grad_spike": {"margin": -0.1}}, "grad_spike.margin"),
        ({"grad_spike": {"rel_margin": -1}}, "grad_spike.rel_margin"),
        ({"grad_spike": {"margin": float("nan")}}, "grad_spike.margin"),
        ({"grad_spike": {"mode": "median"}}, "grad_spike.mode"),
        ({"loss": {"spike": {"window": 0}}}, "loss.spike.window"),
        ({"growth": {"ratio": 0.5}}, "growth.ratio"),
        ({"param_norm": {"jump_ratio": 1.0}}, "param_norm.jump_ratio"),
        ({"persistent_spike": {"action": "panic"}}, "persistent_spike.action"),
        ({"rollback": {"lr_scale": 0}}, "rollback.lr_scale"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"grad_spike": {"windw": 20}}, "grad_spike.windw"),
    ],
)
def test_bad_values_are_rejected_naming_the_dotted_field(data, field):
    with pytest.raises(ValidationError) as info:
        StabilityConfig.model_validate(data)
    assert field in str(info.value)


def test_cross_field_problems_are_collected_into_one_error():
    data = {"loss": {"spike": {"zscore_k": None}}, "rollback": {"max_rollbacks": 0},
            "persistent_spike": {"action": "rollback"}}
    with pytest.raises(ValidationError) as info:
        StabilityConfig.model_validate(data)
    message = str(info.value)
    assert "loss.spike.zscore_k / loss.spike.ratio" in message
    assert "persistent_spike.action" in message and "loss.nonfinite.action" in message


def test_rule_actions_lists_enabled_rules_only():
    c = StabilityConfig.model_validate({"growth": {"enabled": False}})
    assert c.rule_actions() == {
        "grad_spike": "record",
        "persistent_spike": "record",
        "loss.nonfinite": "rollback",
        "loss.spike": "record",
        "param_norm": "record",
    }
