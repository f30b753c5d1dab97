"""Messages an operator acts on say what is true now: no Python ``None``, no number of the
generation before, a command that finds nothing says so and exits non-zero, a typoed key
gets a "did you mean", every malformed ``--set`` is reported, and a directory that holds a
live job is not advised to be resumed."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts import events as ev
from orchestrator.cli.ranklogs import show_logs
from orchestrator.config import ConfigError, load_config
from orchestrator.cli.console import JobFollower, describe
from orchestrator.journal.view import JobView
from orchestrator.journal.store import Journal
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.state import Cause, JobState
from orchestrator.cli.summary import build_summary


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd,
                          capture_output=True, text=True, env={**env, "COLUMNS": "250"},
                          timeout=120)


def _journal(run: Path, *events: ev.Event) -> None:
    run.mkdir(parents=True, exist_ok=True)
    journal = Journal(run / "events.jsonl")
    for e in events:
        journal.append(e, durable=True)
    journal.close()


def _moves(*states: JobState, cause: Cause | None = None) -> list[ev.Event]:
    out, prev = [], JobState.PENDING
    for s in states:
        out.append(ev.Transition(**{"from": prev}, to=s,
                                 cause=cause if s in (JobState.STOPPING, JobState.STOPPED)
                                 else None))
        prev = s
    return out


# -- the story of a stopped and continued job ---------------------------------------------------

def _stopped_then_continued() -> list[ev.Event]:
    return [
        ev.JobCreated(job="t", world_size=2, nodes=2, steps=100),
        *_moves(JobState.HEALTH_CHECK, JobState.LAUNCHING),
        ev.GenerationLaunched(generation=1, world_size=2),
        ev.Transition(**{"from": JobState.LAUNCHING}, to=JobState.RUNNING),
        ev.CheckpointCommitted(generation=1, step=46),
        ev.Transition(**{"from": JobState.RUNNING}, to=JobState.STOPPING, cause=Cause.OPERATOR),
        ev.Transition(**{"from": JobState.STOPPING}, to=JobState.STOPPED, cause=Cause.OPERATOR),
        ev.Transition(**{"from": JobState.STOPPED}, to=JobState.PENDING),
        ev.Transition(**{"from": JobState.PENDING}, to=JobState.HEALTH_CHECK),
        ev.Transition(**{"from": JobState.HEALTH_CHECK}, to=JobState.LAUNCHING),
        ev.GenerationLaunched(generation=2, world_size=2, after_cause=Cause.OPERATOR,
                              resume_step=46),
    ]


def test_a_continued_job_is_no_restart_and_never_launched_after_none() -> None:
    view = JobView.from_events(
        {"seq": i, "ts": 1000.0 + i, **e.model_dump(mode="json", by_alias=True)}
        for i, e in enumerate(_stopped_then_continued()))
    assert view.restarts == []  # no restart budget spent by an operator's stop
    assert view.ended_by is Cause.OPERATOR
    line = describe({"kind": "generation_launched", "generation": 2, "after_cause": "operator",
                     "resume_step": 46})
    assert line == ("info", "continued: generation 2 launched from checkpoint 46 after the stop")
    for after in (None, "", 7):
        _, text = describe({"kind": "generation_launched", "generation": 2,
                            "after_cause": after, "resume_step": 46})
        assert "None" not in text and "after" not in text, text
    level, text = describe({"kind": "generation_launched", "generation": 3,
                            "after_cause": "worker_exit", "resume_step": 50})
    assert (level, text) == ("warning", "restart: generation 3 launched from checkpoint 50 "
                                        "after worker_exit")


def test_the_summary_counts_no_restart_for_a_stop(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _journal(run, *_stopped_then_continued())
    summary = build_summary(JobView.from_events(
        json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()),
        RunDir(run))
    assert summary["restarts"] == 0 and summary["causes"] == {}


def test_the_live_line_shows_the_new_generation_not_the_old_ones_numbers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _journal(run, ev.JobCreated(job="t", world_size=2, steps=100),
             ev.GenerationLaunched(generation=1, world_size=2))
    steps = run / "steps.jsonl"
    steps.write_text("".join(json.dumps({"step": s, "loss": 2.0 - s / 100, "ts": 100.0 + s,
                                         "tokens": 512 * s, "generation": 1}) + "\n"
                             for s in range(1, 61)))
    follower = JobFollower(run)
    follower.poll()
    assert follower.progress.step == 60 and follower.progress.loss == pytest.approx(1.4)
    journal = Journal(run / "events.jsonl")
    journal.append(ev.GenerationLaunched(generation=2, world_size=2,
                                         after_cause=Cause.WORKER_EXIT, resume_step=50))
    journal.close()
    with open(steps, "a") as f:  # generation 1's last records, read after the launch
        f.write(json.dumps({"step": 61, "loss": 1.3, "ts": 161.0, "tokens": 1,
                            "generation": 1}) + "\n")
    follower.poll()
    p = follower.progress
    assert (p.generation, p.step, p.loss, p.tokens_per_s) == (2, 50, None, None)
    with open(steps, "a") as f:
        f.write(json.dumps({"step": 51, "loss": 1.45, "ts": 200.0, "tokens": 9,
                            "generation": 2}) + "\n")
    follower.poll()
    assert (p.step, p.loss, p.restarts) == (51, 1.45, 1)


# -- config problems ---------------------------------------------------------------------------

def test_a_typoed_key_gets_a_did_you_mean() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["checkpoint.keep_lastt=2", "trainer.schedule.warmup_stepss=3",
                           "job.zzz=1"])
    by_path = {p.path: p.message for p in exc.value.problems}
    assert by_path["checkpoint.keep_lastt"].endswith("; did you mean keep_last?")
    assert by_path["trainer.schedule.warmup_stepss"].endswith("; did you mean warmup_steps?")
    assert by_path["job.zzz"] == "unknown key (not in the schema)"


def test_every_malformed_set_is_reported_with_the_others_problems() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["nodots", "=3", "trainer.steps=[", "cluster.nodes=0",
                           "trainer.stepz=4"])
    paths = [p.path for p in exc.value.problems]
    assert paths[:3] == ["nodots", "=3", "trainer.steps"]
    assert {"cluster.nodes", "trainer.stepz"} <= set(paths)
    assert all("\n" not in p.message for p in exc.value.problems)


# -- commands that find nothing ----------------------------------------------------------------

def _two_rank_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    _journal(run, ev.JobCreated(job="t", world_size=2, steps=100,
                                checkpoint_root=str(run / "checkpoints")))
    return run


def test_logs_of_a_rank_the_job_does_not_have_is_an_error(tmp_path: Path) -> None:
    run = _two_rank_run(tmp_path)
    (run / "logs").mkdir()
    (run / "logs" / "rank-00000.log").write_text("hello\n")
    bad = _cli("logs", str(run), "--rank", "7")
    assert bad.returncode == 1 and "no rank 7" in bad.stderr and "ranks 0-1" in bad.stderr
    empty = _cli("logs", str(run), "--rank", "1")
    assert empty.returncode == 1 and "no log lines of rank 1" in empty.stderr, empty.stderr
    ok = _cli("logs", str(run))
    assert ok.returncode == 0 and ok.stdout == "[rank0]: hello\n"


def test_logs_all_goes_generation_by_generation_with_one_prefix(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()

    def header(gen: int, rank: int) -> str:
        return f"==== generation {gen} rank {rank} started 2026-11-22 18:0{gen}:00 ===="

    (logs / "rank-00000.log").write_text("\n".join(
        [header(1, 0), "a1", header(2, 0), "a2"]) + "\n")
    (logs / "rank-00001.log").write_text("\n".join(
        [header(1, 1), "[rank1]: RuntimeError: boom", header(2, 1), "b2"]) + "\n")
    out = io.StringIO()
    assert show_logs(logs, None, None, False, lambda: True, out=out) == 0
    assert out.getvalue().splitlines() == [
        f"[rank0]: {header(1, 0)}", "[rank0]: a1",
        f"[rank1]: {header(1, 1)}", "[rank1]: RuntimeError: boom",
        f"[rank0]: {header(2, 0)}", "[rank0]: a2",
        f"[rank1]: {header(2, 1)}", "[rank1]: b2"]


def test_checkpoints_list_takes_a_run_directory_and_says_when_there_is_none(
        tmp_path: Path) -> None:
    run = _two_rank_run(tmp_path)
    named = _cli("checkpoints", "list", str(run))
    assert named.returncode == 1, named.stdout + named.stderr
    assert f"no checkpoints under {run}/checkpoints/t" in named.stderr
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").symlink_to(run)
    default = _cli("checkpoints", "list", cwd=tmp_path)  # runs/latest, as status and logs
    assert default.returncode == 1 and "no checkpoints under" in default.stderr, default.stderr
    nowhere = _cli("checkpoints", "list", cwd=tmp_path / "runs")
    assert nowhere.returncode == 2 and "not a run directory" in nowhere.stderr


# -- a run directory that holds a job ----------------------------------------------------------

def test_up_on_a_live_jobs_directory_says_follow_or_stop_not_resume(tmp_path: Path) -> None:
    run = _two_rank_run(tmp_path)
    journal = Journal(run / "events.jsonl")
    for e in _moves(JobState.HEALTH_CHECK, JobState.LAUNCHING, JobState.RUNNING):
        journal.append(e)
    journal.close()
    # A process standing in for the live supervisor (liveness asks its pid and command line).
    stand_in = subprocess.Popen([sys.executable, "-c",
                                 "import time; time.sleep(120)  # orchestrator supervisor"])
    try:
        (run / "supervisor.json").write_text(json.dumps({"pid": stand_in.pid, "port": 1}))
        live = _cli("up", "--run-dir", str(run))
        assert live.returncode == 2
        said = " ".join(live.stderr.split())
        assert "follow it" in said and f"orchestrator down {run}" in said, said
        assert "--resume" not in said
    finally:
        stand_in.kill()
        stand_in.wait()
    journal = Journal(run / "events.jsonl")
    journal.append(ev.Transition(**{"from": JobState.RUNNING}, to=JobState.STOPPING,
                                 cause=Cause.OPERATOR))
    journal.append(ev.Transition(**{"from": JobState.STOPPING}, to=JobState.STOPPED,
                                 cause=Cause.OPERATOR))
    journal.close()
    stopped = _cli("up", "--run-dir", str(run))
    assert stopped.returncode == 2
    assert f"orchestrator up --resume {run}" in " ".join(stopped.stderr.split())


def test_a_failure_before_any_generation_prints_no_none() -> None:
    level, text = describe({"kind": "failure", "cause": "config", "generation": None,
                            "rank": None, "node_id": None,
                            "message": "the Slurm allocation has 1 node(s)"})
    assert (level, text) == ("error", "the job cannot start: config: the Slurm allocation "
                                      "has 1 node(s)")


_KINDS = ["transition", "failure", "generation_launched", "stability", "rollback",
          "node_state", "checkpoint_failed", "checkpoint_skipped", "checkpoint_committed",
          "supervisor_started", "resume_mismatch"]
_FIELDS = ["generation", "rank", "node_id", "cause", "message", "after_cause", "resume_step",
           "from", "to", "reason", "step", "event", "action", "state", "error", "tier",
           "restore_step", "onset_step", "skip_window", "pid", "url"]


@settings(max_examples=1500, deadline=None)
@given(kind=st.sampled_from(_KINDS),
       fields=st.dictionaries(st.sampled_from(_FIELDS),
                              st.none() | st.integers(-5, 10**6) | st.text(max_size=20),
                              max_size=10))
def test_no_human_line_prints_a_python_none(kind: str, fields: dict) -> None:
    """Whatever a journal line leaves out or sets to null, the console says something
    meaningful instead of Python's None (after None, generation None, rank None)."""
    for verbose in (False, True):
        said = describe({"kind": kind, **fields}, verbose=verbose)
        if said is not None:
            text = said[1]
            planted = any(v is not None and "None" in str(v) for v in fields.values())
            assert planted or "None" not in text, text


def test_validate_names_the_script_a_job_runs_not_the_trainers_model(tmp_path: Path) -> None:
    script = tmp_path / "job.yaml"
    script.write_text("job: {name: s, entrypoint: [python, train.py, --epochs, '3']}\n")
    said = _cli("validate", str(script))
    assert said.returncode == 0, said.stderr
    line = " ".join(said.stdout.split())
    assert "runs python train.py --epochs 3" in line and "model" not in line, line
    assert "steps" not in line
    (tmp_path / "ours.yaml").write_text("trainer: {steps: 200}\n")
    ours = _cli("validate", str(tmp_path / "ours.yaml"))
    assert "model tiny, 200 steps" in " ".join(ours.stdout.split())
