"""deploy/slurm/train.sbatch submitted with sbatch to a real slurmctld + slurmd, followed
to COMPLETED: the batch step runs the supervisor, srun starts the agents, a rank is killed
and the job recovers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import env, journal, kill_strays, status, write_config
from servers import slurm

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _job_state(job_id: str, slurm_env: dict[str, str]) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True,
                         text=True, timeout=30, env={**env(), **slurm_env})
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN")


def _follow(job_id: str, slurm_env: dict[str, str], timeout: float) -> str:
    """Poll Slurm until the job reaches a final state; returns it."""
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        state = _job_state(job_id, slurm_env)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                     "OUT_OF_MEMORY"):
            return state
        time.sleep(1)
    raise AssertionError(f"slurm job {job_id} still {state} after {timeout} s")


def test_sbatch_file_runs_the_job_to_completed(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(
        tmp_path / "job.yaml", dataset_dir, trainer={"steps": 25},
        chaos={"kill": [{"step": 14, "rank": 1}]},
        launcher={"advertise_host": "127.0.0.1", "python": sys.executable,
                  "slurm": {"agents_per_node": 2, "addr": "127.0.0.1"}})
    run = tmp_path / "run"
    with slurm(tmp_path / "slurm") as slurm_env:
        submit = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2",
             f"--chdir={tmp_path}", f"--export=ALL,CONFIG={cfg},RUN_DIR={run},"
             f"PYTHON={sys.executable}", str(ROOT / "deploy" / "slurm" / "train.sbatch")],
            capture_output=True, text=True, timeout=60, env={**env(), **slurm_env})
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().split(";")[0]
        try:
            final = _follow(job_id, slurm_env, timeout=300)
        finally:
            kill_strays(run)
    output = tmp_path / f"orchestrator-{job_id}.out"
    assert final == "COMPLETED", output.read_text()[-4000:] if output.exists() else final
    st = status(run)
    assert st["state"] == "COMPLETED" and st["last_step"] == 25, st
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    assert sorted(st["nodes"]) == ["slurm-0", "slurm-1"]
    spawned = [e for e in journal(run) if e["kind"] == "agent_spawned"]
    assert spawned and all(e["launcher"] == "slurm" for e in spawned)
