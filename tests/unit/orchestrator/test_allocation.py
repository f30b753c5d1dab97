"""A running allocation checked against the config (Slurm's SLURM_*, an Indexed Job pod's
index and the pod count it was rendered for, SageMaker's hosts): one line when they disagree,
from validate and from the supervisor (a config failure in the journal, FAILED, no
traceback, no resume advice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.allocation import detect, mismatch
from orchestrator.config import load_config

SLURM = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}


def _cfg(*sets: str):
    return load_config(None, list(sets))


def test_slurm_nodes_and_gpus() -> None:
    cfg = _cfg("cluster.nodes=2", "launcher.kind=slurm")
    assert mismatch(cfg, {**SLURM, "SLURM_JOB_NUM_NODES": "2"}) is None
    line = mismatch(cfg, {**SLURM, "SLURM_JOB_NUM_NODES": "1"})
    assert line and "1 node(s) x 1 agent(s)" in line and "sbatch --nodes=2" in line
    assert "\n" not in line
    spare = _cfg("cluster.nodes=2", "cluster.spares=1")
    assert "sbatch --nodes=3" in mismatch(spare, {**SLURM, "SLURM_NNODES": "2"})
    two = _cfg("cluster.nodes=2", "launcher.slurm.agents_per_node=2")
    assert mismatch(two, {**SLURM, "SLURM_JOB_NUM_NODES": "1"}) is None  # the tests' way
    gpus = _cfg("cluster.nodes=2", "cluster.procs_per_node=8", "cluster.accelerator=cuda",
                "trainer.device=cuda", "trainer.parallelism.backend=nccl")
    line = mismatch(gpus, {**SLURM, "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4"})
    assert line and "--gpus-per-node=8" in line
    assert mismatch(gpus, {**SLURM, "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}) \
        is None


def test_kubernetes_pod_index_and_count() -> None:
    cfg = _cfg("cluster.nodes=16", "cluster.spares=1")
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3",
           "ORCH_NODE_COUNT": "17"}
    assert mismatch(cfg, pod) is None
    assert "rendered for 16 pod(s)" in mismatch(cfg, {**pod, "ORCH_NODE_COUNT": "16"})
    assert "completion index 17" in mismatch(cfg, {**pod, "JOB_COMPLETION_INDEX": "17",
                                                    "ORCH_NODE_COUNT": ""})
    assert detect({"JOB_COMPLETION_INDEX": "1"}) is None  # not in a pod


def test_sagemaker_hosts() -> None:
    cfg = _cfg("cluster.spares=1")
    env = {"SM_HOSTS": json.dumps(["algo-1"]), "SM_CURRENT_HOST": "algo-1"}
    line = mismatch(cfg, env)
    assert line and "--instance-count 2" in line
    assert mismatch(cfg, {**env, "SM_HOSTS": json.dumps(["algo-1", "algo-2"])}) is None


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
                                        "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE",
                                        "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX",
                                        "ORCH_NODE_COUNT", "SM_HOSTS", "SM_NUM_GPUS"]),
                       st.text(max_size=12) | st.integers(0, 10**6).map(str)))
def test_any_environment_gives_a_line_or_none(env: dict[str, str]) -> None:
    for cfg in (_CPU, _GPU):
        line = mismatch(cfg, env)
        assert line is None or (isinstance(line, str) and "\n" not in line and line)


_CPU = _cfg()
_GPU = _cfg("cluster.procs_per_node=8", "cluster.accelerator=cuda", "trainer.device=cuda",
            "trainer.parallelism.backend=nccl")


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("ORCH_", "SLURM_", "SM_", "KUBERNETES_"))}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd,
                          capture_output=True, text=True, env={**base, **env,
                                                                "COLUMNS": "250"},
                          timeout=120)


def test_validate_and_the_supervisor_say_it_in_one_line(tmp_path: Path) -> None:
    """sbatch --nodes=1 for a 2-node config: validate exits 1 with the line; up journals a
    config failure and ends FAILED (exit 1) before starting anything; status offers no
    resume command."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"job": {"name": "s"}, "cluster": {"nodes": 2},
                                   "launcher": {"kind": "slurm"},
                                   "metrics": {"port": 0, "host": "127.0.0.1"}}))
    env = {**SLURM, "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1"}
    checked = _cli("validate", str(cfg), env=env, cwd=tmp_path)
    assert checked.returncode == 1
    lines = [x for x in checked.stderr.splitlines() if "Slurm allocation" in x]
    assert len(lines) == 1 and "sbatch --nodes=2" in lines[0], checked.stderr
    run = tmp_path / "run"
    up = _cli("up", str(cfg), "--run-dir", str(run), "--log-format", "plain", env=env,
              cwd=tmp_path)
    assert up.returncode == 1, up.stdout + up.stderr
    assert "Traceback" not in up.stdout + up.stderr
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    failure = [e for e in events if e["kind"] == "failure"]
    assert len(failure) == 1 and failure[0]["cause"] == "config"
    assert "sbatch --nodes=2" in failure[0]["message"]
    assert [e["to"] for e in events if e["kind"] == "transition"] == ["FAILED"]
    assert not any(e["kind"] == "agent_spawned" for e in events)  # nothing started
    status = _cli("status", str(run), env={}, cwd=tmp_path)
    assert "FAILED" in status.stdout and "--resume" not in status.stdout, status.stdout
    assert "sbatch --nodes=2" in " ".join(status.stdout.split())


@pytest.mark.parametrize("nodes", ["2", "3"])
def test_a_fitting_allocation_passes_validate(tmp_path: Path, nodes: str) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"cluster": {"nodes": 2}}))
    ok = _cli("validate", str(cfg), env={**SLURM, "SLURM_JOB_NUM_NODES": nodes}, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
