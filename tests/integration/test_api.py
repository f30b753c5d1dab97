"""The control API: token required, malformed requests refused with a reason; up --detach
and down."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from jobs import env, journal, kill_strays, states, wait_for, write_config

pytestmark = pytest.mark.slow


def _call(url: str, token: str | None, body: bytes | None = None,
          method: str = "POST") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_api_requires_the_token_and_rejects_garbage(tmp_path: Path, dataset_dir: Path) -> None:
    # Agents are external (kubernetes launcher) and none come: the API is up, the job waits.
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, launcher={"kind": "kubernetes"},
                       timeouts={"register_s": 300})
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir",
                          str(run), "--detach"], capture_output=True, text=True, env=env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    try:
        pid = int((run / "supervisor.pid").read_text())
        info = wait_for(lambda: (run / "supervisor.json").exists() and
                        json.loads((run / "supervisor.json").read_text()), 30,
                        what="supervisor.json")
        base = f"http://127.0.0.1:{info['port']}"
        token = (run / "token").read_text().strip()
        assert oct((run / "token").stat().st_mode & 0o777) == "0o600"
        register = json.dumps({"node_id": "n0", "host": "h", "addr": "127.0.0.1", "procs": 1,
                               "agent_pid": 1}).encode()

        assert _call(f"{base}/v1/register", None, register)[0] == 401
        assert _call(f"{base}/v1/register", "wrong", register)[0] == 401
        assert _call(f"{base}/v1/stop", "wrong", b"{}")[0] == 401
        code, body = _call(f"{base}/v1/register", token, b"{not json")
        assert code == 400 and "JSON" in body["error"]
        code, body = _call(f"{base}/v1/register", token, b"[1, 2]")
        assert code == 400
        code, body = _call(f"{base}/v1/register", token, json.dumps({"node_id": ""}).encode())
        assert code == 422 and any("node_id" in p for p in body["problems"])
        code, body = _call(f"{base}/v1/heartbeat", token, json.dumps(
            {"node_id": "ghost", "ranks": []}).encode())
        assert code == 404 and "register first" in body["error"]
        code, _ = _call(f"{base}/v1/assignment?after=x&node_id=n0", token, None, "GET")
        assert code == 400
        code, _ = _call(f"{base}/v1/events", token, json.dumps(
            {"node_id": "n0", "events": [{"type": "bogus"}]}).encode())
        assert code == 422
        assert _call(f"{base}/healthz", None, None, "GET")[0] == 200
        # Nothing of the refused requests reached the journal.
        assert not [e for e in journal(run) if e["kind"] == "node_registered"]
        assert states(run)[-1] == "HEALTH_CHECK"

        down = subprocess.run([sys.executable, "-m", "orchestrator", "down", str(run)],
                              capture_output=True, text=True, env=env(), timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
        assert states(run)[-1] == "STOPPED"
        stop = [e for e in journal(run) if e["kind"] == "transition" and e["to"] == "STOPPED"]
        assert stop[0]["cause"] == "operator"
        wait_for(lambda: not _alive(pid), 30, what="the supervisor to exit")
        for log in run.rglob("*.log"):
            assert token not in log.read_text(), f"token leaked into {log}"
    finally:
        kill_strays(run)
        try:
            import os
            import signal

            os.kill(int((run / "supervisor.pid").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
