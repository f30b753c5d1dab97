"""No false hang: a rank's life after its last step is judged by the phases it is
in (``checkpointing`` for the final commit, ``finishing`` for the digest, close and the
process-group teardown), never by the calibrated training timeout of a few step intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import journal, status, up, write_config

pytestmark = pytest.mark.slow

# The commit of the final checkpoint takes this long on rank 0 (chaos), far past the 2 s
# training timeout below; rank 1 waits for it in the teardown barrier, as a GPU rank waits
# in NCCL's teardown.
SLOW_FINAL_COMMIT_S = 8.0


def test_a_slow_final_commit_ends_the_job_with_no_false_hang(tmp_path: Path,
                                                            dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 25},
                       timeouts={"training_floor_s": 2.0, "training_multiplier": 3.0},
                       chaos={"slow_final_commit_s": SLOW_FINAL_COMMIT_S})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(tmp_path / "run")
    assert [e for e in events if e["kind"] == "failure"] == [], result.stdout[-4000:]
    assert [e["generation"] for e in events if e["kind"] == "generation_launched"] == [1]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED" and st["restarts"] == []
    # The final checkpoint committed, and the job ended no sooner than the delay after the
    # last step (a lower bound a sleep guarantees: the chaos did happen).
    assert [e for e in events if e["kind"] == "checkpoint_committed" and e["step"] == 25]
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text()
             .splitlines()]
    last = next(r for r in steps if r["step"] == 25)
    completed = next(e for e in events if e["kind"] == "transition" and e["to"] == "COMPLETED")
    assert completed["ts"] - last["ts"] >= SLOW_FINAL_COMMIT_S
    # The training timeout that applied while the ranks trained was the low one.
    calibration = [e for e in events if e["kind"] == "calibration"]
    assert calibration and calibration[-1]["training_timeout_s"] < SLOW_FINAL_COMMIT_S
