"""``api.heartbeat_process``: agents' heartbeats served by a second process of the supervisor.

The real supervisor (``up --detach``, agents external) with its heartbeat process: the process
answers what it can decide alone (credentials, malformed bodies, a registered node's beat) with
the same words as the API's own port, asks the supervisor about the rest (unknown nodes,
forged ranks: 404 / 403 and the ``message_rejected`` journal line), and the beats it takes
reach the supervisor's registry. When the process dies, the supervisor says so (log line,
gauge), stops advertising it, and beats to its own port go on. A real local job with the
process on runs to COMPLETED through a crash, its agents beating to the process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
from jobs import api_call as _call
from jobs import env, journal, kill_strays, states, status, up, wait_for, write_config
from jobs import metric as _metric

from orchestrator.contracts.auth import node_credential

pytestmark = pytest.mark.slow


def _front_pid(supervisor_pid: int) -> int:
    kids = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    for kid in kids:
        cmd = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
        if b"orchestrator.supervisor.gateway.beatfront" in cmd:
            return int(kid)
    raise AssertionError(f"no heartbeat process among {kids}")


def _silent_s(base: str, token: str, node: str) -> float:
    code, body = _call(f"{base}/v1/status", token, None, "GET")
    assert code == 200, body
    return body["nodes"][node]["silent_s"]


def test_the_heartbeat_process_answers_asks_and_passes_beats_on(tmp_path: Path,
                                                                 dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, launcher={"kind": "kubernetes"},
                       timeouts={"register_s": 300}, api={"heartbeat_process": True})
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir",
                          str(run), "--detach"], check=False, capture_output=True, text=True, env=env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    pid = int((run / "supervisor.pid").read_text())
    try:
        info = wait_for(lambda: (run / "supervisor.json").exists() and
                        json.loads((run / "supervisor.json").read_text()), 30,
                        what="supervisor.json")
        base = f"http://127.0.0.1:{info['port']}"
        token = (run / "token").read_text().strip()
        cred = node_credential(token, "n0")
        code, reg = _call(f"{base}/v1/register", cred, json.dumps({
            "node_id": "n0", "host": "h", "addr": "127.0.0.1", "procs": 1,
            "agent_pid": 1}).encode())
        assert code == 200, reg
        assert reg["heartbeat_port"] not in (None, info["port"])
        front = f"http://127.0.0.1:{reg['heartbeat_port']}/v1/heartbeat"
        beat = json.dumps({"node_id": "n0", "ranks": []}).encode()

        # What the process decides alone, in the API's words.
        assert _call(front, None, beat)[0] == 401
        assert _call(front, "wrong", beat)[0] == 401
        assert _call(front, node_credential("other-secret", "n0"), beat)[0] == 401
        code, body = _call(front, token, beat)
        assert code == 403 and "node's credential" in body["error"]
        code, body = _call(front, cred, b"{not json")
        assert code == 400 and "JSON" in body["error"]
        code, body = _call(front, cred, json.dumps({"node_id": ""}).encode())
        assert code == 422 and any("node_id" in p for p in body["problems"])

        # A registered node's beat: answered by the process, folded in by the supervisor.
        wait_for(lambda: _silent_s(base, token, "n0") >= 2.0, 30, what="n0 to be silent")
        code, body = _call(front, cred, beat)
        assert (code, body) == (200, {"assignment_version": 0})
        wait_for(lambda: _silent_s(base, token, "n0") < 1.5, 30,
                 what="the beat to reach the supervisor")
        assert _metric(base, "orchestrator_heartbeats_total", door="process") == 1
        assert _metric(base, "orchestrator_heartbeats_total", door="api") == 0
        assert _metric(base, "orchestrator_heartbeat_process_up") == 1

        # What it asks the supervisor about: an unknown node, a node speaking for another,
        # ranks of a generation never launched.
        code, body = _call(front, node_credential(token, "ghost"), json.dumps(
            {"node_id": "ghost", "ranks": []}).encode())
        assert code == 404 and "register first" in body["error"]
        code, body = _call(front, cred, json.dumps({"node_id": "n1", "ranks": []}).encode())
        assert code == 403 and "as node 'n1'" in body["error"]
        code, body = _call(front, cred, json.dumps({
            "node_id": "n0", "generation": 1,
            "ranks": [{"rank": 0, "local_rank": 0}]}).encode())
        assert code == 403 and "never launched" in body["error"]
        # Journaled by the supervisor (its writer commits in groups: read until there).
        refused = wait_for(lambda: [(e["node_id"], e["route"]) for e in journal(run)
                                    if e["kind"] == "message_rejected"][1:] and
                           [(e["node_id"], e["route"]) for e in journal(run)
                            if e["kind"] == "message_rejected"], 30, what="the refusals")
        assert refused == [("n0", "heartbeat")] * 2

        # The process dies: the supervisor says so and stops advertising it; beats go on
        # at the API's own port.
        os.kill(_front_pid(pid), signal.SIGKILL)
        wait_for(lambda: _metric(base, "orchestrator_heartbeat_process_up") == 0, 30,
                 what="the gauge to drop")
        with pytest.raises(urllib.error.URLError):
            _call(front, cred, beat)
        code, reg = _call(f"{base}/v1/register", cred, json.dumps({
            "node_id": "n0", "host": "h", "addr": "127.0.0.1", "procs": 1,
            "agent_pid": 1}).encode())
        assert code == 200 and reg["heartbeat_port"] is None
        assert _call(f"{base}/v1/heartbeat", cred, beat) == (200, {"assignment_version": 0})
        log = (run / "supervisor.log").read_text()
        assert "heartbeat process lost" in log

        down = subprocess.run([sys.executable, "-m", "orchestrator", "down", str(run)],
                              check=False, capture_output=True, text=True, env=env(),
                              timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
        assert states(run)[-1] == "STOPPED"
    finally:
        kill_strays(run)
        with contextlib.suppress(ProcessLookupError):  # the test stopped it already
            os.kill(pid, signal.SIGKILL)


def test_a_local_job_beats_through_the_heartbeat_process(tmp_path: Path,
                                                         dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, api={"heartbeat_process": True},
                       trainer={"steps": 25}, chaos={"kill": [{"step": 16, "rank": 1}]})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED" and st["last_step"] == 25
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    sup_log = (tmp_path / "run" / "supervisor.log").read_text()
    port = json.loads(next(line for line in sup_log.splitlines()
                           if "heartbeat process started" in line))["port"]
    # Every agent was told the process's port and beat there, never falling back.
    agent_logs = [p.read_text() for p in (tmp_path / "run").rglob("agents/*.log")]
    assert agent_logs
    for text in agent_logs:
        assert f"127.0.0.1:{port}" in text, text[-2000:]
        assert "heartbeat process unreachable" not in text
