"""The console through a real terminal (pexpect pseudo-terminals): `up`'s live progress line
and its human lines across a crash and restart, `logs -f` following both ranks across the
generations, `status --watch` redrawing until the job ends, and `status` finding the run
through runs/latest although it was started with --run-dir elsewhere."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pexpect
import pytest
from jobs import env, journal, kill_run, write_config

KILL_AT = 25
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Generous: two CPU cores shared with other jobs; every expect is a wait for an event, never a
# timing assertion.
WAIT_S = 240


def spawn(args: list[str], cwd: Path) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "orchestrator", *args], cwd=str(cwd),
                         env={**env(), "COLUMNS": "160", "TERM": "xterm"}, encoding="utf-8",
                         dimensions=(40, 160), timeout=WAIT_S, codec_errors="replace")


def close(child: pexpect.spawn) -> None:
    if child.isalive():
        child.terminate(force=True)


@pytest.fixture
def job(tmp_path: Path, dataset_dir: Path):
    config = write_config(tmp_path / "job.yaml", dataset_dir,
                          job={"name": "t", "run_root": str(tmp_path / "runs")})
    run_dir = tmp_path / "elsewhere" / "run"
    yield config, run_dir
    kill_run(run_dir)


def test_up_draws_a_progress_line_and_logs_follow_across_a_restart(job, tmp_path: Path) -> None:
    config, run_dir = job
    up = spawn(["up", str(config), "--run-dir", str(run_dir), "--chaos-kill-at", str(KILL_AT)],
               tmp_path)
    children = [up]
    try:
        # The state changes print as human lines, then the live line shows the training.
        up.expect(r"job LAUNCHING -> RUNNING")
        up.expect(r"RUNNING +step (\d+)/40 \(\d+%\)  loss \d+\.\d{4}  [\d.]+k? tok/s  "
                  r"goodput (\d+%|-)  ETA \S+  ckpt")
        # `status` without an argument finds this run through runs/latest (run_root), though
        # it lives elsewhere.
        status = spawn(["status"], tmp_path / "runs" / "..")
        children.append(status)
        status.expect(pexpect.EOF)
        status.close()
        shown = ANSI.sub("", status.before)
        assert status.exitstatus == 0, shown
        assert re.search(r"supervisor +│ running \(pid \d+", shown), shown
        assert "job t" in shown and str(run_dir) in shown
        assert (tmp_path / "runs" / "latest").resolve() == run_dir.resolve()
        logs = spawn(["logs", "-f", "--all", str(run_dir)], tmp_path)
        watch = spawn(["status", "--watch", "--interval", "1", str(run_dir)], tmp_path)
        children += [logs, watch]
        logs.expect(r"\[rank0\]: ==== generation 1 rank 0 started")
        watch.expect(r"state[^│\n]*│ RUNNING")
        up.expect(r"generation 1 failed: worker_exit rank \d on \S+: rank \d on node \S+ was "
                  r"killed by SIGKILL")
        # From the newest checkpoint committed before the relaunch: on a loaded host the
        # kill at step 25 can come before step 20's background commit (then step 10's).
        up.expect(r"restart: generation 2 launched from checkpoint (\d+) after worker_exit")
        resumed = int(up.match.group(1))
        up.expect(r"job RUNNING -> COMPLETED")
        up.expect(r"job t: COMPLETED")
        up.expect(pexpect.EOF)
        up.close()
        assert up.exitstatus == 0, up.before
        events = journal(run_dir)
        launch = next(e for e in events if e["kind"] == "generation_launched"
                      and e["generation"] == 2)
        committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"
                     and e["ts"] < launch["ts"]]
        assert committed and resumed == max(committed), (resumed, committed)
        # logs -f followed both ranks into generation 2 and ended with the job.
        logs.expect(pexpect.EOF)
        logs.close()
        assert logs.exitstatus == 0
        text = logs.before
        for rank in (0, 1):
            assert f"[rank{rank}]: ==== generation 2 rank {rank} started" in text
            assert re.search(rf"\[rank{rank}\]: \[[\d:]+ rank {rank}\] done: step 40", text)
        # status --watch redrew until the job ended, then exited 0.
        watch.expect(pexpect.EOF)
        watch.close()
        assert watch.exitstatus == 0
        assert re.search(r"state +│ COMPLETED", ANSI.sub("", watch.before))
    finally:
        for child in children:
            close(child)
    # The JSON log stays in the run directory, one JSON object a line.
    lines = (run_dir / "supervisor.log").read_text().splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)
    assert any(e["kind"] == "generation_launched" and e["generation"] == 2
               for e in journal(run_dir))
