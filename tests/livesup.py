"""A real supervisor whose agents are the test: ``up --detach`` with external agents, two fake
nodes that register, take their assignment, say their ranks started, and answer stops. The
generation then RUNS with no rank process at all, so a test can send any message as either
node, through the API's port or the heartbeat process's, and read what the supervisor made
of it (journal, ``steps.jsonl``, ``/v1/status``)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs import env, kill_strays, wait_for, write_config
from procs import TAG_VAR

from orchestrator.contracts.auth import node_credential

NODES = ("n0", "n1")
# No preflight, no hang or loss judgement while the test talks: the fake ranks never step.
CONFIG = {
    "launcher": {"kind": "kubernetes"},
    "cluster": {"nodes": 2, "procs_per_node": 1},
    "health": {"preflight": "off", "after_failure": "off"},
    "timeouts": {"register_s": 3600, "launch_s": 3600, "node_lost_s": 3600,
                 "stop_grace_s": 1, "phases": {"init": 3600, "training": 3600}},
    "api": {"heartbeat_process": True},
}


class Conn:
    """One keep-alive HTTP connection to a port (reopened once if the server closed it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None, bearer: str,
                ) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {bearer}", "Content-Type": "application/json"}
        for attempt in range(2):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                    self.conn.connect()
                    self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.conn.request(method, path, body=body, headers=headers)
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@dataclass
class Live:
    run: Path
    port: int
    token: str
    beat_port: int = 0
    generation: int = 0
    rank0: str = ""  # the node holding rank 0 in the running generation
    other: str = ""
    version: dict[str, int] = field(default_factory=dict)
    conns: dict[int, Conn] = field(default_factory=dict)
    # The process tag of whoever started it (a module's fixture): a supervisor resumed
    # inside a test carries it too, so it outlives that test (tests/procs.py).
    tag: str | None = None

    def cred(self, node: str) -> str:
        return node_credential(self.token, node)

    def send(self, node: str, route: str, body: Any, *, beat_port: bool = False,
             method: str = "POST") -> tuple[int, dict[str, Any]]:
        port = self.beat_port if beat_port else self.port
        conn = self.conns.setdefault(port, Conn(port))
        raw = body if isinstance(body, bytes) or body is None else \
            json.dumps(body, allow_nan=True).encode()
        status, data = conn.request(method, route, raw, self.cred(node))
        try:
            return status, json.loads(data or b"{}")
        except ValueError:
            return status, {"raw": data[:300].decode(errors="replace")}

    def status(self) -> dict[str, Any]:
        code, body = self._operator("GET", "/v1/status")
        assert code == 200, body
        return body

    def _operator(self, method: str, path: str) -> tuple[int, Any]:
        conn = self.conns.setdefault(self.port, Conn(self.port))
        status, data = conn.request(method, path, None, self.token)
        try:
            return status, json.loads(data or b"{}")
        except ValueError:
            return status, data

    def healthz(self) -> int:
        try:
            return self._operator("GET", "/healthz")[0]
        except OSError:
            return 0

    def journal(self) -> list[dict[str, Any]]:
        out = []
        for line in (self.run / "events.jsonl").read_bytes().splitlines():
            try:
                out.append(json.loads(line))
            except (ValueError, RecursionError):  # damaged on purpose by a test
                pass
        return out

    def steps(self) -> list[dict[str, Any]]:
        """The lines of ``steps.jsonl`` that are JSON objects."""
        out = []
        for line in self._steps_bytes().splitlines():
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    def step_lines(self) -> int:
        return self._steps_bytes().count(b"\n")

    def _steps_bytes(self) -> bytes:
        path = self.run / "steps.jsonl"
        return path.read_bytes() if path.exists() else b""

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    # -- the fake agents -------------------------------------------------------------------
    def register(self, node: str) -> None:
        """Register ``node``; once a generation runs, as an agent that runs its rank
        (what agents say to a supervisor that restarted)."""
        running = {}
        if self.generation:
            running = {"generation": self.generation,
                       "assignment_version": self.version.get(node, 0),
                       "ranks": [{"rank": 0 if node == self.rank0 else 1, "local_rank": 0,
                                  "pid": os.getpid()}]}
        code, body = self.send(node, "/v1/register", {
            "node_id": node, "host": f"host-{node}", "addr": "127.0.0.1", "procs": 1,
            "agent_pid": os.getpid(), **running})
        assert code == 200, body
        self.beat_port = body.get("heartbeat_port") or self.port

    def assignment(self, node: str, timeout: float = 2.0) -> dict[str, Any]:
        after = self.version.get(node, 0)
        code, body = self.send(node, f"/v1/assignment?node_id={node}&after={after}"
                                     f"&timeout={timeout}", None, method="GET")
        assert code == 200, body
        if body:
            self.version[node] = body["version"]
        return body

    def start_generation(self, timeout: float = 60) -> None:
        """Take both nodes' ``run`` assignments and report their ranks started; RUNNING."""
        orders: dict[str, dict[str, Any]] = {}

        def assigned() -> bool:
            for node in NODES:
                a = self.assignment(node, 0.5)
                if a and a.get("action") == "run":
                    orders[node] = a
            return len(orders) == len(NODES)

        wait_for(assigned, timeout, interval=0.1, what="run assignments")
        for node, a in orders.items():
            code, body = self.send(node, "/v1/events", {"node_id": node, "events": [{
                "type": "ranks_started", "generation": a["generation"],
                "ranks": [{"rank": a["rank_offset"], "local_rank": 0, "pid": os.getpid()}],
                "ts": time.time()}]})
            assert code == 200, body
            if a["rank_offset"] == 0:
                self.rank0 = node
            else:
                self.other = node
            self.generation = a["generation"]
        wait_for(lambda: self.status()["state"] == "RUNNING", timeout, what="RUNNING")

    def confirm_stops(self, timeout: float = 60) -> None:
        """Answer each node's ``stop`` order as an agent would (its rank exits, then the
        stop confirmation)."""
        stopped: set[str] = set()

        def answered() -> bool:
            for node in NODES:
                if node in stopped:
                    continue
                a = self.assignment(node, 0.5)
                if a and a.get("action") in ("stop", "idle", "health", "exit"):
                    gen = a.get("generation") or self.generation
                    rank = 0 if node == self.rank0 else 1
                    self.send(node, "/v1/events", {"node_id": node, "events": [
                        {"type": "rank_exit", "generation": gen, "rank": rank,
                         "signal": "SIGTERM", "ts": time.time()},
                        {"type": "ranks_stopped", "generation": gen, "ts": time.time()}]})
                    stopped.add(node)
            return len(stopped) == len(NODES)

        wait_for(answered, timeout, interval=0.1, what="stop orders")

    def beat(self, node: str, records: list[dict[str, Any]] | None = None, *,
             generation: int | None = -1, beat_port: bool = False,
             ) -> tuple[int, dict[str, Any]]:
        gen = self.generation if generation == -1 else generation
        body: dict[str, Any] = {"node_id": node, "generation": gen,
                                "records": records or []}
        if gen == self.generation:
            body["ranks"] = [{"rank": 0 if node == self.rank0 else 1, "local_rank": 0,
                              "step": 1, "phase": "training", "beat_ts": time.time()}]
        return self.send(node, "/v1/heartbeat", body, beat_port=beat_port)

    # -- the supervisor process ----------------------------------------------------------
    def pid(self) -> int:
        return int((self.run / "supervisor.pid").read_text())

    def kill_and_resume(self) -> None:
        """SIGKILL the supervisor, then ``up --resume --detach``: it must come back."""
        pid = self.pid()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _alive(pid), 30, what="the supervisor to die")
        self.close()
        (self.run / "supervisor.pid").unlink(missing_ok=True)
        (self.run / "supervisor.json").unlink(missing_ok=True)
        spawn_env = env() if self.tag is None else {**env(), TAG_VAR: self.tag}
        out = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--resume",
                              str(self.run), "--detach"], capture_output=True, text=True,
                             env=spawn_env, timeout=90)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        info = wait_for(lambda: _info(self.run), 60, what="the resumed supervisor.json")
        self.port = info["port"]
        wait_for(lambda: self.healthz() == 200, 60, what="the resumed supervisor")

    def stop(self) -> None:
        self.close()
        try:
            os.kill(self.pid(), signal.SIGKILL)
        except (OSError, ValueError):
            pass
        kill_strays(self.run)


def _info(run: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run / "supervisor.json").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def start(tmp: Path, dataset: Path, **sections: Any) -> Live:
    """A detached supervisor on a fresh run directory, both fake nodes registered and its
    first generation RUNNING."""
    from jobs import deep_merge

    cfg = write_config(tmp / "job.yaml", dataset, **deep_merge(CONFIG, sections))
    run = tmp / "run"
    out = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(cfg), "--run-dir",
                          str(run), "--detach"], capture_output=True, text=True, env=env(),
                         timeout=90)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    info = wait_for(lambda: _info(run), 60, what="supervisor.json")
    live = Live(run, info["port"], (run / "token").read_text().strip(),
                tag=os.environ.get(TAG_VAR))
    try:
        for node in NODES:
            live.register(node)
        live.start_generation()
    except BaseException:
        live.stop()
        raise
    return live
