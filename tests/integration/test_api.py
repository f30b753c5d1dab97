"""The control API: a node's credential for the agents' routes and the job secret for the
operator's, malformed requests refused with a reason, TLS with an agent-side CA; up --detach
and down."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from jobs import api_call as _call
from jobs import env, journal, kill_strays, states, wait_for, write_config

from orchestrator.contracts.auth import node_credential

pytestmark = pytest.mark.slow


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
        cred = node_credential(token, "n0")
        register = json.dumps({"node_id": "n0", "host": "h", "addr": "127.0.0.1", "procs": 1,
                               "agent_pid": 1}).encode()

        assert _call(f"{base}/v1/register", None, register)[0] == 401
        assert _call(f"{base}/v1/register", "wrong", register)[0] == 401
        assert _call(f"{base}/v1/stop", "wrong", b"{}")[0] == 401
        # The job secret is the operator's; a node's credential only speaks for its node.
        assert _call(f"{base}/v1/register", token, register)[0] == 403
        assert _call(f"{base}/v1/stop", cred, b"{}")[0] == 403
        assert _call(f"{base}/v1/register", node_credential("other-secret", "n0"),
                     register)[0] == 401
        code, body = _call(f"{base}/v1/register", node_credential(token, "n1"), register)
        assert code == 403 and "as node 'n0'" in body["error"]
        code, body = _call(f"{base}/v1/register", cred, b"{not json")
        assert code == 400 and "JSON" in body["error"]
        code, body = _call(f"{base}/v1/register", cred, b"[1, 2]")
        assert code == 400
        code, body = _call(f"{base}/v1/register", cred, json.dumps({"node_id": ""}).encode())
        assert code == 422 and any("node_id" in p for p in body["problems"])
        ghost = node_credential(token, "ghost")
        code, body = _call(f"{base}/v1/heartbeat", ghost, json.dumps(
            {"node_id": "ghost", "ranks": []}).encode())
        assert code == 404 and "register first" in body["error"]
        code, _ = _call(f"{base}/v1/assignment?after=x&node_id=n0", cred, None, "GET")
        assert code == 400
        code, _ = _call(f"{base}/v1/events", cred, json.dumps(
            {"node_id": "n0", "events": [{"type": "bogus"}]}).encode())
        assert code == 422
        assert _call(f"{base}/healthz", None, None, "GET")[0] == 200
        # A profile: the operator's route, its body checked, and only for a running job.
        profile = json.dumps({"steps": 3}).encode()
        assert _call(f"{base}/v1/profile", "wrong", profile)[0] == 401
        assert _call(f"{base}/v1/profile", cred, profile)[0] == 403
        for bad, field in (({"steps": 0}, "steps"), ({"steps": 201}, "steps"),
                           ({"steps": "3"}, "steps"), ({"steps": 3, "ranks": [-1]}, "ranks"),
                           ({"steps": 3, "ranks": []}, "ranks"), ({"steps": 3, "x": 1}, "x")):
            code, body = _call(f"{base}/v1/profile", token, json.dumps(bad).encode())
            assert code == 422 and any(field in p for p in body["problems"]), (bad, body)
        code, body = _call(f"{base}/v1/profile", token, profile)
        assert code == 409 and "no running job" in body["error"]
        assert not [e for e in journal(run) if e["kind"] == "profile_requested"]
        # Nothing of the refused requests reached the journal but the refusal, naming the node.
        assert not [e for e in journal(run) if e["kind"] == "node_registered"]
        refused = [e for e in journal(run) if e["kind"] == "message_rejected"]
        assert [e["node_id"] for e in refused] == ["n1"]
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


def test_api_over_tls_with_an_agent_side_ca(tmp_path: Path, dataset_dir: Path) -> None:
    import asyncio
    import ssl

    import trustme

    from orchestrator.agent.client import SupervisorClient

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, launcher={
        "kind": "kubernetes", "advertise_host": "localhost"}, timeouts={"register_s": 300},
        api={"tls_cert": str(tmp_path / "server.pem"), "tls_key": str(tmp_path / "server.pem"),
             "tls_ca": str(tmp_path / "ca.pem")})
    run = tmp_path / "run"
    # In the foreground (the CLI's own liveness probes speak plain HTTP): the test stops it
    # through the API and waits for it to exit.
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir",
                             str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env(), start_new_session=True)
    try:
        info = wait_for(lambda: (run / "supervisor.json").exists() and
                        json.loads((run / "supervisor.json").read_text()), 30,
                        what="supervisor.json")
        assert info["url"].startswith("https://localhost:")
        token = (run / "token").read_text().strip()

        async def agent_side() -> dict:
            # As an agent does: its node's credential, the CA handed over as ORCH_TLS_CA.
            async with SupervisorClient(info["url"], node_credential(token, "n0"),
                                        ca_file=str(tmp_path / "ca.pem")) as client:
                return await client.request("POST", "/v1/register", json={
                    "node_id": "n0", "host": "h", "addr": "127.0.0.1", "procs": 1,
                    "agent_pid": 1})

        assert asyncio.run(agent_side())["node_id"] == "n0"
        # Without the CA the certificate is refused; plain HTTP gets no answer.
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"{info['url']}/healthz", timeout=10)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/healthz", timeout=10)
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        req = urllib.request.Request(f"{info['url']}/v1/stop", data=b"{}", method="POST",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            assert resp.status == 200
        proc.wait(timeout=60)
        assert states(run)[-1] == "STOPPED"
    finally:
        kill_strays(run)
        if proc.poll() is None:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
