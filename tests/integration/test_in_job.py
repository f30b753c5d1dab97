"""In-job recovery end to end: real supervisor, agents, gloo ranks, warm standbys.

A rank's death or hang is recovered in place: the surviving ranks keep their processes (the
journal's pids do not change), roll back to the newest state every rank holds, and train on
with the replacement; the job ends bit-identical to an uninterrupted run. When the in-place
recovery itself fails, the job falls back to a full restart, still bit-exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
IN_JOB = {"in_job": True}
WARM = {"warm_start": True}  # the product's default: warm standbys replace dead ranks
PREFIXES = ("app.model.", "app.optim.", "progress.", "data.", "schedule.")
# Fast hang detection, as the hang tests have it: max(2 s, 3 x the largest step).
HANG_TIMEOUTS = {"training_floor_s": 2.0, "training_multiplier": 3.0}
# The agent starts a generation's standbys once its ranks have stepped (it looks every
# 0.5 s); these steps take milliseconds, and under load a kill at step 17 came before the
# standby existed: the replacement started cold, as it should without one. A slow third
# step in every generation lets the standby start before the kill a test expects it for.
SPARE_TIME = {3: 3.0}
# A kill at step 17 rolls back to the checkpoint of step 10, whose commit (0.06-0.09 s here,
# 0.28 s under the suite's load) raced the seven millisecond steps after it: committed 0.03 s
# after the failure was decided, it was fenced as the deposed generation's write, the
# survivor found nothing to roll back to, and the job restarted in full (as it should). A
# slow step 16 lets the commit land first where a test is about the in-place path.
COMMIT_TIME = {16: 1.0}


@pytest.fixture(scope="module")
def reference(clean_fast_run: Path) -> dict:
    """The final state of the FAST job run uninterrupted (shared by the session)."""
    return final_state_dict(clean_fast_run / "checkpoints" / "t" / f"step-{STEPS:08d}")


def pids(events: list[dict[str, Any]], generation: int) -> dict[int, int]:
    """rank -> pid of ``generation``, from the agents' ``ranks_started``."""
    return {r["rank"]: r["pid"] for e in events if e["kind"] == "ranks_started"
            and e["generation"] == generation for r in e["ranks"]}


def failures(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "failure"]


def recovered_once_in_place(cfg: Path, run: Path
                            ) -> tuple[Path, list[dict[str, Any]], dict[str, Any]]:
    """Run the job to its end; it failed once and recovered in place, with no health check
    and no stop (the survivors, if any, went straight on). Its run, journal and failure."""
    result = up(cfg, run)
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(run)
    (failure,) = failures(events)
    assert failure["recovery_path"] == "in_job", failure["recovery_reason"]
    assert states(run) == ["PENDING", "HEALTH_CHECK", "LAUNCHING", "RUNNING", "STOPPING",
                           "RECOVERING", "LAUNCHING", "RUNNING", "COMPLETED"]
    return run, events, failure


def check_final(run: Path, reference: dict) -> None:
    final = final_state_dict(run / "checkpoints" / "t" / f"step-{STEPS:08d}")
    assert assert_bit_identical(reference, final, PREFIXES) > 30


def test_sigkill_recovered_in_place_with_a_standby(tmp_path: Path, dataset_dir: Path,
                                                   reference: dict) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, restart=IN_JOB, job=WARM,
                       chaos={"kill": [{"step": 17, "rank": 1}],
                              "slow_steps": {**SPARE_TIME, **COMMIT_TIME}})
    run, events, failure = recovered_once_in_place(cfg, tmp_path / "run")
    assert failure["cause"] == "worker_exit" and failure["rank"] == 1
    launches = [e for e in events if e["kind"] == "generation_launched"]
    assert launches[1]["in_place"] is True and launches[1]["replaced"] == [1]
    first, second = pids(events, 1), pids(events, 2)
    assert second[0] == first[0], "the surviving rank was restarted"
    assert second[1] != first[1]
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert [e["rank"] for e in recovered] == [0]
    assert recovered[0]["abandoned_step"] >= 17 and recovered[0]["step"] == 10
    # Where the survivor's first second went: the order's arrival against the failed
    # collective, and the aborts of its gloo groups (default, checkpoint, control).
    assert abs(recovered[0]["order_lag_s"]) < 60
    aborted = recovered[0]["group_aborts"].split()
    assert len(aborted) == 3 and all(a.startswith("gloo:") for a in aborted), aborted
    assert not [e for e in events if e["kind"] == "ranks_stopped"]
    # The replacement's start-up breakdown is its own to send (rank 1's): nothing refused.
    assert [e["rank"] for e in events if e["kind"] == "startup" and e["generation"] == 2] \
        == [1]
    assert not [e for e in events if e["kind"] == "message_rejected"]
    # The replacement started in the warm standby the agent kept for local rank 0.
    log = (run / "logs" / "rank-00001.log").read_text()
    assert "generation 2 rank 1 started" in log and "(warm spare)" in log.split(
        "generation 2 rank 1 started")[1].splitlines()[0]
    assert "rejoins in place" in (run / "logs" / "rank-00000.log").read_text()
    st = status(run)
    assert st["state"] == "COMPLETED" and st["last_step"] == STEPS
    check_final(run, reference)


