"""Worker-side skip-step on a 2-rank DDP run: the poisoned step's optimizer update is skipped
on every rank, so the replicas stay identical; a crash before it proves the guard's state rides
in the checkpoint (a fresh guard would still be filling its window at the poisoned step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import final_state_dict, journal, status, up, write_config

pytestmark = pytest.mark.slow

STEPS = 40
POISON = 24  # global batch trained at step 25


def test_skip_step_skips_the_update_on_every_rank(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(
        tmp_path / "job.yaml", dataset_dir,
        # DDP: every rank holds the full parameters, so ranks can be compared directly.
        trainer={"parallelism": {"strategy": "ddp"}},
        stability={"grad_spike": {"mode": "relative", "rel_margin": 4.0,
                                  "action": "skip_step"}},
        # Killed at step 22, generation 2 restores everything, the guard too, from step 20,
        # and meets the poisoned batch with a full window. No restore follows the skip, so
        # replicas that disagreed about it would still disagree at the end.
        chaos={"poison_batches": [POISON], "kill": [{"step": 22, "rank": 1}]})
    run = tmp_path / "run"
    result = up(cfg, run)
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(run)
    assert st["state"] == "COMPLETED"
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]  # no rollback, one crash
    assert st["stability"]["updates_skipped"] == 1

    records = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    skipped = [(r["generation"], r["step"], r["batch"]) for r in records if r.get("skipped")]
    assert skipped == [(2, POISON + 1, POISON)]
    events = journal(run)
    fired = [(e["event"], e["step"], e["action"]) for e in events if e["kind"] == "stability"
             and e["event"] in ("grad_spike", "update_skipped")]
    assert fired == [("grad_spike", POISON + 1, "skip_step"),
                     ("update_skipped", POISON + 1, "skip_step")]

    # Every rank reports a checksum of its own parameters at the end: identical replicas.
    digests = {e["rank"]: e["crc32"] for e in events
               if e["kind"] == "worker_event" and e.get("name") == "params_digest"
               and e["generation"] == 2}
    assert sorted(digests) == [0, 1]
    assert digests[0] == digests[1]

    # Exactly one optimizer update was skipped over the whole run: Adam counted 39 steps
    # while the run made 40.
    state = final_state_dict(run / "checkpoints" / "t" / f"step-{STEPS:08d}")
    assert state["progress.step"] == STEPS
    adam_steps = {float(v) for k, v in state.items()
                  if k.startswith("app.optim.state.") and k.endswith(".step")}
    assert adam_steps == {STEPS - 1.0}
