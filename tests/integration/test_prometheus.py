"""A real Prometheus scraping a real supervisor through a chaos run of the local default.

Prometheus (Debian's package, started here on 127.0.0.1 with deploy/'s scrape config, rules
and file_sd directory, scraping every second) finds the supervisor through the target file
the supervisor writes itself (``metrics.targets_file``). Then, through Prometheus' HTTP API:
every expression of the dashboard and of the rules returns data, the rules evaluate without
error, the injected crash shows in the restarts counter, and the goodput Prometheus holds
agrees with an independent ground truth from the workers' own step timestamps.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from jobs import journal, status, up, wait_for
from monitoring import PROMETHEUS_DIR, ROOT, boolify, dashboard_exprs, have_prometheus, rule_exprs
from monitoring import substitute as grafana_substitute

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not have_prometheus(), reason="prometheus not installed "
                                 "(.ci/run installs Debian's prometheus package)")]

JOB = "local"  # the embedded default's job.name
STEPS, KILL_AT, CKPT_EVERY = 120, 70, 30
LINGER_S = 4.0


@dataclass
class Prometheus:
    url: str
    config_dir: Path
    proc: subprocess.Popen

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def instant(self, expr: str, at: float) -> list[dict[str, Any]]:
        return self.api("query", query=expr, time=f"{at:.3f}")["result"]

    def value(self, expr: str, at: float) -> float:
        result = self.instant(expr, at)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Prometheus:
    root = tmp_path_factory.mktemp("prometheus")
    conf_dir = root / "config"
    shutil.copytree(PROMETHEUS_DIR, conf_dir)
    conf_path = conf_dir / "prometheus.yml"
    conf = yaml.safe_load(conf_path.read_text())
    # Our scrape config as shipped, scraped and evaluated every second, without Alertmanager.
    conf["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    conf.pop("alerting")
    for job in conf["scrape_configs"]:
        job.pop("scrape_interval", None)
    conf_path.write_text(yaml.safe_dump(conf))
    port = _free_port()
    log = open(root / "prometheus.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={conf_path}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", conf_dir, proc)

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            assert proc.poll() is None, (root / "prometheus.log").read_text()[-3000:]
            return False

    wait_for(ready, 60, what="prometheus ready")
    yield prom
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@dataclass
class Run:
    run_dir: Path
    events: list[dict[str, Any]]
    created: float
    ended: float
    status: dict[str, Any]


@pytest.fixture(scope="module")
def chaos_run(prometheus: Prometheus, tmp_path_factory: pytest.TempPathFactory,
              dataset_dir: Path) -> Run:
    """The embedded default job (2 simulated nodes, tiny Llama, gloo), shortened, with a
    rank killed at step KILL_AT."""
    tmp = tmp_path_factory.mktemp("monitored")
    target = prometheus.config_dir / "targets" / f"orchestrator-{JOB}.json"
    sets = {"trainer.steps": STEPS, "checkpoint.interval_steps": CKPT_EVERY,
            "trainer.data.path": str(dataset_dir), "metrics.port": 0,
            "metrics.host": "127.0.0.1", "metrics.targets_file": str(target),
            "metrics.linger_s": LINGER_S, "restart.backoff_initial_s": 0.5}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    result = up(ROOT / "configs" / "local.yaml", tmp / "run", *args,
                "--chaos-kill-at", str(KILL_AT), timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert not target.exists(), "the finished job's scrape target was not withdrawn"
    events = journal(tmp / "run")
    created = next(e["ts"] for e in events if e["kind"] == "job_created")
    ended = next(e["ts"] for e in events if e["kind"] == "transition" and e["to"] == "COMPLETED")
    return Run(tmp / "run", events, created, ended, status(tmp / "run"))


def test_every_dashboard_and_rule_expression_returns_data(prometheus: Prometheus,
                                                          chaos_run: Run) -> None:
    missing = []
    exprs = dashboard_exprs() + rule_exprs()
    for where, expr in exprs:
        # Thresholds made `bool`, so an alert that is (rightly) not firing still has to
        # find every series it reads.
        q = boolify(grafana_substitute(expr, JOB))
        data = prometheus.api("query_range", query=q, start=f"{chaos_run.created:.3f}",
                              end=f"{chaos_run.ended + LINGER_S:.3f}", step="1")
        if not data["result"]:
            missing.append(f"{where}: {q}")
    assert not missing, "no data for:\n" + "\n".join(missing)
    assert len(exprs) > 40


def test_rules_evaluate_without_errors(prometheus: Prometheus, chaos_run: Run) -> None:
    groups = prometheus.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    # Every rule in the shipped files was loaded (ten alerts and the goodput recording rule).
    shipped = [r for f in sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
               for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]
    assert len(rules) == len(shipped) >= 11
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    ratio = prometheus.instant(f'job:orchestrator_goodput:ratio_1h{{job="{JOB}"}}',
                               chaos_run.ended + 2)
    assert len(ratio) == 1 and 0 < float(ratio[0]["value"][1]) < 1


def test_the_injected_restart_shows_in_the_restarts_counter(prometheus: Prometheus,
                                                            chaos_run: Run) -> None:
    at = chaos_run.ended + 2  # within the linger: the final scrape of the finished job
    sel = f'{{job="{JOB}",cause="worker_exit"}}'
    assert prometheus.value(f"orchestrator_restarts_total{sel}", at) == 1
    assert prometheus.value(f"orchestrator_failures_total{sel}", at) == 1
    assert prometheus.value(f'sum(orchestrator_restarts_total{{job="{JOB}"}})', at) == 1
    before = next(e["ts"] for e in chaos_run.events if e["kind"] == "chaos") - 1.0
    assert prometheus.value(f'sum(orchestrator_restarts_total{{job="{JOB}"}})', before) == 0
    assert prometheus.value(f'orchestrator_job_state{{job="{JOB}",state="COMPLETED"}}', at) == 1
    assert prometheus.value(f'orchestrator_training_step{{job="{JOB}"}}', at) == STEPS
    assert [r["cause"] for r in chaos_run.status["restarts"]] == ["worker_exit"]


def test_exported_books_match_the_journals(prometheus: Prometheus, chaos_run: Run) -> None:
    at = chaos_run.ended + 2
    books = chaos_run.status["books"]
    assert prometheus.value(f'orchestrator_goodput_ratio{{job="{JOB}"}}', at) == \
        pytest.approx(books["goodput"], abs=1e-5)
    counters = {r["metric"]["category"]: float(r["value"][1]) for r in prometheus.instant(
        f'orchestrator_badput_seconds_total{{job="{JOB}"}}', at)}
    counters["productive"] = prometheus.value(
        f'orchestrator_productive_seconds_total{{job="{JOB}"}}', at)
    assert set(counters) == set(books["seconds"])
    for category, seconds in books["seconds"].items():
        # Counters never go down: one may stay above its books after a re-booking.
        assert counters[category] >= seconds - 1e-3, category
    over = sum(counters.values()) - books["total_s"]
    assert -1e-3 <= over <= books["seconds"]["wasted_progress"] + 2.0, (counters, books)


def ground_truth_goodput(run: Run) -> float:
    """Productive time from rank 0's own step timestamps, computed the simplest way: each
    step's interval since the previous step of its generation, counted only for the last
    time that step was trained, less the checkpoint and data-loading stalls it reported; a
    generation's first step is start-up. Over wall time from the journal's first to last
    state."""
    records = [json.loads(line) for line in (run.run_dir / "steps.jsonl").read_text()
               .splitlines()]
    final: dict[int, float] = {}
    previous: dict[int, float] = {}  # generation -> ts of its previous record
    for rec in records:
        gen, step = rec["generation"], rec["step"]
        if gen in previous:
            final[step] = (rec["ts"] - previous[gen] - rec.get("ckpt_block_s", 0.0)
                           - rec.get("data_s", 0.0))
        else:
            final.pop(step, None)
        previous[gen] = rec["ts"]
    return sum(final.values()) / (run.ended - run.created)


def test_reported_goodput_agrees_with_the_workers_ground_truth(prometheus: Prometheus,
                                                               chaos_run: Run) -> None:
    truth = ground_truth_goodput(chaos_run)
    reported = prometheus.value(f'orchestrator_goodput_ratio{{job="{JOB}"}}',
                                chaos_run.ended + 2)
    print(f"goodput: reported {reported:.4f}, ground truth {truth:.4f}; books "
          f"{json.dumps(chaos_run.status['books'])}")
    assert abs(reported - truth) <= 0.02
    assert abs(chaos_run.status["goodput"] - truth) <= 0.02
    # The crash cost redone steps: at least those since the checkpoint before it.
    redone = KILL_AT - (KILL_AT // CKPT_EVERY) * CKPT_EVERY
    assert chaos_run.status["books"]["seconds"]["wasted_progress"] > 0
    records = [json.loads(line) for line in
               (chaos_run.run_dir / "steps.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) - len(set(steps)) > 0
    # The second generation went back to the checkpoint before the kill, so it redid the
    # `redone` steps since (rank 0's own last records before a SIGKILL of it can be lost
    # with it: up to a heartbeat's worth, so the count of duplicates is not the measure).
    second = [r["step"] for r in records if r.get("generation") == 2]
    assert second and second[0] == KILL_AT - redone + 1


def test_a_free_port_is_logged_and_written_to_the_run_dir(prometheus: Prometheus,
                                                          chaos_run: Run) -> None:
    info = json.loads((chaos_run.run_dir / "supervisor.json").read_text())
    assert info["port"] > 0 and info["url"].endswith(f":{info['port']}")
    logged = [json.loads(line) for line in (chaos_run.run_dir / "supervisor.log")
              .read_text().splitlines() if "supervisor listening" in line]
    assert logged and logged[0]["metrics"] == f"{info['url']}/metrics"
    # Prometheus scraped it there, found through the target file the supervisor wrote.
    up = prometheus.instant('up{job="orchestrator"}', chaos_run.ended)
    assert [r["metric"]["instance"] for r in up] == [f"127.0.0.1:{info['port']}"]
    assert float(up[0]["value"][1]) == 1
