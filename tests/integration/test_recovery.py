"""The walking skeleton end to end: real supervisor, agents, gloo ranks and checkpoints."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from jobs import (
    assert_bit_identical,
    final_state_dict,
    journal,
    states,
    status,
    up,
    write_config,
)

pytestmark = pytest.mark.slow

STEPS = 40


@pytest.fixture(scope="module")
def clean_run(clean_fast_run: Path) -> Path:
    """One uninterrupted run, the reference for bit-exact comparisons (shared by the
    session)."""
    return clean_fast_run


def test_uninterrupted_run_completes(clean_run: Path) -> None:
    st = status(clean_run)
    assert st["state"] == "COMPLETED"
    assert st["last_step"] == STEPS
    assert st["restarts"] == []
    assert [c["step"] for c in st["checkpoints"]] == [20, 30, 40]  # keep_last 3
    assert states(clean_run) == ["PENDING", "HEALTH_CHECK", "LAUNCHING", "RUNNING", "COMPLETED"]


def test_token_never_reaches_a_log(clean_run: Path) -> None:
    token = (clean_run / "token").read_text().strip()
    checked = 0
    for path in clean_run.rglob("*"):
        if path.is_file() and path.name != "token" and path.suffix in (".log", ".out",
                                                                         ".jsonl", ".json"):
            assert token not in path.read_text(errors="replace"), f"token in {path}"
            checked += 1
    assert checked >= 6  # supervisor log, agent logs, rank logs, journal, steps


def test_two_random_kills_resume_bit_exactly(tmp_path: Path, dataset_dir: Path,
                                             clean_run: Path) -> None:
    rng = random.Random()
    first = rng.randrange(15, 19)  # after the first checkpoint (10), mostly committed by then
    second = rng.randrange(24, 36)
    print(f"chaos kills at steps {first} and {second}")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       chaos={"kill": [{"step": first}, {"step": second}], "seed": first})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED"
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit", "worker_exit"]
    assert all(f["signal"] == "SIGKILL" for f in st["failures"])
    # Each restart resumed from the newest checkpoint committed before it, or from the
    # start when none was (the save at 10 commits in the background: on a fast machine the
    # first kill can come before it has).
    events = journal(tmp_path / "run")
    for g in (2, 3):
        launched = next(e["ts"] for e in events
                        if e["kind"] == "generation_launched" and e["generation"] == g)
        committed = [e["step"] for e in events
                     if e["kind"] == "checkpoint_committed" and e["ts"] < launched]
        resumed = [e["step"] for e in events if e["kind"] == "resumed" and e["generation"] == g]
        assert resumed == ([max(committed)] if committed else []), (g, committed, resumed)
    assert [e for e in events if e["kind"] == "resumed"], "no restart resumed a checkpoint"

    step = f"step-{STEPS:08d}"
    a = final_state_dict(clean_run / "checkpoints" / "t" / step)
    b = final_state_dict(tmp_path / "run" / "checkpoints" / "t" / step)
    n = assert_bit_identical(a, b, ("app.model.", "app.optim.", "progress.", "data.",
                                    "schedule."))
    assert n > 30  # weights, both Adam moments of each, counters


def test_one_crash_journal_state_sequence(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       # Step 16: six steps after the save at 10, time enough for its
                       # commit (digests + signature, ~0.1-0.3 s here) before the kill.
                       trainer={"steps": 25}, chaos={"kill": [{"step": 16, "rank": 1}]},
                       job={"warm_start": True})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    assert states(tmp_path / "run") == [
        "PENDING", "HEALTH_CHECK", "LAUNCHING", "RUNNING", "STOPPING", "RECOVERING",
        "HEALTH_CHECK", "LAUNCHING", "RUNNING", "COMPLETED"]
    events = journal(tmp_path / "run")
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["cause"] == "worker_exit" and failure["rank"] == 1
    assert failure["signal"] == "SIGKILL"
    stopping = next(e for e in events if e["kind"] == "transition" and e["to"] == "STOPPING")
    assert stopping["cause"] == "worker_exit"
    launches = [e for e in events if e["kind"] == "generation_launched"]
    assert [e["generation"] for e in launches] == [1, 2]
    # The restart resumes the newest checkpoint committed before it: step 10's, unless
    # the kill came before its background commit ended (a fast machine), then none.
    committed = [e["step"] for e in events
                 if e["kind"] == "checkpoint_committed" and e["ts"] < launches[1]["ts"]]
    assert committed in ([10], []) and launches[1]["resume_step"] == max(committed, default=None)
    assert "restarts" in result.stdout and "worker_exit x1" in result.stdout
    # The restart ran in pre-imported spare interpreters: no import time the second time.
    startups = {e["generation"]: e for e in events if e["kind"] == "startup"}
    assert startups[1]["warm"] is False and startups[2]["warm"] is True
    imports = {g: e["imports_done"] - e["main"] for g, e in startups.items()}
    assert imports[2] < 0.2 < imports[1], imports


def test_rank_failing_at_start_ends_failed_with_root_cause(tmp_path: Path,
                                                           dataset_dir: Path) -> None:
    """The same exit with the same reason before the first step in two generations in a
    row is a configuration error: FAILED after one restart (not after the restart budget),
    the reason on the root cause's line."""
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       chaos={"fail_at_start_rank": 1},
                       restart={"max_restarts": 10, "max_restarts_without_progress": 5,
                                "backoff_initial_s": 0.1})
    result = up(cfg, tmp_path / "run", timeout=240)
    assert result.returncode == 1, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "FAILED"
    assert len(st["failures"]) == 2
    assert st["failed_reason"].startswith("configuration error: generations 1 and 2 failed "
                                          "the same way before their first step")
    root = st["root_cause"]
    assert root["rank"] == 1 and root["exit_code"] == 3 and root["cause"] == "worker_exit"
    assert any("fail_at_start_rank" in line for line in root["log_tail"])
    assert "fail_at_start_rank" in root["message"]  # the reason, not only "code 3"
    assert "FAILED" in result.stdout and "rank 1" in result.stdout


def test_invalid_config_names_field_and_launches_nothing(tmp_path: Path,
                                                         dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       trainer={"steps": 10, "schedule": {"warmup_steps": 50}})
    result = up(cfg, tmp_path / "run", timeout=60)
    assert result.returncode == 2
    assert "trainer.schedule.warmup_steps" in result.stdout
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_checkpoint_without_manifest_is_never_resumed(tmp_path: Path, dataset_dir: Path) -> None:
    import shutil

    root = tmp_path / "ckpt"
    cfg = write_config(tmp_path / "a.yaml", dataset_dir, trainer={"steps": 20},
                       checkpoint={"url": str(root)})
    assert up(cfg, tmp_path / "run-a").returncode == 0
    job = root / "t"
    # A save killed midway: every DCP file of a newer step, but no manifest.
    shutil.copytree(job / "step-00000020", job / "step-00000030")
    (job / "step-00000030" / "manifest.json").unlink()
    cfg = write_config(tmp_path / "b.yaml", dataset_dir, trainer={"steps": 40},
                       checkpoint={"url": str(root)})
    result = up(cfg, tmp_path / "run-b")
    assert result.returncode == 0, result.stdout[-4000:]
    resumed = [e for e in journal(tmp_path / "run-b") if e["kind"] == "resumed"]
    assert [e["step"] for e in resumed] == [20]
    # The debris was replaced by a real, committed step 30.
    assert (job / "step-00000030" / "manifest.json").exists()
