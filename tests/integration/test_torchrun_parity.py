"""torchrun parity: a torchrun-style script (no SDK, plain DDP, ``@record``) runs unchanged
under the orchestrator, and its crashes and hangs are handled as the issue asks.

Each test runs real `orchestrator up` jobs (2 simulated nodes x 1 rank unless said), and the
environment test also a real `torchrun`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import env, finish, journal, kill_run, status, wait_for, write_config

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_ddp.py"
pytestmark = pytest.mark.slow


def _config(tmp_path: Path, dataset_dir: Path, script_env: dict[str, str], **sections: Any
            ) -> Path:
    job = {"entrypoint": [sys.executable, str(SCRIPT)], "env": script_env,
           **sections.pop("job", {})}
    return write_config(tmp_path / "job.yaml", dataset_dir, job=job,
                        restart={"max_restarts": 0, "backoff_initial_s": 0.2,
                                 "backoff_max_s": 1.0, **sections.pop("restart", {})},
                        **sections)


def _start(cfg: Path, run_dir: Path, cwd: Path | None = None) -> subprocess.Popen:
    # -P: as the `orchestrator` console script runs (its sys.path has no working directory);
    # what this file tests is everything `up` starts from there.
    cmd = [sys.executable, "-P", "-m", "orchestrator", "up", str(cfg), "--run-dir",
           str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), start_new_session=True, cwd=cwd)


def _finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 240) -> str:
    return finish(proc, run_dir, timeout)


def _pid(run_dir: Path, rank: int) -> int:
    for e in journal(run_dir):
        if e["kind"] == "ranks_started":
            for r in e["ranks"]:
                if r["rank"] == rank:
                    return r["pid"]
    return 0


def _step_seen(log: Path, step: int) -> bool:
    return log.exists() and f"step {step} " in log.read_text()


# torchrun values that differ by design: where the rendezvous is, the run id, the error
# file's directory, the agent store (rank 0 hosts the TCPStore here) and the restart budget.
_DIFFERENT_BY_DESIGN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                        "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
                        "TORCHELASTIC_MAX_RESTARTS"}


def test_rank_environment_matches_torchrun_variable_for_variable(
        tmp_path: Path, dataset_dir: Path) -> None:
    base = env()
    torchrun_out = tmp_path / "torchrun-env"
    torchrun_out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SCRIPT)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env={**base, "ENV_OUT": str(torchrun_out), "STEPS": "2"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]

    ours_out = tmp_path / "orch-env"
    ours_out.mkdir()
    cfg = _config(tmp_path, dataset_dir, {"ENV_OUT": str(ours_out), "STEPS": "2"},
                  cluster={"nodes": 1, "procs_per_node": 2}, restart={"max_restarts": 4},
                  job={"workdir": str(tmp_path / "work" / "{node_id}"),
                       "master_port_range": [29600, 29699]})
    run_dir = tmp_path / "run"
    result = _finish(_start(cfg, run_dir, cwd=tmp_path), run_dir)
    assert status(run_dir)["state"] == "COMPLETED", result[-4000:]

    for rank in (0, 1):
        theirs = json.loads((torchrun_out / f"rank-{rank}.json").read_text())
        ours = json.loads((ours_out / f"rank-{rank}.json").read_text())
        torchrun_set = {k for k in theirs if theirs[k] != base.get(k)} - {"ENV_OUT"}
        assert "TORCHELASTIC_ERROR_FILE" in torchrun_set and "RANK" in torchrun_set
        missing = sorted(torchrun_set - set(ours))
        assert not missing, f"rank {rank}: torchrun sets {missing}, we do not"
        differ = {k: (theirs[k], ours[k]) for k in torchrun_set - _DIFFERENT_BY_DESIGN
                  if theirs[k] != ours[k]}
        assert not differ, f"rank {rank}: values differ from torchrun's: {differ}"
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert ours["TORCHELASTIC_MAX_RESTARTS"] == "4"
        assert Path(ours["TORCHELASTIC_ERROR_FILE"]).parent.is_dir()
        assert Path(ours["TORCHELASTIC_ERROR_FILE"]).is_relative_to(run_dir)
        assert 29600 <= int(ours["MASTER_PORT"]) <= 29699  # job.master_port_range
        # job.workdir, per node: both ranks run on local-0, in its own directory.
        assert (ours_out / f"cwd-{rank}.txt").read_text() == str(tmp_path / "work" / "local-0")


def test_healthy_run_longer_than_every_phase_timeout_ends_without_a_failure(
        tmp_path: Path, dataset_dir: Path) -> None:
    # Every phase (the calibrated training one too) times out after 12 s and the job runs
    # over 20 s of steps with no SDK: progress comes from the preload hook's optimizer-step
    # count alone, and start-up (importing torch on a busy machine can take longer than 12 s)
    # is judged by liveness, as no phase timeout applies before a script's first step.
    phases = {p: 12 for p in ("init", "loading", "compiling", "checkpointing", "evaluating")}
    out = tmp_path / "env"
    out.mkdir()
    cfg = _config(tmp_path, dataset_dir, {"STEPS": "100", "STEP_S": "0.2", "ENV_OUT": str(out)},
                  timeouts={"phases": phases, "training_floor_s": 12,
                            "training_multiplier": 3},
                  job={"workdir": str(tmp_path / "work" / "{node_id}")})
    run_dir = tmp_path / "run"
    result = _finish(_start(cfg, run_dir), run_dir)
    st = status(run_dir)
    assert st["state"] == "COMPLETED", result[-4000:]
    assert st["restarts"] == [] and st["failures"] == []
    assert st["last_step"] == 100  # the hook's count of optimizer steps
    first, last = [(e["ts"]) for e in journal(run_dir) if e["kind"] in ("first_step",)][0], \
        [e["ts"] for e in journal(run_dir) if e["kind"] == "transition"][-1]
    assert last - first > 12, "the run must outlast the longest phase timeout"
    # job.workdir with {node_id}: each simulated node's rank in its own directory.
    assert [(out / f"cwd-{r}.txt").read_text() for r in (0, 1)] == \
        [str(tmp_path / "work" / "local-0"), str(tmp_path / "work" / "local-1")]


def test_a_stopped_rank_is_found_named_and_both_stacks_are_dumped(
        tmp_path: Path, dataset_dir: Path) -> None:
    # Rank 1 reset SIGUSR1 to its default (which would kill it) and is then stopped: its
    # stacks must come from outside (py-spy), rank 0's from its own faulthandler.
    cfg = _config(tmp_path, dataset_dir, {"STEPS": "100000", "STEP_S": "0.2",
                                          "DEFAULT_SIGUSR1_RANK": "1"},
                  timeouts={"training_floor_s": 3, "training_multiplier": 3})
    run_dir = tmp_path / "run"
    proc = _start(cfg, run_dir)
    try:
        wait_for(lambda: _step_seen(run_dir / "logs" / "rank-00001.log", 10), 180,
                 what="rank 1 at step 10")
        os.kill(_pid(run_dir, 1), signal.SIGSTOP)
    except BaseException:
        kill_run(run_dir, proc)
        raise
    result = _finish(proc, run_dir)
    st = status(run_dir)
    assert st["state"] == "FAILED", result[-4000:]
    failure = [e for e in journal(run_dir) if e["kind"] == "failure"][0]
    assert failure["cause"] == "hang" and failure["rank"] == 1, failure
    suspect = failure["suspects"][0]
    assert suspect["rank"] == 1 and suspect["silent"] and suspect["phase"] == "training"
    calibration = [e for e in journal(run_dir) if e["kind"] == "calibration"][-1]
    # The timeout that applied is the calibrated one: 3 x the step interval, or the floor.
    assert calibration["training_timeout_s"] <= 3 * calibration["max_interval_s"] + 3
    stacks = {Path(p).name: Path(p).read_text() for p in failure["stacks"]}
    assert set(stacks) == {"gen0001-rank00000.txt", "gen0001-rank00001.txt"}
    assert "torchrun_ddp.py" in stacks["gen0001-rank00000.txt"]  # faulthandler, in-process
    assert "most recent call first" in stacks["gen0001-rank00000.txt"]
    assert "stacks read from outside by py-spy" in stacks["gen0001-rank00001.txt"]
    assert "torchrun_ddp.py" in stacks["gen0001-rank00001.txt"]
    # The dump did not kill it: rank 1 ended by the stop (SIGTERM), not by SIGUSR1.
    # (A node's exits that arrive together are one ranks_exited event.)
    exits = [e for e in journal(run_dir) if e["kind"] == "rank_exited" and e["rank"] == 1] + \
        [x for e in journal(run_dir) if e["kind"] == "ranks_exited"
         for x in e["exits"] if x["rank"] == 1]
    assert exits and exits[0]["signal"] != "SIGUSR1"


def test_an_exception_under_record_is_the_root_cause_with_its_traceback(
        tmp_path: Path, dataset_dir: Path) -> None:
    cfg = _config(tmp_path, dataset_dir, {"STEPS": "30", "RAISE_RANK": "1", "RAISE_STEP": "3"})
    run_dir = tmp_path / "run"
    result = _finish(_start(cfg, run_dir), run_dir)
    st = status(run_dir)
    assert st["state"] == "FAILED", result[-4000:]
    root = st["root_cause"]
    assert root["rank"] == 1 and root["exit_code"] == 1
    tail = root["log_tail"]
    assert tail[-1] == "ValueError: boom at step 3 on rank 1"
    assert any(line.startswith("Traceback") for line in tail)
    assert any("torchrun_ddp.py" in line and "in main" in line for line in tail)
    human = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run_dir)],
                           capture_output=True, text=True, env=env(), timeout=60).stdout
    assert "ValueError: boom at step 3 on rank 1" in human


def test_a_trainer_py_in_the_working_directory_changes_nothing(
        tmp_path: Path, dataset_dir: Path) -> None:
    # minGPT-ddp's layout: the script imports its own trainer.py, and `up` runs from there.
    work = tmp_path / "mingpt"
    work.mkdir()
    (work / "trainer.py").write_text("STEPS = 6\n")
    (work / "main.py").write_text(
        "import os, runpy, sys\n"
        "import trainer\n"
        "os.environ['STEPS'] = str(trainer.STEPS)\n"
        f"sys.argv = [{str(SCRIPT)!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    cfg = _config(tmp_path, dataset_dir, {}, job={"entrypoint": [sys.executable, "main.py"]})
    run_dir = tmp_path / "run"
    result = _finish(_start(cfg, run_dir, cwd=work), run_dir)
    st = status(run_dir)
    assert st["state"] == "COMPLETED", result[-4000:]
    assert st["last_step"] == 6


def test_a_mistyped_entrypoint_is_reported_as_the_rank_exit(
        tmp_path: Path, dataset_dir: Path) -> None:
    cfg = _config(tmp_path, dataset_dir, {}, job={"entrypoint": ["pyhton", "train.py"]})
    run_dir = tmp_path / "run"
    result = _finish(_start(cfg, run_dir), run_dir, timeout=120)
    st = status(run_dir)
    assert st["state"] == "FAILED", result[-4000:]
    root = st["root_cause"]
    assert root["cause"] == "worker_exit" and root["exit_code"] == 127
    assert any("job.entrypoint 'pyhton' not found" in line for line in root["log_tail"])
    human = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run_dir)],
                           capture_output=True, text=True, env=env(), timeout=60).stdout
    assert "job.entrypoint 'pyhton' not found" in human


def _snapshot_step(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def test_four_kills_after_progress_do_not_exhaust_the_no_progress_budget(
        tmp_path: Path, dataset_dir: Path) -> None:
    # The script keeps its own snapshot (every 5 steps), which the orchestrator never sees:
    # each generation's optimizer steps (the preload hook's count) are its progress. With at
    # most 2 restarts in a row "without progress", four kills, each after the snapshot
    # advanced, still end COMPLETED.
    snapshot = tmp_path / "snapshot.json"
    cfg = _config(tmp_path, dataset_dir, {"STEPS": "80", "STEP_S": "0.1",
                                          "SNAPSHOT": str(snapshot)},
                  restart={"max_restarts": 10, "max_restarts_without_progress": 2})
    run_dir = tmp_path / "run"
    proc = _start(cfg, run_dir)
    try:
        seen = 0
        for kill in range(4):
            wait_for(lambda: proc.poll() is not None or (
                _snapshot_step(snapshot) > seen and _pid(run_dir, 1) > 0),
                timeout=180, what=f"snapshot progress before kill {kill + 1}")
            if proc.poll() is not None:  # the job ended early (FAILED): the asserts say why
                break
            seen = _snapshot_step(snapshot)
            launches = len([e for e in journal(run_dir) if e["kind"] == "generation_launched"])
            pid = [r["pid"] for e in journal(run_dir) if e["kind"] == "ranks_started"
                   for r in e["ranks"] if r["rank"] == 1][-1]
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: len([e for e in journal(run_dir)
                                  if e["kind"] == "generation_launched"]) > launches
                     or proc.poll() is not None, timeout=180, what="the relaunch")
    except BaseException:
        kill_run(run_dir, proc)
        raise
    result = _finish(proc, run_dir)
    st = status(run_dir)
    assert st["state"] == "COMPLETED", result[-4000:]
    assert [f["cause"] for f in st["failures"]] == ["worker_exit"] * 4
    assert _snapshot_step(snapshot) == 80
