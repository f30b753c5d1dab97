"""The local launcher: one agent process per simulated node on this host."""

from __future__ import annotations

import asyncio
import os
import subprocess

from orchestrator.contracts.events import AgentSpawned
from orchestrator.launchers.base import (
    AgentSpec,
    Launcher,
    agent_command,
    pid_alive,
    terminate_pids,
)

# An agent that cannot reach its supervisor for this long, with no rank alive, exits:
# a simulated node must not outlive an abandoned test or demo by much.
LOCAL_ORPHAN_TIMEOUT_S = 120.0


class LocalLauncher(Launcher):
    kind = "local"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._procs: dict[str, subprocess.Popen] = {}
        self._adopted: dict[str, int] = {}

    def _spawn(self, spec: AgentSpec, node_id: str) -> None:
        spec.run_dir.agents.mkdir(parents=True, exist_ok=True)
        out = open(spec.run_dir.agents / f"{node_id}.out", "ab")
        env = {**os.environ, **self.agent_env(spec, node_id), "PYTHONUNBUFFERED": "1"}
        cmd = agent_command(spec, node_id, addr="127.0.0.1",
                            procs=self.cfg.cluster.procs_per_node,
                            orphan_timeout_s=LOCAL_ORPHAN_TIMEOUT_S)
        # A new session: Ctrl-C on the supervisor's terminal must not reach the agents
        # directly; the supervisor stops them in order (and a killed supervisor leaves
        # them training, by design).
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        self._procs[node_id] = proc
        self.record(AgentSpawned(node_id=node_id, pid=proc.pid, launcher=self.kind))

    async def start(self, spec: AgentSpec) -> None:
        for i in range(self.wanted_nodes):
            self._spawn(spec, f"local-{i}")

    async def adopt(self, spec: AgentSpec, spawned: dict[str, int]) -> None:
        self._adopted = {n: pid for n, pid in spawned.items() if pid_alive(pid)}
        for node_id in spawned:
            if node_id not in self._adopted:
                self._spawn(spec, node_id)

    async def replace(self, spec: AgentSpec, node_id: str) -> bool:
        proc = self._procs.get(node_id)
        if proc is not None and proc.poll() is None:
            proc.kill()
        pid = self._adopted.pop(node_id, None)
        if pid is not None and pid_alive(pid):
            terminate_pids([pid], 1.0)
        self._spawn(spec, node_id)
        return True

    async def close(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            live = [p for p in self._procs.values() if p.poll() is None]
            live_adopted = [pid for pid in self._adopted.values() if pid_alive(pid)]
            if not live and not live_adopted:
                return
            await asyncio.sleep(0.1)
        pids = [p.pid for p in self._procs.values() if p.poll() is None]
        pids += [pid for pid in self._adopted.values() if pid_alive(pid)]
        await asyncio.to_thread(terminate_pids, pids, 3.0)
        for p in self._procs.values():
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
