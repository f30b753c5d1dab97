"""Launchers start ``orchestrator agent --head URL`` on every node; nothing more.

Training itself runs on torch.distributed; the launcher only gets one agent per node
running with *its own* credential in its environment (never on its command line, where
``ps`` would show it): ``HMAC(job secret, node id)`` from ``contracts.auth``, so an agent
can speak for its own node only and never holds the job secret.
"""

from __future__ import annotations

import abc
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.contracts.auth import node_credential
from orchestrator.config.schema import Config
from orchestrator.contracts.env import TLS_CA, token_env
from orchestrator.contracts.rundir import RunDir


@dataclass(frozen=True)
class AgentSpec:
    """What every agent needs: where the supervisor is and how to prove it is ours."""

    head_url: str
    token: str  # the job secret: launchers hand each agent ``credential(node_id)`` instead
    run_dir: RunDir
    python: str

    def credential(self, node_id: str) -> str:
        return node_credential(self.token, node_id)


class Launcher(abc.ABC):
    """Starts agents. ``record`` writes a journal event (so a restarted supervisor knows)."""

    kind: str = ""

    def __init__(self, cfg: Config, record: Callable[..., dict[str, Any]]) -> None:
        self.cfg = cfg
        self.record = record

    @property
    def wanted_nodes(self) -> int:
        return self.cfg.cluster.nodes + self.cfg.cluster.spares

    def agent_env(self, spec: AgentSpec, node_id: str) -> dict[str, str]:
        """The variables an agent gets from its launcher: its credential, the CA bundle."""
        env = token_env(spec.credential(node_id))
        if self.cfg.api.tls_ca:
            env[TLS_CA] = self.cfg.api.tls_ca
        return env

    @abc.abstractmethod
    async def start(self, spec: AgentSpec) -> None:
        """Start one agent per node (they then register on their own)."""

    async def adopt(self, spec: AgentSpec, spawned: dict[str, int]) -> None:
        """After a supervisor restart: take over agents started by the one before."""

    async def replace(self, spec: AgentSpec, node_id: str) -> bool:
        """Try to bring a lost node's agent back; False when this launcher cannot."""
        return False

    @abc.abstractmethod
    async def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for agents to exit (they were told to), then stop them."""


# Our own processes run with a sys.path the working directory cannot shadow (Python 3.11's
# -P): `up` started in a directory holding a user's `trainer.py` must not break the agents.
SAFE_PATH = "-P"


def agent_command(spec: AgentSpec, node_id: str, *, addr: str, procs: int,
                  orphan_timeout_s: float) -> list[str]:
    return [spec.python, SAFE_PATH, "-m", "orchestrator", "agent",
            "--head", spec.head_url, "--node-id", node_id, "--addr", addr,
            "--procs", str(procs), "--run-dir", str(spec.run_dir.root),
            "--orphan-timeout", str(orphan_timeout_s)]


def default_python(cfg: Config) -> str:
    return cfg.launcher.python or sys.executable


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate_pids(pids: list[int], grace: float) -> None:
    """SIGTERM each live pid, SIGKILL whatever still lives after ``grace`` seconds."""
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
