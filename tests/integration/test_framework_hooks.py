"""Lightning and Hugging Face Trainer scripts that know nothing of the orchestrator, run
unchanged under `orchestrator up` (2 simulated nodes x 1 rank, gloo): the preload hook
attaches the framework hook to every Trainer they make, so each job reports step records
(steps.jsonl, ``orchestrator_training_step``, goodput), has its saves committed in the job's
checkpoint layout, recovers a SIGKILLed rank from the newest of them, has a SIGSTOPped rank
found within 3 x the step interval + 2 s, and has a poisoned batch seen by the stability
module. The scripts (tests/integration/scripts) never import ``orchestrator``."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import (env, finish, journal, kill_run, kill_strays, metric, status, wait_for,
                  write_config)

SCRIPTS = Path(__file__).parent / "scripts"
FRAMEWORKS = {"lightning": SCRIPTS / "lightning_tiny.py", "hf": SCRIPTS / "hf_tiny.py"}
pytestmark = pytest.mark.slow
# Whether a resumed run ends bit-identical to an uninterrupted one. The Hugging Face Trainer
# keeps every RNG state and skips the batches an epoch already saw; Lightning restores the
# loops' progress but restarts a mid-epoch DataLoader from its beginning (a plain DataLoader
# has no position to save), so its batches after a resume differ.
EXACT = {"hf": True, "lightning": False}


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


def _final_params(out: str) -> str:
    """The script's own digest of its final parameters (rank 0's last line)."""
    lines = [x for x in out.splitlines() if "final step" in x]
    return lines[-1].split("final step", 1)[1] if lines else ""


def _run_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "rank-00000.log").read_text()


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_killed_rank_resumes_from_our_checkpoint_and_a_stopped_one_is_found_in_seconds(
        tmp_path: Path, dataset_dir: Path, framework: str) -> None:
    """Rank 1 SIGKILLs itself after step 15 (the newest committed checkpoint is step 10),
    then, in the next generation, SIGSTOPs itself after step 35: the first is recovered from
    step 10, the second found within 3 x the step interval + 2 s and recovered from step 30.
    The job ends where an uninterrupted one ends (bit-identical where the framework resumes
    exactly: see ``EXACT``)."""
    script_env = {"STEPS": "45", "STEP_S": "0.3"}
    chaos = {"kill": [{"step": 15, "rank": 1, "signal": "SIGKILL"},
                      {"step": 35, "rank": 1, "signal": "SIGSTOP"}]}
    cfg = _config(tmp_path, dataset_dir, framework, script_env,
                  checkpoint={"interval_steps": 10, "keep_last": 3}, chaos=chaos)
    run_dir = tmp_path / "run"
    out = finish(_start(cfg, run_dir), run_dir, 400)
    st = status(run_dir)
    assert st["state"] == "COMPLETED", out[-4000:]
    events = journal(run_dir)
    failures = [e for e in events if e["kind"] == "failure"]
    assert [f["cause"] for f in failures] == ["worker_exit", "hang"], failures
    assert failures[1]["rank"] == 1 and failures[1]["suspects"][0]["silent"]
    resumed = [e["step"] for e in events if e["kind"] == "resumed"]
    assert resumed == [10, 30], resumed  # our newest committed checkpoint each time
    by_gen: dict[int, list[int]] = {}
    for r in _steps(run_dir):
        by_gen.setdefault(r["generation"], []).append(r["step"])
    assert by_gen[2][0] == 11 and by_gen[3][0] == 31 and by_gen[3][-1] == 45
    # The hang: from the SIGSTOP (the chaos event the rank sent before stopping) to the
    # failure, against 3 x the step interval + 2 s.
    stop = next(e for e in events if e["kind"] == "chaos" and e.get("signal") == "SIGSTOP")
    intervals = [b["ts"] - a["ts"] for a, b in zip(_steps(run_dir), _steps(run_dir)[1:])
                 if a["generation"] == b["generation"] == 2]
    bound = 3 * statistics.median(intervals) + 2.0
    # Found when the job turned STOPPING (the failure event follows the stack dumps).
    found = next(e for e in events if e["kind"] == "transition" and e["to"] == "STOPPING"
                 and e["ts"] > stop["ts"])
    detected = found["ts"] - stop["ts"]
    assert detected <= bound + 0.5, (detected, bound)  # + the journal's own lag on a busy host
    assert failures[1]["suspects"][0]["timeout_s"] <= bound

    if not EXACT[framework]:
        return
    clean_dir = tmp_path / "clean"
    clean = _config(tmp_path, dataset_dir, framework, script_env,
                    checkpoint={"interval_steps": 10, "keep_last": 3})
    finish(_start(clean, clean_dir), clean_dir, 400)
    assert status(clean_dir)["state"] == "COMPLETED"
    ours, theirs = _final_params(_run_log(run_dir)), _final_params(_run_log(clean_dir))
    assert ours and ours == theirs


def test_a_job_restarted_after_its_final_save_trains_no_step_more(
        tmp_path: Path, dataset_dir: Path) -> None:
    """Rank 0 of a Hugging Face job fails on its way out, after the final step's checkpoint:
    the restarted job resumes that checkpoint and ends there (the Trainer, resumed at
    ``max_steps``, would train a step more)."""
    cfg = _config(tmp_path, dataset_dir, "hf",
                  {"STEPS": "20", "FAIL_ONCE": str(tmp_path / "failed-once")},
                  checkpoint={"interval_steps": 10, "keep_last": 2})
    run_dir = tmp_path / "run"
    out = finish(_start(cfg, run_dir), run_dir, 300)
    assert status(run_dir)["state"] == "COMPLETED", out[-4000:]
    events = journal(run_dir)
    assert [f["cause"] for f in events if f["kind"] == "failure"] == ["worker_exit"]
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [20]
    assert [r["step"] for r in _steps(run_dir)] == list(range(1, 21))
    assert _committed(run_dir) == [10, 20]
    finals = [x.split("final step", 1)[1] for x in _run_log(run_dir).splitlines()
              if "final step" in x]
    assert len(finals) == 2 and finals[0] == finals[1] and finals[0].startswith(" 20 "), finals


def _progress(run_dir: Path) -> int:
    return max((r["step"] for r in _steps(run_dir)), default=0)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_down_commits_a_checkpoint_through_the_framework_and_resume_continues_it(
        tmp_path: Path, dataset_dir: Path, framework: str) -> None:
    # Room for the stop to land before the last step: at least (steps - 14) x STEP_S after
    # step 14, which the `down` command's start and the stop's agreement must fit in on a
    # loaded host (46 steps of 0.1 s once did not: the job was stopped at its final step).
    steps = 100
    cfg = _config(tmp_path, dataset_dir, framework, {"STEPS": str(steps), "STEP_S": "0.15"},
                  checkpoint={"interval_steps": 10, "keep_last": 3})
    run_dir = tmp_path / "run"
    proc = _start(cfg, run_dir)
    try:
        wait_for(lambda: _progress(run_dir) >= 14, timeout=240, what="step 14")
        # The supervisor's /metrics while it trains: the step and the goodput books.
        base = f"http://127.0.0.1:{json.loads((run_dir / 'supervisor.json').read_text())['port']}"
        assert metric(base, "orchestrator_training_step", job="t") >= 14
        assert 0 < metric(base, "orchestrator_goodput_ratio", job="t") <= 1
        down = subprocess.run([sys.executable, "-m", "orchestrator", "down", str(run_dir)],
                              capture_output=True, text=True, env=env(), timeout=200)
        out, _ = proc.communicate(timeout=200)
    except BaseException:
        kill_run(run_dir, proc)
        raise
    finally:
        kill_strays(run_dir)
    assert down.returncode == 0, (down.stdout[-2000:], down.stderr[-2000:])
    assert status(run_dir)["state"] == "STOPPED", out[-4000:]
    events = journal(run_dir)
    stopped = [e for e in events if e["kind"] == "transition" and e["to"] == "STOPPED"][-1]
    stop_step = _committed(run_dir)[-1]
    assert 14 <= stop_step < steps and stop_step == _progress(run_dir)
    assert f"final checkpoint at step {stop_step}" in stopped["reason"]
    assert [e for e in events if e["kind"] == "failure"] == []

    resumed = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--resume",
                              str(run_dir)], capture_output=True, text=True, env=env(),
                             timeout=300)
    kill_strays(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert status(run_dir)["state"] == "COMPLETED"
    assert [e["step"] for e in journal(run_dir) if e["kind"] == "resumed"][-1] == stop_step
    done = [r["step"] for r in _steps(run_dir)]
    assert done[done.index(stop_step) + 1] == stop_step + 1 and done[-1] == steps


@pytest.mark.parametrize("one_line", [True, False])
def test_the_opt_out_leaves_the_trainer_alone_and_the_one_line_still_attaches(
        tmp_path: Path, dataset_dir: Path, one_line: bool) -> None:
    """``job.framework_hooks: false``: the preload hook attaches nothing (steps come from the
    optimizer count alone, no loss); the script's own one line attaches the hook anyway."""
    cfg = _config(tmp_path, dataset_dir, "lightning",
                  {"STEPS": "12", **({"ATTACH": "1"} if one_line else {})},
                  job={"framework_hooks": False})
    run_dir = tmp_path / "run"
    out = finish(_start(cfg, run_dir), run_dir, 300)
    assert status(run_dir)["state"] == "COMPLETED", out[-4000:]
    records = _steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    if one_line:
        assert all(r["framework"] == "lightning" and r["loss"] > 0 for r in records)
        assert _committed(run_dir) == [10, 12]
    else:
        assert not any("loss" in r or "framework" in r for r in records)
        assert _committed(run_dir) == []
