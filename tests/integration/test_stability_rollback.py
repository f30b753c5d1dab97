"""Automatic rollback end to end: a gradient explosion on a 2-rank run, the supervisor's
detectors, the stop, the restore of an older checkpoint, the skipped data window, and final
parameters bit-identical to a run that skipped the same window from the start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import (
    assert_bit_identical,
    env,
    final_state_dict,
    journal,
    states,
    status,
    up,
    write_config,
)

pytestmark = pytest.mark.slow

STEPS = 40
POISON = 24  # global batch index: trained at step 25, after the checkpoint at step 20
SKIP = 5
# A relative rule with a wide margin: the poisoned batch (grad norm x1e4) fires it, the
# tiny model's natural early-training swings (up to ~2x the running mean) never do.
STABILITY = {
    "grad_spike": {"mode": "relative", "rel_margin": 4.0, "action": "rollback"},
    "rollback": {"skip_batches": SKIP, "max_rollbacks": 1, "window_steps": 100},
}
FINAL = f"step-{STEPS:08d}"
COMPARED = ("app.model.", "app.optim.", "progress.", "data.", "schedule.")


@pytest.fixture(scope="module")
def rollback_run(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("rollback")
    cfg = write_config(tmp / "job.yaml", dataset_dir, chaos={"poison_batches": [POISON]},
                       stability=STABILITY)
    result = up(cfg, tmp / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    return tmp / "run"


def _steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]


def test_spike_rolls_back_past_the_window_and_completes(rollback_run: Path) -> None:
    events = journal(rollback_run)
    assert states(rollback_run) == [
        "PENDING", "HEALTH_CHECK", "LAUNCHING", "RUNNING", "STOPPING", "RECOVERING",
        "HEALTH_CHECK", "LAUNCHING", "RUNNING", "COMPLETED"]
    spike = next(e for e in events if e["kind"] == "stability" and e["event"] == "grad_spike")
    assert spike["step"] == POISON + 1 and spike["batch"] == POISON
    assert spike["action"] == "rollback" and spike["grad_norm"] > 100 * spike["running_mean"]
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["cause"] == "divergence" and "grad_spike" in failure["message"]
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    assert rollback["onset_step"] == POISON + 1 and rollback["onset_batch"] == POISON
    assert rollback["skip_window"] == [POISON, POISON + SKIP]
    assert rollback["restore_max_step"] == POISON and rollback["restore_step"] == 20
    assert rollback["wasted_steps"] == rollback["from_step"] - 20 > 0
    # No checkpoint at or after the onset survives the rollback: they hold the damage.
    assert all(s > POISON for s in rollback["discarded_checkpoints"])
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert [(e["generation"], e["step"]) for e in resumed] == [(2, 20)]
    launch = [e for e in events if e["kind"] == "generation_launched"][1]
    env_2 = next(iter(launch["assignments"].values()))["env"]
    assert json.loads(env_2["ORCH_SKIP_WINDOWS"]) == [[POISON, POISON + SKIP]]
    assert env_2["ORCH_RESUME_MAX_STEP"] == str(POISON)
    # Generation 2 retrained batches 20..23, then jumped the window: the poison never came back.
    gen2 = {r["step"]: r["batch"] for r in _steps(rollback_run) if r["generation"] == 2}
    assert [gen2[s] for s in range(21, 27)] == [20, 21, 22, 23, POISON + SKIP, POISON + SKIP + 1]
    assert max(r["grad_norm"] for r in _steps(rollback_run) if r["generation"] == 2) < 100


def test_status_shows_the_stability_picture(rollback_run: Path) -> None:
    st = status(rollback_run)
    assert st["state"] == "COMPLETED" and st["last_step"] == STEPS
    stab = st["stability"]
    assert stab["step"] == STEPS and stab["last_grad_norm"] > 0 and stab["running_mean"] > 0
    assert stab["last_param_norm"] > 0 and stab["growth_ratio"] >= 1
    assert stab["events"]["grad_spike"] == 1
    # The spike's end (step 26 of the abandoned lineage) is seen only if that record arrives
    # before the stop; the restored lineage has no spike to end.
    assert stab["events"].get("grad_spike_end", 0) <= 1
    [rb] = stab["rollbacks"]
    assert rb["event"] == "grad_spike" and rb["restore_step"] == 20
    assert stab["skip_windows"] == [[POISON, POISON + SKIP]] and stab["lr_scale"] == 1.0
    text = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(rollback_run)],
                          capture_output=True, text=True, env=env(), timeout=60, check=True)
    assert "stability" in text.stdout and "skipped batches [24, 29)" in text.stdout


def test_replay_of_the_run_gives_the_journaled_events(rollback_run: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "stability", "replay",
                          str(rollback_run / "steps.jsonl")],
                         capture_output=True, text=True, env=env(), timeout=60, check=True)
    replayed = [json.loads(line) for line in out.stdout.splitlines()]
    journaled = [e for e in journal(rollback_run) if e["kind"] == "stability"]
    assert [(e["kind"], e["step"]) for e in replayed] == \
        [(e["event"], e["step"]) for e in journaled]
    assert replayed[0]["g"] == journaled[0]["grad_norm"]
    assert replayed[0]["r"] == journaled[0]["running_mean"]


def test_final_parameters_equal_a_run_that_skipped_the_window_from_the_start(
        rollback_run: Path, tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "ref.yaml", dataset_dir, stability=STABILITY,
                       trainer={"data": {"skip_windows": [[POISON, POISON + SKIP]]}})
    result = up(cfg, tmp_path / "ref")
    assert result.returncode == 0, result.stdout[-4000:]
    assert [e for e in journal(tmp_path / "ref") if e["kind"] == "rollback"] == []
    a = final_state_dict(rollback_run / "checkpoints" / "t" / FINAL)
    b = final_state_dict(tmp_path / "ref" / "checkpoints" / "t" / FINAL)
    assert assert_bit_identical(a, b, COMPARED) > 30


def test_a_second_divergence_past_the_budget_fails_the_job(tmp_path: Path,
                                                           dataset_dir: Path) -> None:
    # After the first rollback skips batches 24..28, step 27 trains batch 31: poisoned too.
    second = POISON + SKIP + 2
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, stability=STABILITY,
                       chaos={"poison_batches": [POISON, second]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 1, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "FAILED"
    assert "rollback budget spent" in st["failed_reason"]
    assert "max_rollbacks is 1" in st["failed_reason"]
    assert [r["onset_step"] for r in st["stability"]["rollbacks"]] == [POISON + 1]
    assert [f["cause"] for f in st["failures"]] == ["divergence", "divergence"]
    spikes = [e for e in journal(tmp_path / "run")
              if e["kind"] == "stability" and e["event"] == "grad_spike"]
    assert [(e["generation"], e["step"], e["batch"]) for e in spikes] == \
        [(1, POISON + 1, POISON), (2, 27, second)]
