"""deploy/slurm's batch files submitted with sbatch to a real slurmctld + slurmd and
followed to COMPLETED: the batch step runs the supervisor, srun starts the agents; a rank is
killed and the job recovers; the requeue-aware variant survives `scontrol requeue`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs import env, journal, kill_strays, status, wait_for, write_config
from servers import slurm

# One Slurm at a time on this machine: two clusters would register the same node name (this
# host) and share munge's and slurmd's machine-wide paths; test_launchers' Slurm test is in
# the same xdist group.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with slurm(tmp_path_factory.mktemp("slurm")) as e:
        yield e


def _config(path: Path, dataset_dir: Path, **sections) -> Path:
    return write_config(
        path, dataset_dir, launcher={"advertise_host": "127.0.0.1", "python": sys.executable,
                                     "slurm": {"agents_per_node": 2, "addr": "127.0.0.1"}},
        **sections)


def _sbatch(script: str, tmp_path: Path, slurm_env: dict[str, str], **export: str) -> str:
    exports = ",".join(f"{k}={v}" for k, v in {**export, "PYTHON": sys.executable}.items())
    out = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--chdir={tmp_path}",
         f"--export=ALL,{exports}", str(ROOT / "deploy" / "slurm" / script)],
        capture_output=True, text=True, timeout=60, env={**env(), **slurm_env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


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


def test_sbatch_file_runs_the_job_to_completed(tmp_path: Path, dataset_dir: Path,
                                               slurm_env: dict[str, str]) -> None:
    cfg = _config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 25},
                  chaos={"kill": [{"step": 14, "rank": 1}]})
    run = tmp_path / "run"
    job_id = _sbatch("train.sbatch", tmp_path, slurm_env, CONFIG=str(cfg), RUN_DIR=str(run))
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


def test_requeued_job_starts_again_from_its_newest_checkpoint(
        tmp_path: Path, dataset_dir: Path, slurm_env: dict[str, str]) -> None:
    cfg = _config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 40})
    home = tmp_path / "shared" / "job"  # what would be on shared storage
    job_id = _sbatch("train-requeue.sbatch", tmp_path, slurm_env, CONFIG=str(cfg),
                     RUN_DIR=str(home))
    first = home / "attempt-0"
    try:
        wait_for(lambda: any(e["kind"] == "checkpoint_committed" for e in journal(first)),
                 timeout=240, what="a first committed checkpoint")
        requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True,
                                 text=True, timeout=30, env={**env(), **slurm_env})
        assert requeue.returncode == 0, requeue.stderr
        final = _follow_through_requeue(job_id, slurm_env, timeout=400)
    finally:
        for run in home.glob("attempt-*"):
            kill_strays(run)
    output = (tmp_path / f"orchestrator-{job_id}.out").read_text()
    assert final == "COMPLETED", output[-4000:]
    assert "restart count 1" in output and "ended STOPPED" in output, output[-4000:]
    assert status(first)["state"] == "STOPPED"
    second = home / "attempt-1"
    assert (home / "latest").resolve() == second.resolve()
    st = status(second)
    assert st["state"] == "COMPLETED" and st["last_step"] == 40, st
    resumed = [e["step"] for e in journal(second) if e["kind"] == "resumed"]
    committed = [e["step"] for e in journal(first) if e["kind"] == "checkpoint_committed"]
    assert resumed and resumed[0] == max(committed) >= 10  # not from scratch


def _follow_through_requeue(job_id: str, slurm_env: dict[str, str], timeout: float) -> str:
    """Like _follow, once the job has run again (its restart count is 1). Slurm holds a
    requeued job back for a while (its BeginTime); the test lets it start at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True,
                             text=True, timeout=30, env={**env(), **slurm_env})
        fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
        if fields.get("Restarts") == "1":
            if fields.get("JobState") == "PENDING":
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                               capture_output=True, timeout=30, env={**env(), **slurm_env})
            elif fields.get("JobState") not in ("REQUEUED", "COMPLETING", "REQUEUE_HOLD"):
                return _follow(job_id, slurm_env, max(1.0, deadline - time.monotonic()))
        time.sleep(1)
    raise AssertionError(f"slurm job {job_id} was not requeued within {timeout} s")


def test_a_rendered_sbatch_runs_the_job_to_completed(tmp_path: Path, dataset_dir: Path,
                                                     slurm_env: dict[str, str]) -> None:
    """`orchestrator deploy slurm` for the tests' one-node Slurm (two agents a node): the file
    alone is the job (its sizes and config inside), submitted without a size on the
    command line, to COMPLETED."""
    run = tmp_path / "run"
    cfg = _config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 15},
                  deploy={"slurm": {"python": sys.executable, "run_dir": str(run)}})
    rendered = subprocess.run([sys.executable, "-m", "orchestrator", "deploy", "slurm",
                               str(cfg), "--out", str(tmp_path / "out")], capture_output=True,
                              text=True, timeout=120, env=env())
    assert rendered.returncode == 0, rendered.stderr
    sbatch = tmp_path / "out" / "t.sbatch"
    assert "#SBATCH --nodes=1\n" in sbatch.read_text()
    assert "#SBATCH --ntasks-per-node=2\n" in sbatch.read_text()
    out = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(sbatch)],
                         capture_output=True, text=True, timeout=60,
                         env={**env(), **slurm_env})
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    try:
        final = _follow(job_id, slurm_env, timeout=300)
    finally:
        kill_strays(run)
    output = tmp_path / f"t-{job_id}.out"
    assert final == "COMPLETED", output.read_text()[-4000:] if output.exists() else final
    st = status(run)
    assert st["state"] == "COMPLETED" and st["last_step"] == 15, st
    assert sorted(st["nodes"]) == ["slurm-0", "slurm-1"]


def test_an_allocation_smaller_than_the_config_fails_in_one_line(
        tmp_path: Path, dataset_dir: Path, slurm_env: dict[str, str]) -> None:
    """sbatch --nodes=1 (two agents there) for a job of 3 nodes: no traceback, a config
    failure in the journal, FAILED, and status without a resume command."""
    cfg = _config(tmp_path / "job.yaml", dataset_dir, cluster={"nodes": 3})
    run = tmp_path / "run"
    job_id = _sbatch("train.sbatch", tmp_path, slurm_env, CONFIG=str(cfg), RUN_DIR=str(run))
    try:
        final = _follow(job_id, slurm_env, timeout=180)
    finally:
        kill_strays(run)
    output = (tmp_path / f"orchestrator-{job_id}.out").read_text()
    assert final == "FAILED", output[-3000:]
    assert "Traceback" not in output
    st = status(run)
    assert st["state"] == "FAILED" and st["root_cause"]["cause"] == "config"
    assert "1 node(s) x 2 agent(s)" in st["root_cause"]["message"]
    assert "sbatch --nodes=2" in st["failed_reason"]
    text = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run)],
                          capture_output=True, text=True, timeout=60,
                          env={**env(), "COLUMNS": "250"}).stdout
    assert "--resume" not in text
