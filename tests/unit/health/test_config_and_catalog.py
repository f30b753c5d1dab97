"""The health config section and the check catalog."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from orchestrator.config import ConfigError, load_config
from orchestrator.health import catalog
from orchestrator.health.base import Level
from orchestrator.supervisor.metrics import SupervisorMetrics


def test_levels_and_timeouts() -> None:
    # Check names hold dots: per-check timeouts are set as one mapping.
    cfg = load_config(None, ["health.after_failure=off", 'health.timeouts={"host.disk": 3}'])
    assert cfg.health.level(cfg.health.preflight) is Level.FULL
    assert cfg.health.level(cfg.health.after_failure) is None
    assert cfg.health.timeout_of("host.disk") == 3 and cfg.health.timeout_of("host.memory") == 10
    quick = [c.name for c in catalog.node_checks(Level.QUICK)]
    full = [c.name for c in catalog.node_checks(Level.FULL)]
    assert set(quick) < set(full) and "accelerator.matmul" in set(full) - set(quick)
    assert all(c.fn for c in catalog.CHECKS if c.where == "node")


@pytest.mark.parametrize(("override", "field"), [
    ('health.timeouts={"nope": 3}', "health.timeouts.nope"),
    ('health.timeouts={"host.disk": 0}', "health.timeouts.host.disk"),
    ('health.chaos.hang={"local-0": ["disk"]}', "health.chaos.hang.local-0"),
    ("health.on_insufficient=retry", "health.on_insufficient"),
])
def test_bad_health_settings_name_their_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert field in str(exc.value)


def test_every_check_has_a_failure_series_from_the_start() -> None:
    metrics = SupervisorMetrics(CollectorRegistry(), "j")
    text = generate_latest(metrics.registry).decode()
    for name in catalog.CHECK_NAMES:
        assert f'orchestrator_health_check_failures_total{{check="{name}",job="j"}} 0.0' in text
    metrics.on_event({"kind": "health", "check": "host.disk", "ok": False})
    metrics.on_event({"kind": "health", "check": "host.disk", "ok": True})
    text = generate_latest(metrics.registry).decode()
    assert 'orchestrator_health_check_failures_total{check="host.disk",job="j"} 1.0' in text


def test_health_command_rejects_bad_input_before_starting_anything(tmp_path) -> None:
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", "health", *args,
                               "--run-dir", str(tmp_path / "run")], capture_output=True,
                              text=True, timeout=60, check=False)

    bad_level = run("--level", "thorough")
    assert bad_level.returncode == 2 and "must be quick or full" in bad_level.stderr
    bad_config = run("--set", "health.floors.disk_gib=-1")
    assert bad_config.returncode == 2 and "health.floors.disk_gib" in bad_config.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()
