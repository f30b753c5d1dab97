"""A user's own torchrun-style script under the orchestrator (job.entrypoint), and our
trainer on its own under plain torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jobs import env, journal, status, up, write_config

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "plain_ddp.py"


def test_plain_ddp_script_with_the_sdk_recovers(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"entrypoint": [sys.executable, str(SCRIPT)],
                            "env": {"CKPT": str(tmp_path / "user.pt"), "STEPS": "30"}},
                       chaos={"kill": [{"step": 12, "rank": 1}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED" and st["last_step"] == 30
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    steps = [e for e in journal(tmp_path / "run") if e["kind"] == "first_step"]
    assert steps[1]["step"] == 11  # resumed after its own checkpoint at step 10
    log = (tmp_path / "run" / "logs" / "rank-00000.log").read_text()
    assert "final" in log


def test_trainer_runs_standalone_under_torchrun(tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 12},
                       checkpoint={"url": str(tmp_path / "ckpt"), "interval_steps": 6})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "trainer", "--config", str(cfg)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "step 12/12" in out.stdout
    assert (tmp_path / "ckpt" / "t" / "step-00000012" / "manifest.json").exists()


def test_a_bare_python_entrypoint_runs_on_the_orchestrators_interpreter(
        tmp_path: Path, dataset_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`job.entrypoint: [python, train.py]` with another `python` first on the PATH (an
    unactivated venv): the ranks run on the orchestrator's own interpreter, as torchrun runs
    scripts on its own sys.executable, not on whatever PATH finds."""
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'not the orchestrator python' >&2\nexit 9\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{Path(sys.executable).parent}:/usr/bin:/bin")
    script = Path(__file__).parent / "scripts" / "torchrun_ddp.py"
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"entrypoint": ["python", str(script)], "env": {"STEPS": "6"}},
                       restart={"max_restarts": 1})
    result = up(cfg, tmp_path / "run", timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED" and st["failures"] == [], st["failures"]
    launch = next(e for e in journal(tmp_path / "run") if e["kind"] == "generation_launched")
    assignment = next(iter(launch["assignments"].values()))
    argv = assignment["entrypoint"]
    assert argv[0] == sys.executable and argv[1:] == [str(script)]
    # A script's collectives time out 60 s above its longest hang timeout (start-up and
    # finishing, 300 s), not 60 s above the 1,800 s compiling phase it never reports.
    assert float(assignment["env"]["ORCH_COLLECTIVE_TIMEOUT_S"]) == 360.0


def test_ranks_resuming_from_different_snapshots_are_said_to(
        tmp_path: Path, dataset_dir: Path) -> None:
    """multinode.py's way (rank 0 snapshots into the working directory, every rank resumes
    from it) under a per-node job.workdir: after a kill, rank 0 resumes its optimizer at
    step 10 and rank 1 at 0. The supervisor says so (journal, console, status) from the
    optimizer counts the preload hook reads at each rank's first step."""
    import subprocess

    from jobs import env as job_env
    from jobs import kill_run, wait_for

    script = Path(__file__).parent / "scripts" / "snapshot_ddp.py"
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"entrypoint": [sys.executable, str(script)],
                            "workdir": str(tmp_path / "work" / "{node_id}"),
                            "env": {"STEPS": "400", "KILL_RANK": "1", "KILL_STEP": "12"}},
                       restart={"max_restarts": 1})
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir",
                             str(run), "--log-format", "plain"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=job_env(),
                            start_new_session=True)
    try:
        found = wait_for(lambda: [e for e in journal(run) if e["kind"] == "resume_mismatch"],
                         240, what="the resume mismatch")
        st = status(run)
    finally:
        kill_run(run, proc)
        out = proc.communicate()[0]
    assert found[0]["generation"] == 2 and found[0]["steps"] == {"0": 10, "1": 0}, found
    assert "per-node job.workdir" in found[0]["message"]
    assert st["resume_mismatch"]["generation"] == 2
    assert "ranks resumed from different steps" in out  # the supervisor's log line
    # Generation 1 started from nothing on both ranks: no warning then.
    notes = [e for e in journal(run) if e.get("name") == "optimizer_resume"]
    assert sorted((e["generation"], e["rank"], e["step"]) for e in notes)[:2] == \
        [(1, 0, 0), (1, 1, 0)]
