"""The hang bound holds after a slow early step: our trainer under `orchestrator up` (2
simulated nodes x 1 rank, gloo) takes two slow steps early in its generation (one in the
warm-up, one after it), then rank 1 SIGSTOPs itself; the hang is found within 3 x the step
interval + 2 s, not within 3 x the slow step (the rule before the step pace: one slow step
set the timeout for the rest of the job)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from jobs import journal, status, up, write_config

# The bound is 3 x the step + 2 s; other tests' load stalls a rank for seconds.
pytestmark = [pytest.mark.slow, pytest.mark.alone]
SLOW_S = 3.0


def test_a_slow_early_step_does_not_raise_the_bound_a_stopped_rank_is_found_within(
        tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(
        tmp_path / "job.yaml", dataset_dir,
        trainer={"steps": 60},
        # 0.3 s more per step on both ranks: a step long enough that 3 x step + 2 s is met
        # with the 2 s floor this shared CI host needs (its ranks stall for a second now
        # and then; the default floor is 1 s).
        chaos={"slow_ranks": {0: 0.3, 1: 0.3}, "slow_steps": {2: SLOW_S, 8: SLOW_S},
               "kill": [{"step": 45, "rank": 1, "signal": "SIGSTOP"}]},
        timeouts={"training_floor_s": 10, "training_floor_calibrated_s": 2.0,
                  "training_multiplier": 3},
        restart={"max_restarts": 0})
    run_dir = tmp_path / "run"
    result = up(cfg, run_dir, timeout=300)
    assert status(run_dir)["state"] == "FAILED", result.stdout[-4000:]
    events = journal(run_dir)
    [failure] = [e for e in events if e["kind"] == "failure"]  # no false alarm before it
    assert failure["cause"] == "hang" and failure["rank"] == 1, failure
    records = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
    intervals = [b["ts"] - a["ts"] for a, b in zip(records, records[1:])]
    assert max(intervals) >= SLOW_S  # the slow steps happened
    bound = 3 * statistics.median(intervals) + 2.0
    suspect = failure["suspects"][0]
    assert suspect["rank"] == 1 and suspect["timeout_s"] <= bound
    assert suspect["timeout_s"] < 3 * SLOW_S  # the slow step did not set it
    stop = next(e for e in events if e["kind"] == "chaos" and e.get("signal") == "SIGSTOP")
    found = next(e for e in events if e["kind"] == "transition" and e["to"] == "STOPPING")
    # + 0.5 s: the journal's own lag (the chaos event travels through the agent's beat).
    assert found["ts"] - stop["ts"] <= bound + 0.5, (found["ts"] - stop["ts"], bound)
