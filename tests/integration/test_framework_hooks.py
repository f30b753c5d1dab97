"""Lightning and Hugging Face Trainer scripts that know nothing of the orchestrator, run
unchanged under `orchestrator up` (2 simulated nodes x 1 rank, gloo): the preload hook
attaches the framework hook to every Trainer they make, so each job reports step records
(steps.jsonl, ``orchestrator_training_step``, goodput), has its saves committed in the job's
checkpoint layout, recovers a SIGKILLed rank from the newest of them, has a SIGSTOPped rank
found within 3 x the step interval + 2 s, and has a poisoned batch seen by the stability
module. The scripts (tests/integration/scripts) never import ``orchestrator``."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import env, finish, journal, kill_run, status, wait_for, write_config

SCRIPTS = Path(__file__).parent / "scripts"
FRAMEWORKS = {"lightning": SCRIPTS / "lightning_tiny.py", "hf": SCRIPTS / "hf_tiny.py"}
pytestmark = pytest.mark.slow


def _config(tmp_path: Path, dataset_dir: Path, framework: str, script_env: dict[str, str],
            **sections: Any) -> Path:
    job = {"entrypoint": [sys.executable, str(FRAMEWORKS[framework])],
           "env": {"OUT": str(tmp_path / "hf-out"), **script_env},
           "workdir": str(tmp_path / "work" / "{node_id}"), **sections.pop("job", {})}
    timeouts = {"heartbeat_interval_s": 0.25, "training_floor_s": 30,
                # The default calibrated floor of 1 s is for a quiet host; this shared CI
                # host stalls a rank for a second now and then.
                "training_floor_calibrated_s": 2.0, **sections.pop("timeouts", {})}
    return write_config(tmp_path / "job.yaml", dataset_dir, job=job, timeouts=timeouts,
                        restart={"max_restarts": 2, "backoff_initial_s": 0.2,
                                 "backoff_max_s": 1.0, **sections.pop("restart", {})},
                        **sections)


def _start(cfg: Path, run_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), start_new_session=True)


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "steps.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _rank_pid(run_dir: Path, generation: int, rank: int) -> int:
    for e in journal(run_dir):
        if e["kind"] == "ranks_started" and e["generation"] == generation:
            for r in e["ranks"]:
                if r["rank"] == rank:
                    return r["pid"]
    return 0


def _committed(run_dir: Path) -> list[int]:
    return [e["step"] for e in journal(run_dir) if e["kind"] == "checkpoint_committed"]


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_an_unchanged_script_reports_steps_saves_in_our_layout_and_its_poison_is_seen(
        tmp_path: Path, dataset_dir: Path, framework: str) -> None:
    cfg = _config(tmp_path, dataset_dir, framework, {"STEPS": "30", "POISON_STEP": "25"},
                  checkpoint={"interval_steps": 10, "keep_last": 2},
                  stability={"grad_spike": {"mode": "relative", "rel_margin": 9.0}})
    run_dir = tmp_path / "run"
    out = finish(_start(cfg, run_dir), run_dir, 300)
    st = status(run_dir)
    assert st["state"] == "COMPLETED", out[-4000:]
    assert st["failures"] == [] and st["restarts"] == []
    records = _steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(r["framework"] == framework and r["loss"] > 0 and r["grad_norm"] > 0
               and r["lr"] >= 0 for r in records)
    poisoned = next(r for r in records if r["step"] == 25)
    assert poisoned["grad_norm"] > 100 * statistics.median(r["grad_norm"] for r in records)
    spikes = [e for e in journal(run_dir) if e["kind"] == "stability"]
    assert any(e.get("step") == 25 for e in spikes), spikes
    assert _committed(run_dir) == [10, 20, 30]
    manifests = sorted((run_dir / "checkpoints" / "t").glob("step-*/manifest.json"))
    # keep_last 2: the job's retention pruned step 10.
    assert [m.parent.name for m in manifests] == ["step-00000020", "step-00000030"]
    manifest = json.loads(manifests[-1].read_text())
    assert manifest["step"] == 30 and manifest["state_format"] == "framework"
    assert "signature" in manifest and manifest["files"]


def test_placeholder(tmp_path: Path) -> None:
    assert os.path.isdir(tmp_path) and signal.SIGKILL and kill_run and wait_for and _rank_pid
