"""Profiling on demand in real jobs: `orchestrator profile` while our trainer (FSDP2 over
gloo, 2 nodes) and a user's own SDK script train, the traces every rank writes at the same
step, what `status` lists, and the operator's mistakes answered with clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import env, journal, kill_run, kill_strays, status, wait_for, write_config

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "plain_ddp.py"


def _orchestrator(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                          text=True, env=env(), timeout=timeout)


def _start(cfg: Path, run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg),
                             "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env(),
                            start_new_session=True)


def _running_at_step(run: Path, step: int) -> bool:
    events = journal(run)
    running = any(e["kind"] == "transition" and e["to"] == "RUNNING" for e in events)
    progress = [e["step"] for e in events if e["kind"] in ("progress", "first_step")]
    return running and max(progress, default=0) >= step


def _trace_events(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["traceEvents"]


def _stop(run: Path, proc: subprocess.Popen) -> None:
    down = _orchestrator("down", str(run), "--no-checkpoint", "--timeout", "120")
    proc.communicate(timeout=200)
    assert down.returncode == 0, down.stderr[-2000:]


def test_profile_the_trainer_on_every_rank_at_the_same_step(tmp_path: Path,
                                                            dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 100_000},
                       checkpoint={"interval_steps": 1000})
    run = tmp_path / "run"
    proc = _start(cfg, run)
    try:
        wait_for(lambda: _running_at_step(run, 3), timeout=240, what="training")
        # The operator's mistakes first: each a clear error, nothing ordered.
        zero = _orchestrator("profile", str(run), "--steps", "0")
        assert zero.returncode == 2 and "--steps" in zero.stderr
        huge = _orchestrator("profile", str(run), "--steps", "100000")
        assert huge.returncode == 2 and "200" in huge.stderr
        unknown = _orchestrator("profile", str(run), "--steps", "2", "--ranks", "5")
        assert unknown.returncode == 2, unknown.stderr
        assert "unknown rank 5: the job has ranks 0..1" in " ".join(unknown.stderr.split())
        assert not [e for e in journal(run) if e["kind"] == "profile_requested"]

        done = _orchestrator("profile", str(run), "--steps", "3", "--wait", "--timeout", "240")
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
        assert "rank 0:" in done.stdout and "rank 1:" in done.stdout
        st = status(run)
    finally:
        try:
            _stop(run, proc)
        except BaseException:
            kill_run(run, proc)
            raise
        finally:
            kill_strays(run)
    events = journal(run)
    [asked] = [e for e in events if e["kind"] == "profile_requested"]
    assert asked["ranks"] == [0, 1] and asked["steps"] == 3
    written = {e["rank"]: e for e in events if e["kind"] == "profile_written"}
    assert set(written) == {0, 1}
    start = asked["start_step"]
    for rank, w in written.items():
        # Every rank started at the step the supervisor chose: the same steps everywhere.
        assert (w["first_step"], w["last_step"]) == (start, start + 2), w
        path = run / "profiles" / str(start) / f"rank-{rank}" / "trace.json"
        assert w["path"] == str(path) and w["bytes"] == path.stat().st_size
        names = {e.get("name") for e in _trace_events(path)}
        assert {f"ProfilerStep#{s}" for s in (start, start + 1, start + 2)} <= names
        assert any(str(n).startswith("aten::") for n in names)
        assert any("all_gather" in str(n) or "reduce_scatter" in str(n) for n in names), \
            "FSDP2's collectives are in the trace"
    [listed] = st["profiles"]
    assert (listed["state"], listed["written"], listed["ranks"]) == ("written", 2, 2)
    assert listed["late_ranks"] == [] and listed["dir"] == str(run / "profiles" / str(start))
    # The step-time breakdown is in rank 0's step records.
    rec = json.loads((run / "steps.jsonl").read_text().splitlines()[5])
    assert {"data_s", "fwd_bwd_s", "optim_s", "step_time"} <= set(rec)
    assert rec["data_s"] + rec["fwd_bwd_s"] + rec["optim_s"] <= rec["step_time"]
    # After the job: no running job to profile.
    late = _orchestrator("profile", str(run), "--steps", "2")
    assert late.returncode == 1 and "no running job" in late.stderr


def test_profile_one_rank_of_a_users_sdk_script(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"entrypoint": [sys.executable, str(SCRIPT)],
                            "env": {"CKPT": str(tmp_path / "user.pt"), "STEPS": "1000000"}})
    run = tmp_path / "run"
    proc = _start(cfg, run)
    try:
        wait_for(lambda: _running_at_step(run, 3), timeout=240, what="training")
        done = _orchestrator("profile", str(run), "-n", "2", "-r", "1", "--wait",
                             "--timeout", "240")
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    finally:
        try:
            _stop(run, proc)
        except BaseException:
            kill_run(run, proc)
            raise
        finally:
            kill_strays(run)
    events = journal(run)
    [asked] = [e for e in events if e["kind"] == "profile_requested"]
    [written] = [e for e in events if e["kind"] == "profile_written"]
    assert asked["ranks"] == [1] and written["rank"] == 1
    start = asked["start_step"]
    assert (written["first_step"], written["last_step"]) == (start, start + 1)
    assert sorted(p.name for p in (run / "profiles" / str(start)).iterdir()) == ["rank-1"]
    names = {e.get("name") for e in _trace_events(Path(written["path"]))}
    assert "aten::addmm" in names or "aten::linear" in names


def test_profile_a_script_that_knows_nothing_of_the_orchestrator(tmp_path: Path,
                                                                 dataset_dir: Path) -> None:
    """No SDK at all: the preload hook counts the optimizer steps, and its worker takes the
    order at the same step boundaries."""
    script = Path(__file__).parent / "scripts" / "torchrun_ddp.py"
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"entrypoint": [sys.executable, str(script)],
                            "env": {"STEPS": "1000000", "STEP_S": "0.01"}})
    run = tmp_path / "run"
    proc = _start(cfg, run)
    try:
        wait_for(lambda: _running_at_step(run, 3), timeout=240, what="training")
        done = _orchestrator("profile", str(run), "-n", "2", "--wait", "--timeout", "240")
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    finally:
        try:
            _stop(run, proc)
        except BaseException:
            kill_run(run, proc)
            raise
        finally:
            kill_strays(run)
    events = journal(run)
    [asked] = [e for e in events if e["kind"] == "profile_requested"]
    written = {e["rank"]: e for e in events if e["kind"] == "profile_written"}
    assert set(written) == {0, 1}
    for w in written.values():
        assert (w["first_step"], w["last_step"]) == (asked["start_step"],
                                                     asked["start_step"] + 1)
        names = {e.get("name") for e in _trace_events(Path(w["path"]))}
        assert f"ProfilerStep#{asked['start_step']}" in names
