"""SSH and Slurm launchers against a real sshd and a real slurmctld + slurmd + munge."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jobs import env, journal, kill_strays, status, up, write_config
from servers import slurm, sshd

pytestmark = pytest.mark.slow


def _assert_recovered(run: Path, launcher: str) -> None:
    st = status(run)
    assert st["state"] == "COMPLETED", st
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    spawned = [e for e in journal(run) if e["kind"] == "agent_spawned"]
    assert spawned and all(e["launcher"] == launcher for e in spawned)
    launches = [e for e in journal(run) if e["kind"] == "generation_launched"]
    assert all(len(set(e["nodes"].values())) == 2 for e in launches)  # distinct node ranks


def test_ssh_launcher_runs_two_nodes_and_recovers(tmp_path: Path, dataset_dir: Path) -> None:
    with sshd(tmp_path / "sshd") as server:
        host = f"{server.user}@127.0.0.1:{server.port}"
        cfg = write_config(
            tmp_path / "job.yaml", dataset_dir, trainer={"steps": 25},
            chaos={"kill": [{"step": 14, "rank": 1}]},
            launcher={"kind": "ssh", "advertise_host": "127.0.0.1", "python": sys.executable,
                      "ssh": {"hosts": [host, host], "identity_file": str(server.identity),
                              "options": ["StrictHostKeyChecking=no",
                                          "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]}})
        result = up(cfg, tmp_path / "run")
        assert result.returncode == 0, result.stdout[-4000:]
    _assert_recovered(tmp_path / "run", "ssh")
    nodes = status(tmp_path / "run")["nodes"]
    assert sorted(nodes) == ["127-0", "127-1"]
    token = (tmp_path / "run" / "token").read_text().strip()
    for log in (tmp_path / "run" / "agents").glob("*.ssh.log"):
        assert token not in log.read_text()


@pytest.mark.xdist_group("slurm")  # one Slurm at a time: see test_deploy_slurm.py
def test_slurm_launcher_runs_two_nodes_and_recovers(tmp_path: Path, dataset_dir: Path) -> None:
    with slurm(tmp_path / "slurm") as slurm_env:
        cfg = write_config(
            tmp_path / "job.yaml", dataset_dir, trainer={"steps": 25},
            chaos={"kill": [{"step": 14, "rank": 0}]},
            launcher={"kind": "slurm", "advertise_host": "127.0.0.1", "python": sys.executable,
                      "slurm": {"agents_per_node": 2, "addr": "127.0.0.1"}})
        run = tmp_path / "run"
        cmd = ["salloc", "--nodes=1", "--ntasks=2", "--time=10", sys.executable, "-m",
               "orchestrator", "up", str(cfg), "--run-dir", str(run)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                    env={**env(), **slurm_env})
        finally:
            kill_strays(run)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    _assert_recovered(run, "slurm")
    assert sorted(status(run)["nodes"]) == ["slurm-0", "slurm-1"]
