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
                       restart={"in_job": True},
                       chaos={"kill": [{"step": 12, "rank": 1}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED" and st["last_step"] == 30
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    # A script that registered no state for in-job recovery gets the full restart.
    (failure,) = [e for e in journal(tmp_path / "run") if e["kind"] == "failure"]
    assert failure["recovery_path"] == "restart"
    assert "rank(s) [0] cannot rejoin in place" in failure["recovery_reason"]
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


INJOB_SCRIPT = Path(__file__).parent / "scripts" / "injob_ddp.py"


def _injob_reference(steps: int) -> str:
    """injob_ddp.py's final weights, uninterrupted, computed here: DDP averages the two
    ranks' gradients as ``g0 / 2 + g1 / 2`` (each bucket divided by the world size, then
    summed; a sum of two is the same either way round), then Adam steps."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("injob_ddp", INJOB_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for step in range(steps):
        grads = []
        for rank in (0, 1):
            x = mod.batch(step, rank)
            net.zero_grad()
            (net(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
            grads.append([p.grad.detach().clone() for p in net.parameters()])
        for p, g0, g1 in zip(net.parameters(), grads[0], grads[1], strict=True):
            p.grad = g0 / 2 + g1 / 2
        opt.step()
    data = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return data.numpy().tobytes().hex()


def _final(log: str) -> str:
    return next(line.split()[1] for line in log.splitlines() if line.startswith("final "))


def test_a_script_with_the_sdk_recovers_in_place(tmp_path: Path, dataset_dir: Path) -> None:
    """ow.recoverable: a kill before any memory copy exists cannot be recovered in place
    (the survivor says why and the job restarts in full); a later kill is: the rank whose
    peer died stays alive, rolls back to the step both hold in the memory tier, rebuilds its
    DDP wrapper in the new group, and the replacement runs the script in a warm spare. The
    job ends bit-identical to an uninterrupted run."""
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       job={"entrypoint": [sys.executable, str(INJOB_SCRIPT)],
                            "env": {"STEPS": "30", "STEP_S": "0.1"}, "warm_start": True},
                       restart={"in_job": True},
                       checkpoint={"memory_interval_steps": 4},
                       chaos={"kill": [{"step": 2, "rank": 1}, {"step": 14, "rank": 1}]})
    run = tmp_path / "run"
    result = up(cfg, run)
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(run)
    failures = [e for e in events if e["kind"] == "failure"]
    paths = [(f["generation"], f["recovery_path"]) for f in failures]
    assert paths == [(1, "in_job"), (2, "restart"), (3, "in_job")], failures
    assert "failed before its first step" in failures[1]["recovery_reason"]
    (refused,) = [e for e in events if e["kind"] == "recovery_failed"]
    assert refused["rank"] == 0 and "no state to roll back to" in refused["error"], refused
    started = {(e["generation"], r["rank"]): r["pid"] for e in events
               if e["kind"] == "ranks_started" for r in e["ranks"]}
    assert started[(4, 0)] == started[(3, 0)], "the surviving rank was restarted"
    assert started[(4, 1)] != started[(3, 1)]
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    assert recovered["rank"] == 0 and recovered["tier"] == "memory"
    assert recovered["generation"] == 4 and recovered["step"] == 12, recovered
    assert recovered["abandoned_step"] >= 14, recovered
    st = status(run)
    assert st["state"] == "COMPLETED" and st["last_step"] == 30
    rank1 = (run / "logs" / "rank-00001.log").read_text()
    assert "starting at step 12" in rank1  # the replacement restored the same step
    # It started in the spare (torch imported) the agent kept for its local rank.
    header = rank1.split("==== generation 4 rank 1 started")[1].splitlines()[0]
    assert "(warm spare)" in header, header
    final = _final((run / "logs" / "rank-00000.log").read_text())
    assert final == _injob_reference(30)
