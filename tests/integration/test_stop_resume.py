"""An operator's stop loses no work: `down` has the ranks commit a checkpoint at their next
step boundary, the job is STOPPED, and `up --resume` continues it as a new segment that ends
bit-identical to a run nobody stopped."""

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
    kill_run,
    kill_strays,
    states,
    status,
    up,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow

STEPS = 200  # long enough (tens of ms a step) for the stop to land mid-run


# The CLI's `down RUN_DIR` once a line comes on stdin (everything imported before).
_DOWN_WHEN_TOLD = """
import sys
import orchestrator.cli.control
from orchestrator.cli import main
run = sys.argv[1]
sys.stdin.readline()
sys.argv = ["orchestrator", "down", run]
main()
"""


def _progress(run: Path) -> int:
    """Rank 0's newest step, from the step records the supervisor appends as they come."""
    path = run / "steps.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()
             if line.strip().startswith("{") and line.strip().endswith("}")]
    return max(steps, default=0)


def test_down_checkpoints_at_the_stop_step_and_resume_ends_bit_identical(
        tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": STEPS},
                       checkpoint={"interval_steps": 50})
    reference = up(cfg, tmp_path / "ref")
    assert reference.returncode == 0, reference.stdout[-4000:]

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg),
                             "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)
    # `orchestrator down`, its interpreter started and the CLI imported while the job starts:
    # under load, a cold `python -m orchestrator down` took 10 s to reach the supervisor,
    # and the job's last 188 steps were done by then.
    down_cli = subprocess.Popen([sys.executable, "-c", _DOWN_WHEN_TOLD, str(run)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env(),
                                start_new_session=True)
    try:
        wait_for(lambda: _progress(run) >= 12, timeout=240, what="step 12")
        out_down, err_down = down_cli.communicate("go\n", timeout=200)
        down = subprocess.CompletedProcess(down_cli.args, down_cli.returncode, out_down,
                                           err_down)
        out, _ = proc.communicate(timeout=200)
    except BaseException:
        kill_run(run, proc)
        down_cli.kill()
        raise
    finally:
        kill_strays(run)
    assert down.returncode == 0, (down.stdout[-2000:], down.stderr[-2000:])
    st = status(run)
    assert st["state"] == "STOPPED", out[-4000:]
    events = journal(run)
    stopped = [e for e in events if e["kind"] == "transition" and e["to"] == "STOPPED"][-1]
    committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    stop_step = committed[-1]
    assert 12 <= stop_step < STEPS
    assert f"final checkpoint at step {stop_step}" in stopped["reason"]
    # down names the step the job stopped at, not the journal's older progress event.
    assert f"STOPPED at step {stop_step} (newest checkpoint {stop_step})" in down.stderr, \
        down.stderr
    assert [e for e in events if e["kind"] == "failure"] == []  # a stop is no failure

    resumed = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--resume", str(run)],
                             capture_output=True, text=True, env=env(), timeout=300)
    kill_strays(run)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert status(run)["state"] == "COMPLETED"
    seq = states(run)
    assert seq[seq.index("STOPPED") + 1] == "PENDING"  # a new segment of the same job
    launches = [e for e in journal(run) if e["kind"] == "generation_launched"]
    assert launches[-1]["resume_step"] == stop_step

    final = f"step-{STEPS:08d}"
    a = final_state_dict(tmp_path / "ref" / "checkpoints" / "t" / final)
    b = final_state_dict(run / "checkpoints" / "t" / final)
    assert assert_bit_identical(a, b, ("app.model.", "app.optim.", "progress.", "data.",
                                       "schedule.")) > 30
