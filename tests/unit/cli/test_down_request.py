"""What `down` sends the supervisor, on the wire (the contract with the supervisor's stop):
``POST /v1/stop`` with the job token and ``{"reason": ..., "checkpoint": bool}``."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchestrator.cli.control import stop_job
from orchestrator.contracts.events import JobCreated, Transition
from orchestrator.journal.store import Journal
from orchestrator.contracts.rundir import RunDir


class _Supervisor(BaseHTTPRequestHandler):
    """A stand-in that records what it is sent and answers like the supervisor's API."""

    received: list[tuple[str, str, dict]] = []

    def do_GET(self) -> None:
        self._answer({"ok": True, "state": "RUNNING"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append((self.path, self.headers["Authorization"], body))
        self._answer({"stopping": True, "state": "RUNNING"})

    def _answer(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("checkpoint", [True, False])
def test_down_posts_reason_and_checkpoint_with_the_token(tmp_path: Path,
                                                         checkpoint: bool) -> None:
    run = RunDir(tmp_path)
    with Journal(run.journal) as journal:
        journal.append(JobCreated(job="t", steps=10), durable=True)
        journal.append(Transition.model_validate({"from": "PENDING", "to": "RUNNING"}),
                       durable=True)
    token = run.ensure_token()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Supervisor)
    _Supervisor.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        run.write_json(run.supervisor_info, {"pid": os.getpid(), "port": port,
                                             "url": f"http://127.0.0.1:{port}"})
        # The stand-in never reaches STOPPED: down waits its (short) timeout and says so.
        assert stop_job(tmp_path, timeout=0.3, checkpoint=checkpoint) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert _Supervisor.received == [("/v1/stop", f"Bearer {token}",
                                     {"reason": "orchestrator down",
                                      "checkpoint": checkpoint})]
