"""/metrics as Prometheus reads it: names, types, labels, every series there from the start."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import __version__
from orchestrator.journal.books import BADPUT_CATEGORIES
from orchestrator.health.catalog import CHECK_NAMES
from orchestrator.contracts.state import JobState, NodeState
from orchestrator.supervisor.metrics import (
    FAILURE_CAUSES,
    HEARTBEAT_DOORS,
    STABILITY_KINDS,
    STRAGGLER_ACTIONS,
    SupervisorMetrics,
)

# name (family, as the parser reports it) -> (type, labels besides job, label values)
SPEC: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    # The info metric; the text format has no info type, so it reads as a gauge of 1.
    "orchestrator_info": ("gauge", {}),
    "orchestrator_job_state": ("gauge", {"state": tuple(s.value for s in JobState)}),
    "orchestrator_nodes": ("gauge", {"state": tuple(s.value for s in NodeState)}),
    "orchestrator_restarts": ("counter", {"cause": FAILURE_CAUSES}),
    "orchestrator_failures": ("counter", {"cause": FAILURE_CAUSES}),
    "orchestrator_productive_seconds": ("counter", {}),
    "orchestrator_badput_seconds": ("counter", {"category": BADPUT_CATEGORIES}),
    "orchestrator_goodput_ratio": ("gauge", {}),
    "orchestrator_training_step": ("gauge", {}),
    "orchestrator_training_tokens": ("gauge", {}),
    "orchestrator_steps_processed": ("counter", {}),
    "orchestrator_tokens_processed": ("counter", {}),
    "orchestrator_nonfinite_steps": ("counter", {}),
    "orchestrator_loss": ("gauge", {}),
    "orchestrator_learning_rate": ("gauge", {}),
    "orchestrator_grad_norm": ("gauge", {}),
    "orchestrator_grad_norm_running_mean": ("gauge", {}),
    "orchestrator_grad_norm_spikes": ("counter", {}),
    "orchestrator_grad_norm_spike_length_steps": ("gauge", {}),
    "orchestrator_grad_norm_growth_ratio": ("gauge", {}),
    "orchestrator_param_norm": ("gauge", {}),
    "orchestrator_stability_events": ("counter", {"kind": STABILITY_KINDS}),
    "orchestrator_rollbacks": ("counter", {}),
    "orchestrator_step_duration_seconds": ("histogram", {}),
    "orchestrator_checkpoint_blocking_seconds": ("histogram", {}),
    "orchestrator_last_checkpoint_step": ("gauge", {}),
    "orchestrator_checkpoint_memory_bytes": ("gauge", {}),
    "orchestrator_checkpoint_memory_budget_bytes": ("gauge", {}),
    "orchestrator_last_checkpoint_timestamp_seconds": ("gauge", {}),
    "orchestrator_last_step_timestamp_seconds": ("gauge", {}),
    "orchestrator_job_created_timestamp_seconds": ("gauge", {}),
    "orchestrator_training_steps_target": ("gauge", {}),
    "orchestrator_stability_growth_ratio_threshold": ("gauge", {}),
    "orchestrator_checkpoint_failures": ("counter", {"stage": ("save", "upload")}),
    # One series per check of the health-check catalog.
    "orchestrator_health_check_failures": ("counter", {"check": CHECK_NAMES}),
    "orchestrator_supervisor_late_seconds": ("counter", {}),
    # Stragglers (orchestrator.supervisor.generation.stragglers): named now, and events by action.
    "orchestrator_straggler_nodes": ("gauge", {}),
    "orchestrator_straggler_ranks": ("gauge", {}),
    "orchestrator_straggler_excess_seconds": ("gauge", {}),
    "orchestrator_straggler_events": ("counter", {"action": STRAGGLER_ACTIONS}),
    # Heartbeats by door (the API's port, or the heartbeat process), and that process.
    "orchestrator_heartbeats": ("counter", {"door": HEARTBEAT_DOORS}),
    "orchestrator_heartbeat_process_up": ("gauge", {}),
}


# Absent until known (a first step, a first checkpoint, the job's config): a 0.0 loss or a
# checkpoint at the epoch (a "last checkpoint age" of 56 years) is never exported.
UNTIL_KNOWN = {"orchestrator_loss", "orchestrator_learning_rate", "orchestrator_grad_norm",
               "orchestrator_grad_norm_running_mean", "orchestrator_grad_norm_growth_ratio",
               "orchestrator_param_norm", "orchestrator_last_checkpoint_step",
               "orchestrator_last_checkpoint_timestamp_seconds",
               "orchestrator_last_step_timestamp_seconds",
               "orchestrator_job_created_timestamp_seconds",
               "orchestrator_training_steps_target",
               "orchestrator_stability_growth_ratio_threshold"}


def families(metrics: SupervisorMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


@pytest.fixture
def metrics() -> SupervisorMetrics:
    m = SupervisorMetrics(CollectorRegistry(), "demo")
    m.set_info("tiny", "cpu")
    return m


def test_names_types_and_labels_are_as_specified(metrics: SupervisorMetrics) -> None:
    fams = families(metrics)
    assert set(fams) == set(SPEC)
    for name, (kind, labels) in SPEC.items():
        fam = fams[name]
        assert fam.type == kind, name
        assert fam.documentation, name
        for sample in fam.samples:
            assert sample.name.startswith("orchestrator_")
            if kind == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            assert sample.labels["job"] == "demo"
            extra = set(sample.labels) - {"job", "le"}
            if name == "orchestrator_info":
                assert sample.value == 1
                assert extra == {"model", "accelerator", "version"}, sample.labels
                assert sample.labels["version"] == __version__
            else:
                assert extra == set(labels), (name, sample.labels)
        for label, values in labels.items():
            # Every value of every bounded label is there before its first event.
            assert {s.labels[label] for s in fam.samples} == set(values), name
        if name in UNTIL_KNOWN:
            assert not fam.samples, f"{name} exported before it is known"
        elif not labels or any(labels.values()):
            assert fam.samples, f"{name} has no series at start-up"


def test_job_state_is_one_hot_and_follows_transitions(metrics: SupervisorMetrics) -> None:
    def hot() -> list[str]:
        fam = families(metrics)["orchestrator_job_state"]
        return [s.labels["state"] for s in fam.samples if s.value == 1]

    assert hot() == ["PENDING"]
    metrics.on_event({"kind": "transition", "to": "RUNNING"})
    assert hot() == ["RUNNING"]
    fam = families(metrics)["orchestrator_job_state"]
    assert sum(s.value for s in fam.samples) == 1


def test_records_and_events_move_their_metrics(metrics: SupervisorMetrics) -> None:
    metrics.on_event({"kind": "job_created", "ts": 1234.5})
    metrics.on_event({"kind": "generation_launched", "generation": 2, "after_cause": "hang"})
    metrics.on_event({"kind": "failure", "cause": "hang"})
    metrics.on_event({"kind": "checkpoint_committed", "step": 50, "ts": 2000.0,
                      "blocking_s": 0.07})
    metrics.on_event({"kind": "memory_tier", "step": 50, "bytes": 10, "node_bytes": 40,
                      "node_budget_bytes": 4096, "partner": True, "ts": 2001.0})
    for step, tokens in ((1, 512), (2, 1024), (3, 1536), (2, 1024), (3, 1536)):  # a resume
        metrics.on_record({"step": step, "tokens": tokens, "loss": 2.5, "lr": 1e-3,
                           "grad_norm": 0.7, "step_time": 0.2, "ts": 3000.0 + step})
    metrics.on_record({"step": 4, "tokens": 2048, "loss": float("nan"),
                       "grad_norm": float("inf"), "step_time": 0.2, "ts": 3004.0})
    metrics.on_stability({"running_mean": 0.6, "growth_ratio": 1.4,
                          "current_spike_length": 2},
                         [{"kind": "grad_spike"}, {"kind": "persistent_spike"}])
    fams = families(metrics)

    def val(name: str, sample: str | None = None, **labels: str) -> float:
        for s in fams[name].samples:
            if s.name == (sample or s.name) and all(s.labels.get(k) == v
                                                     for k, v in labels.items()):
                return s.value
        raise AssertionError((name, labels))

    assert val("orchestrator_job_created_timestamp_seconds") == 1234.5
    assert val("orchestrator_restarts", cause="hang") == 1
    assert val("orchestrator_restarts", cause="worker_exit") == 0
    assert val("orchestrator_failures", cause="hang") == 1
    assert val("orchestrator_last_checkpoint_step") == 50
    assert val("orchestrator_last_checkpoint_timestamp_seconds") == 2000.0
    assert val("orchestrator_checkpoint_memory_bytes") == 40
    assert val("orchestrator_checkpoint_memory_budget_bytes") == 4096
    assert val("orchestrator_checkpoint_blocking_seconds",
               "orchestrator_checkpoint_blocking_seconds_bucket", le="0.1") == 1
    assert val("orchestrator_training_step") == 4
    assert val("orchestrator_steps_processed") == 6
    assert val("orchestrator_tokens_processed") == 512 * 6  # redone steps counted again
    assert val("orchestrator_step_duration_seconds",
               "orchestrator_step_duration_seconds_count") == 6
    assert math.isnan(val("orchestrator_loss"))
    assert val("orchestrator_grad_norm") == math.inf
    assert val("orchestrator_nonfinite_steps") == 1
    assert val("orchestrator_last_step_timestamp_seconds") == 3004.0
    assert val("orchestrator_grad_norm_running_mean") == 0.6
    assert val("orchestrator_grad_norm_growth_ratio") == 1.4
    assert val("orchestrator_grad_norm_spike_length_steps") == 2
    assert val("orchestrator_grad_norm_spikes") == 1
    assert val("orchestrator_stability_events", kind="persistent_spike") == 1


def test_two_supervisors_in_one_process_do_not_share_a_registry() -> None:
    a = SupervisorMetrics(CollectorRegistry(), "a")
    b = SupervisorMetrics(CollectorRegistry(), "b")
    a.on_record({"step": 7})
    assert b.registry.get_sample_value("orchestrator_training_step", {"job": "b"}) == 0


def test_figures_appear_when_known_and_failed_saves_count_once(
        metrics: SupervisorMetrics) -> None:
    def val(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"job": "demo", **labels})

    metrics.on_event({"kind": "job_created", "ts": 10.0, "steps": 600})
    metrics.set_thresholds(20.0)
    assert val("orchestrator_training_steps_target") == 600
    assert val("orchestrator_stability_growth_ratio_threshold") == 20.0
    assert val("orchestrator_loss") is None and val("orchestrator_learning_rate") is None
    metrics.on_record({"step": 1, "loss": 3.25, "lr": 1e-4, "grad_norm": 2.0, "ts": 11.0})
    assert (val("orchestrator_loss"), val("orchestrator_learning_rate"),
            val("orchestrator_grad_norm")) == (3.25, 1e-4, 2.0)
    assert val("orchestrator_param_norm") is None  # not in that record: still not known
    assert val("orchestrator_last_checkpoint_timestamp_seconds") is None
    # Every rank of a save reports the same failure: one failed save.
    for rank in (0, 1, 0):
        metrics.on_event({"kind": "checkpoint_failed", "generation": 1, "rank": rank,
                          "step": 50, "ts": 12.0})
    metrics.on_event({"kind": "checkpoint_failed", "generation": 1, "step": 60, "ts": 13.0})
    metrics.on_event({"kind": "checkpoint_upload_failed", "generation": 1, "step": 60,
                      "ts": 14.0})
    assert val("orchestrator_checkpoint_failures_total", stage="save") == 2
    assert val("orchestrator_checkpoint_failures_total", stage="upload") == 1
    # A script of the user's own has no step total: no target is exported for it.
    other = SupervisorMetrics(CollectorRegistry(), "demo")
    other.on_event({"kind": "job_created", "ts": 10.0, "steps": 0})
    other.set_thresholds(None)
    assert other.registry.get_sample_value("orchestrator_training_steps_target",
                                           {"job": "demo"}) is None
