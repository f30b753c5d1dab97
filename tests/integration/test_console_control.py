"""Truthful control with real daemons: `up --detach` returns after the API
listens or fails with the daemon's error; `--resume` never starts a second supervisor nor
touches a live one's pid file; `status` and `down` say when the supervisor is gone and print
the command that resumes it; a resumed supervisor takes the job on and `down` stops it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from jobs import env, journal, kill_run, wait_for, write_config


def cli(*args: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env(), "COLUMNS": "200"}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"orchestrator {' '.join(args)} timed out:\n{out[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def supervisor_pid(run_dir: Path) -> int:
    return json.loads((run_dir / "supervisor.json").read_text())["pid"]


def test_detach_reports_a_daemon_that_cannot_listen(tmp_path: Path, dataset_dir: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    config = write_config(tmp_path / "job.yaml", dataset_dir, metrics={"port": port,
                                                                      "host": "127.0.0.1"})
    run_dir = tmp_path / "run"
    try:
        result = cli("up", str(config), "--run-dir", str(run_dir), "--detach")
    finally:
        held.close()
        kill_run(run_dir)
    assert result.returncode != 0, result.stdout
    assert "exited with code" in result.stdout and "port is in use" in result.stdout
    assert not (run_dir / "supervisor.pid").exists()


def test_resume_refuses_a_live_supervisor_and_status_tells_a_dead_one(
        tmp_path: Path, dataset_dir: Path) -> None:
    config = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 400},
                          job={"name": "t", "run_root": str(tmp_path / "runs")})
    run_dir = tmp_path / "run"
    try:
        result = cli("up", str(config), "--run-dir", str(run_dir), "--detach",
                     "--log-format", "json", cwd=tmp_path)
        assert result.returncode == 0, result.stdout
        # Returned only once the daemon listens: its API answers now, without waiting.
        info = json.loads((run_dir / "supervisor.json").read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/healthz", timeout=5) as r:
            assert json.loads(r.read())["ok"] is True
        first = info["pid"]
        # --log-format json: the daemon's own output is JSON lines (as under systemd).
        out_lines = (run_dir / "supervisor.out").read_text().splitlines()
        assert out_lines and all(json.loads(line)["event"] for line in out_lines)
        wait_for(lambda: (run_dir / "supervisor.pid").exists(), 30, what="the pid file")
        assert int((run_dir / "supervisor.pid").read_text()) == first

        again = cli("up", "--resume", str(run_dir), "--detach")
        assert again.returncode == 1 and "already running" in again.stdout, again.stdout
        assert int((run_dir / "supervisor.pid").read_text()) == first
        assert supervisor_pid(run_dir) == first

        wait_for(lambda: any(e["kind"] == "first_step" for e in journal(run_dir)), 120,
                 what="the first step")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not _alive(first), 10, what="the supervisor to die")
        status = cli("status", cwd=tmp_path)  # runs/latest
        assert status.returncode == 0, status.stdout
        assert f"not running (pid {first} gone" in status.stdout
        assert f"orchestrator up --resume {run_dir}" in status.stdout
        as_json = json.loads(cli("status", str(run_dir), "--json").stdout)
        assert as_json["supervisor"]["running"] is False and as_json["state"] == "RUNNING"
        down = cli("down", str(run_dir))
        assert down.returncode == 1
        assert "not running" in down.stdout and f"up --resume {run_dir}" in down.stdout

        resumed = cli("up", "--resume", str(run_dir), "--detach")
        assert resumed.returncode == 0, resumed.stdout
        second = supervisor_pid(run_dir)
        assert second != first
        status = cli("status", str(run_dir))
        assert f"running (pid {second}" in status.stdout, status.stdout
        down = cli("down", str(run_dir), "--no-checkpoint")
        assert down.returncode == 0, down.stdout
        assert "STOPPED" in down.stdout and f"up --resume {run_dir}" in down.stdout
    finally:
        kill_run(run_dir)
        for pid in {p for p in _pids(run_dir)}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pids(run_dir: Path) -> list[int]:
    return [e["pid"] for e in journal(run_dir) if e["kind"] == "supervisor_started"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_down_returns_once_the_supervisor_exited_and_resume_waits_for_it(
        tmp_path: Path, dataset_dir: Path) -> None:
    """`down` then `up --resume` at once, on a loaded machine: the journal says STOPPED
    before the supervisor has told its agents to exit and ended. The supervisor is held
    (SIGSTOP) right after it journals STOPPED, as a loaded machine would hold it: `down`
    waits for its exit and `up --resume` waits too, instead of refusing."""
    config = write_config(tmp_path / "job.yaml", dataset_dir, trainer={"steps": 2000})
    run_dir = tmp_path / "run"
    waiting: list[subprocess.Popen] = []
    first = None
    try:
        started = cli("up", str(config), "--run-dir", str(run_dir), "--detach")
        assert started.returncode == 0, started.stdout
        first = supervisor_pid(run_dir)
        wait_for(lambda: any(e["kind"] == "first_step" for e in journal(run_dir)), 120,
                 what="the first step")
        down = _popen("down", str(run_dir), "--no-checkpoint")
        waiting.append(down)
        wait_for(lambda: any(e["kind"] == "transition" and e["to"] == "STOPPED"
                             for e in journal(run_dir)), 120, interval=0.01,
                 what="STOPPED in the journal")
        os.kill(first, signal.SIGSTOP)
        assert _alive(first), "the supervisor ended before it could be held"
        try:
            time.sleep(2.0)
            assert down.poll() is None, "down returned while its supervisor still ran: " \
                + down.communicate()[0]
            resume = _popen("up", "--resume", str(run_dir), "--detach")
            waiting.append(resume)
            time.sleep(3.0)
            assert resume.poll() is None, "up --resume refused a supervisor that was " \
                "shutting down: " + resume.communicate()[0]
        finally:
            os.kill(first, signal.SIGCONT)
        out, _ = down.communicate(timeout=120)
        assert down.returncode == 0, out
        assert "STOPPED" in out and not _alive(first)
        out, _ = resume.communicate(timeout=300)
        assert resume.returncode == 0, out
        second = supervisor_pid(run_dir)
        assert second != first and _alive(second)
        seq = [e["to"] for e in journal(run_dir) if e["kind"] == "transition"]
        assert seq[seq.index("STOPPED") + 1] == "PENDING"  # the job goes on
        stop = cli("down", str(run_dir), "--no-checkpoint")
        assert stop.returncode == 0, stop.stdout
        assert not _alive(second)
    finally:
        for proc in waiting:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        if first is not None and _alive(first):
            os.kill(first, signal.SIGCONT)
        kill_run(run_dir)
        for pid in set(_pids(run_dir)):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env(), "COLUMNS": "200"}, start_new_session=True)