def test_the_next_groups_are_made_while_the_old_ones_still_abort(
        tmp_path: Path, dataset_dir: Path, reference: dict) -> None:
    """A slow abort (NCCL's takes about half a second; chaos makes gloo's take 3 s) does not
    hold the survivor back: it leaves the old groups to their abort, makes the next
    generation's meanwhile, and the job still ends bit-identical."""
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, restart=IN_JOB, job=WARM,
                       chaos={"kill": [{"step": 17, "rank": 1}], "slow_abort_s": 3.0,
                              "slow_steps": COMMIT_TIME})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "run"
    events = journal(run)
    (failure,) = failures(events)
    assert failure["recovery_path"] == "in_job", failure["recovery_reason"]
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    assert pids(events, 2)[0] == pids(events, 1)[0]
    # It left the old groups and began making the next ones (its device picked, the
    # rendezvous next) before the default group's abort ended, 3 s after the order.
    assert recovered["overlapped"] is True, recovered
    assert recovered["at_left"] < recovered["at_device_ready"] < recovered["at_order"] + 3.0
    if "at_abort_end" in recovered:
        assert recovered["at_abort_end"] >= recovered["at_order"] + 3.0
        assert recovered["group_aborts"].split()[-1].startswith("gloo:3."), recovered
    else:
        assert recovered["aborts_running"] is True, recovered
    check_final(run, reference)

    # The same fault with overlap_abort off: the survivor waits for the abort.
    cfg = write_config(tmp_path / "job2.yaml", dataset_dir, restart=IN_JOB, job=WARM,
                       trainer={"parallelism": {"overlap_abort": False}},
                       chaos={"kill": [{"step": 17, "rank": 1}], "slow_abort_s": 3.0,
                              "slow_steps": COMMIT_TIME})
    result = up(cfg, tmp_path / "run2")
    assert result.returncode == 0, result.stdout[-4000:]
    (recovered,) = [e for e in journal(tmp_path / "run2") if e["kind"] == "recovered"]
    assert "overlapped" not in recovered and "aborts_running" not in recovered
    assert recovered["at_left"] >= recovered["at_abort_end"] >= recovered["at_order"] + 3.0
    check_final(tmp_path / "run2", reference)


