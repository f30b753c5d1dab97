"""Health checks with real agents: bad nodes out before launch, a slow link named, hangs cut."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import env, journal, kill_run, status, up, wait_for, write_config

pytestmark = pytest.mark.slow


def test_bad_node_is_excluded_before_launch_and_the_spare_runs(tmp_path: Path,
                                                               dataset_dir: Path) -> None:
    # local-1's scratch directory is broken: a file sits where its directory should be
    # (a real failure that root cannot write through either).
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "local-1").write_text("not a directory")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, cluster={"spares": 1},
                       health={"preflight": "quick",
                               "scratch_dir": str(scratch / "{node_id}")},
                       chaos={"kill": [{"step": 12, "rank": 1}]})
    run = tmp_path / "run"
    result = up(cfg, run)
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(run)
    excluded = [e for e in events if e["kind"] == "node_state" and e["state"] == "excluded"]
    assert [e["node_id"] for e in excluded] == ["local-1"]
    assert "host.disk" in excluded[0]["reason"] and "local-1" in excluded[0]["reason"]
    assert "not writable" in excluded[0]["reason"]
    # The spare holds node rank 1 from the start: local-1 never runs a rank.
    launches = [e for e in events if e["kind"] == "generation_launched"]
    assert launches[0]["nodes"] == {"local-0": 0, "local-2": 1}
    assert launches[0]["spares"] == [] and len(launches) == 2
    # Preflight checked local-0 and local-2 before the first launch, and local-1 too unless
    # its agent registered after those two were healthy (the job launches once its world's
    # nodes are; CI saw it register after the launch under load). After the kill, one
    # quick round checked the two left.
    first_launch = next(i for i, e in enumerate(events) if e["kind"] == "generation_launched")
    registered = {e["node_id"]: i for i, e in enumerate(events) if e["kind"] == "node_registered"}
    rounds = [e for e in events if e["kind"] == "health_round"]
    pre = [e for e in events[:first_launch] if e["kind"] == "health_round"]
    post = [e for e in events[first_launch:] if e["kind"] == "health_round"]
    pre_nodes = sorted(n for r in pre for n in r["nodes"])
    if registered["local-1"] < first_launch:
        assert pre_nodes == ["local-0", "local-1", "local-2"]
        assert events.index(excluded[0]) < first_launch
        assert [sorted(r["nodes"]) for r in post] == [["local-0", "local-2"]]
    else:  # checked in the next round, on its own or with the two after the kill
        assert pre_nodes == ["local-0", "local-2"]
        assert len([r for r in post if "local-1" in r["nodes"]]) == 1
        assert len([r for r in post if {"local-0", "local-2"} <= set(r["nodes"])]) == 1
    assert {n: c for r in rounds for n, c in r["failed"].items()} == {"local-1": ["host.disk"]}
    assert {r["level"] for r in rounds} == {"quick"}
    health = [e for e in events if e["kind"] == "health"]
    assert {(e["node_id"], e["check"]) for e in health if not e["ok"]} == {("local-1",
                                                                             "host.disk")}
    assert all({"node_id", "check", "ok", "severity", "message", "duration_s", "level"} <= e.keys()
               for e in health)
    st = status(run)
    assert st["state"] == "COMPLETED" and st["nodes"]["local-1"]["state"] == "excluded"


def test_too_few_healthy_nodes_fail_the_job_naming_each_and_why(tmp_path: Path,
                                                                dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       health={"preflight": "quick",
                               "chaos": {"fail": {"local-1": ["storage.checkpoint"]}}})
    run = tmp_path / "run"
    result = up(cfg, run)
    assert result.returncode == 1, result.stdout[-4000:]
    events = journal(run)
    assert not any(e["kind"] == "generation_launched" for e in events)
    final = [e for e in events if e["kind"] == "transition"][-1]
    assert final["to"] == "FAILED" and final["cause"] == "health_check"
    reason = final["reason"]
    assert "1 healthy node(s) of the 2" in reason
    assert "local-1 (storage.checkpoint: forced to fail" in reason
    assert "local-0" not in reason
    assert "failed because" in result.stdout and "local-1" in result.stdout


def _health(tmp_path: Path, cfg: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "health", str(cfg), "--json",
                           "--run-dir", str(tmp_path / "run"), *args], capture_output=True,
                          text=True, env=env(), timeout=300, check=False)
    return proc, json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}


def test_health_command_names_the_slow_node_and_cuts_a_hung_check(tmp_path: Path,
                                                                  dataset_dir: Path) -> None:
    # Three nodes (two and a spare): a ring of three links tells which node is slow.
    # local-1's ranks add 50 ms to every timed transfer; a check on local-0 hangs.
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, cluster={"spares": 1},
                       health={"network": {"allreduce_mib": 8, "pairwise_mib": 4, "iters": 4},
                               "chaos": {"slow_network": {"local-1": 0.05},
                                         "hang": {"local-0": ["neuron.compile_cache"]}},
                               "timeouts": {"neuron.compile_cache": 2}})
    start = time.monotonic()
    proc, report = _health(tmp_path, cfg, "--level", "full")
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["level"] == "full"
    assert report["nodes"]["local-1"] == {"ok": False, "fatal": ["network.pairwise"],
                                          "warn": []}
    assert report["nodes"]["local-0"] == {"ok": True, "fatal": [],
                                          "warn": ["neuron.compile_cache"]}
    assert report["nodes"]["local-2"]["ok"] is True
    by = {(r["node_id"], r["check"]): r for r in report["results"]}
    slow = by[("local-1", "network.pairwise")]
    assert "every link of this node is slow" in slow["message"]
    links = slow["details"]["links"]
    assert set(links) == {"local-0", "local-2"}
    fast = by[("local-0", "network.pairwise")]["details"]["links"]["local-2"]
    assert max(links.values()) < 0.5 * fast
    for node in ("local-0", "local-1", "local-2"):
        ar = by[(node, "network.allreduce")]
        assert ar["ok"] and ar["details"]["busbw_gbps"] > 0 and ar["details"]["world_size"] == 3
    # The hung check was cut at its 2 s timeout; the checks after it still ran.
    hung = by[("local-0", "neuron.compile_cache")]
    assert not hung["ok"] and "timed out after 2 s" in hung["message"]
    assert 2.0 <= hung["duration_s"] < 3.0
    assert by[("local-0", "host.disk")]["ok"] and by[("local-0", "storage.checkpoint")]["ok"]
    assert elapsed < 120
    # Agents were told to exit: the run ended, nobody is left behind.
    events = journal(tmp_path / "run")
    assert [e["to"] for e in events if e["kind"] == "transition"][-1] == "STOPPED"


def test_health_command_on_two_healthy_nodes_measures_the_network(tmp_path: Path,
                                                                  dataset_dir: Path) -> None:
    # No --level: the command runs the config's preflight level.
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       health={"preflight": "full",
                               "network": {"allreduce_mib": 8, "pairwise_mib": 4}})
    proc, report = _health(tmp_path, cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] and report["level"] == "full" and set(report["nodes"]) == {"local-0",
                                                                                    "local-1"}
    by = {(r["node_id"], r["check"]): r for r in report["results"]}
    link = by[("local-0", "network.pairwise")]["details"]["links"]["local-1"]
    assert link > 0 and by[("local-1", "network.pairwise")]["details"]["links"]["local-0"] == link
    assert by[("local-0", "network.allreduce")]["details"]["backend"] == "gloo"
    assert all(r["ok"] for r in report["results"])


def test_waiting_for_a_bad_node_to_recover_then_running(tmp_path: Path,
                                                        dataset_dir: Path) -> None:
    # on_insufficient: wait. local-1's scratch directory is broken, then repaired while the
    # supervisor waits: the next re-check admits it and the job runs on both nodes.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    broken = scratch / "local-1"
    broken.write_text("not a directory")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 20},
                       health={"preflight": "quick", "on_insufficient": "wait",
                               "retry_interval_s": 2, "scratch_dir": str(scratch / "{node_id}")})
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env(), start_new_session=True)
    try:
        wait_for(lambda: any(e["kind"] == "node_state" and e["state"] == "excluded"
                             for e in journal(run)), 120, what="local-1 excluded")
        # At least one re-check fails while the directory is still broken.
        wait_for(lambda: sum(1 for e in journal(run) if e["kind"] == "health_round"
                             and e["failed"].get("local-1")) >= 2, 120,
                 what="a failed re-check of local-1")
        broken.unlink()
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_run(run, proc)
    assert proc.returncode == 0, out[-4000:]
    events = journal(run)
    rounds = [e for e in events if e["kind"] == "health_round"]
    assert rounds[0]["failed"] == {"local-1": ["host.disk"]}
    assert len(rounds) >= 3 and rounds[-1]["nodes"] == ["local-1"] and rounds[-1]["failed"] == {}
    states = [(e["node_id"], e["state"]) for e in events if e["kind"] == "node_state"]
    assert ("local-1", "excluded") in states and ("local-1", "registered") in states
    launch = next(e for e in events if e["kind"] == "generation_launched")
    assert launch["nodes"] == {"local-0": 0, "local-1": 1}
    assert status(run)["state"] == "COMPLETED"
