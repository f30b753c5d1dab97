"""deploy/: the dashboard and rules use only metrics we export; promtool passes the rules and
their tests; compose, provisioning and the systemd unit are consistent."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from monitoring import (
    DEPLOY,
    PROMETHEUS_DIR,
    dashboard,
    dashboard_exprs,
    have_prometheus,
    metric_names,
    recorded_names,
    rule_exprs,
    rules,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.supervisor.metrics import SupervisorMetrics

needs_promtool = pytest.mark.skipif(not have_prometheus(), reason="promtool not installed "
                                    "(.ci/run installs Debian's prometheus package)")


def exported_names() -> set[str]:
    """Every sample name on a supervisor's /metrics (_bucket, _sum, _count, _total, ...),
    those that appear once known (a step, a checkpoint, the job's config) included."""
    metrics = SupervisorMetrics(CollectorRegistry(), "demo")
    metrics.set_info("tiny", "cpu")
    metrics.set_thresholds(3.0)
    metrics.on_event({"kind": "job_created", "ts": 1.0, "steps": 10})
    metrics.on_event({"kind": "checkpoint_committed", "step": 5, "ts": 2.0})
    metrics.on_record({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0,
                       "param_norm": 9.0, "ts": 3.0})
    metrics.on_stability({"running_mean": 1.0, "growth_ratio": 1.0}, [])
    text = generate_latest(metrics.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_promql_name_extraction_sees_metrics_only() -> None:
    expr = ('histogram_quantile(0.95, sum by (le) (rate(a_bucket{job="$job",x=~"y|z"}'
            '[$__rate_interval]))) > 0.1 and on (job) (b == 1) or time() - c:d_1h offset 5m')
    assert metric_names(expr) == {"a_bucket", "b", "c:d_1h"}


def test_every_expression_uses_only_metrics_we_export() -> None:
    allowed = exported_names() | recorded_names() | {"up"}  # up: Prometheus' own
    unknown = {(where, name) for where, expr in dashboard_exprs() + rule_exprs()
               for name in metric_names(expr) - allowed}
    assert not unknown, unknown
    used = {n for _, e in dashboard_exprs() for n in metric_names(e)}
    # What the dashboard must show: each drawn from its metric.
    for name in ("orchestrator_goodput_ratio", "orchestrator_productive_seconds_total",
                 "orchestrator_badput_seconds_total", "orchestrator_steps_processed_total",
                 "orchestrator_tokens_processed_total", "orchestrator_loss",
                 "orchestrator_grad_norm", "orchestrator_grad_norm_running_mean",
                 "orchestrator_grad_norm_spikes_total", "orchestrator_param_norm",
                 "orchestrator_restarts_total", "orchestrator_failures_total",
                 "orchestrator_last_checkpoint_timestamp_seconds",
                 "orchestrator_checkpoint_blocking_seconds_bucket", "orchestrator_nodes"):
        assert name in used, name


def test_dashboard_matches_grafanas_structure() -> None:
    d = dashboard()
    assert isinstance(d["uid"], str) and 0 < len(d["uid"]) <= 40
    assert d["title"] and isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "label_values(orchestrator_job_state, job)" in variables["job"]["query"]["query"]
    known = set(variables) | {"__rate_interval", "__interval", "__range"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and all(isinstance(g[k], int) for k in g)
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        assert p["type"] in ("row", "stat", "timeseries", "bargauge"), p["type"]
        assert p["title"]
        if p["type"] == "row":
            assert p["panels"] == [] and g["h"] == 1
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()
        assert "defaults" in p["fieldConfig"] and "overrides" in p["fieldConfig"]
    for _, expr in dashboard_exprs():
        for var in re.findall(r"\$\{?(\w+)", expr):
            assert var in known, (var, expr)


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    assert [d["type"] for d in ds["datasources"]] == ["prometheus"]
    assert ds["datasources"][0]["url"] == "http://localhost:9090"
    boards = yaml.safe_load((prov / "dashboards" / "orchestrator.yml").read_text())
    assert boards["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_compose_mounts_exist_and_images_are_pinned() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "alertmanager", "grafana"}
    mounts = {}
    for name, svc in services.items():
        image, _, tag = svc["image"].partition(":")
        assert tag and tag != "latest", svc["image"]
        assert svc["network_mode"] == "host"  # the addresses in the configs assume it
        for volume in svc["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source
                mounts[target] = DEPLOY / source
            else:
                assert source in compose["volumes"], source
    assert (mounts["/etc/prometheus"] / "prometheus.yml").exists()
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    assert (mounts["/etc/alertmanager"] / "alertmanager.yml").exists()
    assert (mounts["/etc/grafana/provisioning"] / "datasources").is_dir()
    assert (mounts["/var/lib/grafana/dashboards"] / "orchestrator.json").exists()


def test_alertmanager_routes_to_receivers_that_exist() -> None:
    am = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    receivers = {r["name"] for r in am["receivers"]}
    routes = [am["route"], *am["route"].get("routes", [])]
    assert all(r["receiver"] in receivers for r in routes)
    alerts = {r["alert"] for r in rules() if "alert" in r}
    for inhibit in am.get("inhibit_rules", []):
        for matcher in inhibit["source_matchers"] + inhibit["target_matchers"]:
            name = re.fullmatch(r'alertname=~?"(.+)"', matcher).group(1)
            assert set(name.split("|")) <= alerts, matcher


def test_the_nine_alerts_and_the_goodput_recording_rule_exist() -> None:
    names = {r.get("alert") or r.get("record") for r in rules()}
    assert names == {"OrchestratorTrainingStalled", "OrchestratorLossNotFinite",
                     "OrchestratorGradientSpikePersistent", "OrchestratorGradNormGrowth",
                     "OrchestratorGoodputLow", "OrchestratorRestartStorm",
                     "OrchestratorCheckpointStale", "OrchestratorSupervisorDown",
                     "OrchestratorStraggler", "OrchestratorHeartbeatProcessLost",
                     "job:orchestrator_goodput:ratio_1h"}


@needs_promtool
def test_promtool_checks_config_and_rules() -> None:
    out = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(["promtool", "check", "rules",
                          *map(str, sorted((PROMETHEUS_DIR / "rules").glob("*.yml")))],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_rule_tests_cover_each_alert_firing_and_not() -> None:
    tests = PROMETHEUS_DIR / "tests" / "orchestrator-alerts.test.yml"
    out = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    fired, quiet = set(), set()
    for case in yaml.safe_load(tests.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fired if t["exp_alerts"] else quiet).add(t["alertname"])
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert fired == alerts and quiet == alerts


@needs_promtool
def test_promtool_rule_tests_can_fail(tmp_path: Path) -> None:
    """The rule tests are not vacuous: a threshold moved the wrong way breaks them."""
    shutil.copytree(PROMETHEUS_DIR, tmp_path / "prometheus")
    alerts = tmp_path / "prometheus" / "rules" / "orchestrator-alerts.yml"
    alerts.write_text(alerts.read_text().replace("> 600)", "> 6000)"))
    out = subprocess.run(["promtool", "test", "rules",
                          str(tmp_path / "prometheus" / "tests" / "orchestrator-alerts.test.yml")],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "OrchestratorTrainingStalled" in out.stdout + out.stderr


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = tmp_path / "orchestrator@demo.service"
    unit.write_text((DEPLOY / "systemd" / "orchestrator@.service").read_text())
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    text = unit.read_text()
    assert "KillMode=process" in text and "up --resume" in text
