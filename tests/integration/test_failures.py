"""Hangs, lost nodes, spares and a supervisor restart, with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import (
    assert_bit_identical,
    env,
    final_state_dict,
    journal,
    kill_strays,
    states,
    status,
    up,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow

# Fast hang detection for tests: the training timeout is max(2 s, 3 x largest step).
HANG_TIMEOUTS = {"training_floor_s": 2.0, "training_multiplier": 3.0}


@pytest.fixture(scope="module")
def reference(clean_fast_run: Path) -> dict:
    """The final state of the FAST job run uninterrupted (shared by the session)."""
    return final_state_dict(clean_fast_run / "checkpoints" / "t" / "step-00000040")


def test_sigstop_is_a_hang_with_stacks_and_exact_resume(tmp_path: Path, dataset_dir: Path,
                                                        reference: dict) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, timeouts=HANG_TIMEOUTS,
                       chaos={"kill": [{"step": 23, "rank": 1, "signal": "SIGSTOP"}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    failure = next(e for e in journal(tmp_path / "run") if e["kind"] == "failure")
    assert failure["cause"] == "hang"
    assert failure["rank"] == 1  # the stopped rank is named first
    assert failure["suspects"][0]["silent"] is True
    assert "no heartbeat" in failure["message"]
    # Stacks of every rank, written before the kill; rank 0 is caught mid-collective by
    # its own faulthandler; the stopped rank 1's are read from outside, and it is not woken.
    stacks = {Path(p).name: Path(p).read_text() for p in failure["stacks"]}
    assert set(stacks) == {"gen0001-rank00000.txt", "gen0001-rank00001.txt"}
    assert "most recent call first" in stacks["gen0001-rank00000.txt"]
    assert "train" in stacks["gen0001-rank00000.txt"]
    stopped = stacks["gen0001-rank00001.txt"]
    assert "stacks read from outside by py-spy" in stopped and "stopped" in stopped, stopped
    assert "train" in stopped, stopped
    final = final_state_dict(tmp_path / "run" / "checkpoints" / "t" / "step-00000040")
    assert_bit_identical(reference, final, ("app.model.", "app.optim.", "progress.", "data."))


def test_no_false_hang_on_slow_checkpoint_or_slow_first_step(tmp_path: Path,
                                                              dataset_dir: Path) -> None:
    # Each save blocks 3 s and each first step takes 3 s longer: both beyond the 2 s
    # training floor, both inside phases with their own timeouts.
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, timeouts=HANG_TIMEOUTS,
                       trainer={"steps": 25},
                       chaos={"slow_checkpoint_s": 3.0, "slow_first_step_s": 3.0})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["failures"] == [] and st["restarts"] == []
    calibration = [e for e in journal(tmp_path / "run") if e["kind"] == "calibration"]
    assert calibration and calibration[-1]["training_timeout_s"] >= 2.0


def test_agent_killed_with_its_ranks_is_node_lost(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 400},
                       checkpoint={"interval_steps": 20})
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg),
                             "--run-dir", str(run), "--set", "trainer.steps=60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), start_new_session=True)
    try:
        wait_for(lambda: any(e["kind"] == "checkpoint_committed" for e in journal(run)), 120,
                 what="a first checkpoint")
        agent = next(e for e in journal(run) if e["kind"] == "agent_spawned"
                     and e["node_id"] == "local-1")
        rank = next(e for e in journal(run) if e["kind"] == "ranks_started"
                    and e["node_id"] == "local-1")["ranks"][0]["pid"]
        os.kill(agent["pid"], signal.SIGKILL)
        os.kill(rank, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_strays(run)
    assert proc.returncode == 0, out[-4000:]
    failure = next(e for e in journal(run) if e["kind"] == "failure")
    assert failure["cause"] == "node_lost" and failure["node_id"] == "local-1"
    lost = [e for e in journal(run) if e["kind"] == "node_state" and e["state"] == "lost"]
    assert [e["node_id"] for e in lost] == ["local-1"]
    assert status(run)["state"] == "COMPLETED"


def test_node_failing_twice_is_replaced_by_the_spare(tmp_path: Path, dataset_dir: Path,
                                                     reference: dict) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, cluster={"spares": 1},
                       chaos={"kill": [{"step": 12, "rank": 1}, {"step": 27, "rank": 1}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(tmp_path / "run")
    excluded = [e for e in events if e["kind"] == "node_state" and e["state"] == "excluded"]
    assert [e["node_id"] for e in excluded] == ["local-1"]
    launches = [e for e in events if e["kind"] == "generation_launched"]
    assert launches[0]["nodes"] == {"local-0": 0, "local-1": 1}
    # The first launch waits for the world's nodes, not for a spare: on a loaded machine the
    # spare's agent registers after it, and is a spare from the next health round on.
    assert all(launch["spares"] in ([], ["local-2"]) for launch in launches[:-1])
    assert launches[-2]["spares"] == ["local-2"]  # the launch before the second failure
    assert launches[-1]["nodes"] == {"local-0": 0, "local-2": 1}  # same world size
    st = status(tmp_path / "run")
    assert st["nodes"]["local-1"]["state"] == "excluded"
    assert [h["event"] for h in st["nodes"]["local-1"]["history"]].count("failure") == 2
    final = final_state_dict(tmp_path / "run" / "checkpoints" / "t" / "step-00000040")
    assert_bit_identical(reference, final, ("app.model.", "app.optim."))


def test_supervisor_killed_and_resumed_does_not_restart_workers(tmp_path: Path,
                                                                dataset_dir: Path) -> None:
    # Long enough that the workers are still training after the supervisor's 3 s absence.
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 600},
                       checkpoint={"interval_steps": 100})
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg),
                              "--run-dir", str(run)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env(),
                             start_new_session=True)
    second = None
    try:
        wait_for(lambda: _last_step(run) >= 20, 120, what="training to pass step 20")
        pids_before = sorted(r["pid"] for e in journal(run) if e["kind"] == "ranks_started"
                             for r in e["ranks"])
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        killed_at = time.time()
        time.sleep(3.0)
        assert all(_alive(p) for p in pids_before), "workers died with the supervisor"
        second = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--resume",
                                 str(run)], capture_output=True, text=True, env=env(),
                                timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
        kill_strays(run)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    events = journal(run)
    pids_after = sorted(r["pid"] for e in events if e["kind"] == "ranks_started"
                        for r in e["ranks"])
    assert pids_after == pids_before  # no worker was restarted
    assert [e["generation"] for e in events if e["kind"] == "generation_launched"] == [1]
    starts = [e for e in events if e["kind"] == "supervisor_started"]
    assert [s["resumed"] for s in starts] == [False, True]
    assert starts[1]["gap_s"] >= 2.5 and starts[1]["ts"] >= killed_at
    assert states(run)[-1] == "COMPLETED"
    assert status(run)["last_step"] == 600


def _last_step(run: Path) -> int:
    steps = run / "steps.jsonl"
    if not steps.exists():
        return 0
    lines = steps.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