def test_sigstop_hang_recovered_in_place(tmp_path: Path, dataset_dir: Path,
                                         reference: dict) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, restart=IN_JOB, job=WARM,
                       timeouts=HANG_TIMEOUTS,
                       chaos={"kill": [{"step": 23, "rank": 1, "signal": "SIGSTOP"}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "run"
    events = journal(run)
    (failure,) = failures(events)
    assert failure["cause"] == "hang" and failure["rank"] == 1
    assert failure["recovery_path"] == "in_job", failure["recovery_reason"]
    assert failure["stacks"], "stacks are still dumped before the hung rank is replaced"
    first, second = pids(events, 1), pids(events, 2)
    assert second[0] == first[0] and second[1] != first[1]
    check_final(run, reference)


def test_memory_tier_rollback_picks_the_step_every_rank_holds(tmp_path: Path,
                                                              dataset_dir: Path,
                                                              reference: dict) -> None:
    # A memory copy every step: the killed rank may die before its newest copy commits
    # while the survivor's has; the rollback takes the newest step both hold.
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, restart=IN_JOB, job=WARM,
                       checkpoint={"memory_interval_steps": 1},
                       chaos={"kill": [{"step": 26, "rank": 1}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "run"
    events = journal(run)
    (failure,) = failures(events)
    assert failure["recovery_path"] == "in_job", failure["recovery_reason"]
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    # Its own copy, or its partner's where its own of that step was not committed.
    assert recovered["tier"] in ("memory", "memory_partner"), recovered
    assert recovered["step"] in (25, 26), recovered  # not the durable tier's 20
    assert pids(events, 2)[0] == pids(events, 1)[0]
    check_final(run, reference)


def test_a_standby_takes_over_twice_in_a_row(tmp_path: Path, dataset_dir: Path,
                                             reference: dict) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, restart=IN_JOB, job=WARM,
                       checkpoint={"memory_interval_steps": 2},
                       chaos={"kill": [{"step": 15, "rank": 1}, {"step": 31, "rank": 1}],
                              "slow_steps": SPARE_TIME})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "run"
    events = journal(run)
    assert [f["recovery_path"] for f in failures(events)] == ["in_job", "in_job"]
    gens = [pids(events, g) for g in (1, 2, 3)]
    assert gens[0][0] == gens[1][0] == gens[2][0], "rank 0 was restarted"
    assert len({g[1] for g in gens}) == 3
    log = (run / "logs" / "rank-00001.log").read_text()
    for generation in (2, 3):
        header = log.split(f"generation {generation} rank 1 started")[1].splitlines()[0]
        assert "(warm spare)" in header, header
    check_final(run, reference)


@pytest.mark.parametrize("signal", ["SIGKILL", "SIGSTOP"])
def test_a_one_rank_jobs_death_is_taken_over_by_its_standby(tmp_path: Path,
                                                             dataset_dir: Path,
                                                             signal: str) -> None:
    """One node, one rank: its death or hang is recovered in place too. No survivor rolls
    back; the standby takes the rank over (a stopped rank is killed first) and restores the
    memory tier's copy the agent kept (not the durable tier's older step), ending
    bit-identical to an uninterrupted one-rank run."""
    one = {"cluster": {"nodes": 1}, "checkpoint": {"memory_interval_steps": 5}}
    clean = write_config(tmp_path / "clean.yaml", dataset_dir, **one)
    assert up(clean, tmp_path / "clean").returncode == 0
    # The hang is judged after 4 s: each generation's slow third step (3 s) is no hang.
    hang = {"timeouts": {**HANG_TIMEOUTS, "training_floor_s": 4.0}} \
        if signal == "SIGSTOP" else {}
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, restart=IN_JOB, job=WARM, **one,
                       **hang, chaos={"kill": [{"step": 17, "rank": 0, "signal": signal}],
                                      "slow_steps": SPARE_TIME})
    run, events, failure = recovered_once_in_place(cfg, tmp_path / "run")
    assert "only rank" in failure["recovery_reason"]
    assert failure["cause"] == ("hang" if hang else "worker_exit") and failure["rank"] == 0
    if hang:  # its stacks read from outside; it stayed stopped until its kill
        (stack,) = failure["stacks"]
        assert "stacks read from outside by py-spy" in Path(stack).read_text()
        assert not [e for e in events if e["kind"] == "checkpoint_committed"
                    and e["generation"] == 1 and e["step"] > 17]
    assert pids(events, 2)[0] != pids(events, 1)[0]
    header = (run / "logs" / "rank-00000.log").read_text().split(
        "generation 2 rank 0 started")[1].splitlines()[0]
    assert "(warm spare)" in header, header
    (restored,) = [e for e in events if e["kind"] == "restore_tier" and e["generation"] == 2]
    assert restored["tier"] == "memory" and restored["step"] == 15, restored
    reference = final_state_dict(tmp_path / "clean" / "checkpoints" / "t" / f"step-{STEPS:08d}")
    check_final(run, reference)


def test_a_failed_in_place_recovery_falls_back_to_a_full_restart(tmp_path: Path,
                                                                 dataset_dir: Path,
                                                                 reference: dict) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, restart=IN_JOB, job=WARM,
                       chaos={"kill": [{"step": 17, "rank": 1}], "fail_rejoin_rank": 0,
                              "slow_steps": COMMIT_TIME})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    run = tmp_path / "run"
    events = journal(run)
    paths = [(f["generation"], f["recovery_path"]) for f in failures(events)]
    assert paths == [(1, "in_job"), (2, "restart")], paths
    second = failures(events)[1]
    assert "failed before its first step" in second["recovery_reason"]
    assert any(e["kind"] == "recovery_failed" and "fail_rejoin_rank" in e.get("error", "")
               for e in events)
    # The restart: every rank in a new process, after a health check.
    assert pids(events, 3)[0] != pids(events, 1)[0]
    assert "HEALTH_CHECK" in states(run)[5:]
    check_final(run, reference)


def test_in_job_off_restarts_every_rank(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 20},
                       chaos={"kill": [{"step": 13, "rank": 1}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(tmp_path / "run")
    (failure,) = failures(events)
    assert failure["recovery_path"] == "restart"
    assert failure["recovery_reason"] == "restart.in_job is off"
    assert pids(events, 2)[0] != pids(events, 1)[0]
