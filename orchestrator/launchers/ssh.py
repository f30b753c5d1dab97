"""The SSH launcher: one ``orchestrator agent`` per host, over ``ssh``.

The node's credential travels on the ssh session's stdin (read into the agent's environment by the
remote shell), never on a command line where ``ps`` on either side would show it. The job's
environment (``job.env``, plus ``PYTHONPATH`` when the head has one) is set on the remote
command. Hosts come from ``launcher.ssh.hosts`` or a hostfile (one ``[user@]host[:port]`` a
line, ``#`` comments); several entries may name the same machine: distinct agents, distinct
node ranks.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from orchestrator.contracts.env import TLS_CA, TOKEN
from orchestrator.contracts.events import AgentSpawned
from orchestrator.launchers.base import (
    SAFE_PATH,
    AgentSpec,
    Launcher,
    pid_alive,
    terminate_pids,
)

# Remote agents outlive a dead supervisor (so training goes on) but not forever.
REMOTE_ORPHAN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Host:
    user: str | None
    host: str
    port: int | None

    @classmethod
    def parse(cls, text: str) -> Host:
        m = re.fullmatch(r"(?:(?P<user>[^@\s]+)@)?(?P<host>[^:@\s]+)(?::(?P<port>\d+))?",
                         text.strip())
        if not m:
            raise ValueError(f"bad host entry {text!r}: expected [user@]host[:port]")
        port = m.group("port")
        return cls(m.group("user"), m.group("host"), int(port) if port else None)

    @property
    def target(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host


def read_hosts(hosts: list[str], hostfile: str | None) -> list[Host]:
    entries = list(hosts)
    if hostfile:
        for line in Path(hostfile).expanduser().read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                entries.append(line)
    return [Host.parse(e) for e in entries]


class SSHLauncher(Launcher):
    kind = "ssh"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        ssh = self.cfg.launcher.ssh
        self.hosts = read_hosts(ssh.hosts, ssh.hostfile)
        if len(self.hosts) < self.wanted_nodes:
            raise ValueError(f"launcher.ssh lists {len(self.hosts)} hosts; the job needs "
                             f"{self.wanted_nodes} (cluster.nodes + cluster.spares)")
        self._procs: dict[str, subprocess.Popen] = {}
        self._by_node: dict[str, Host] = {}

    def node_id(self, index: int, host: Host) -> str:
        short = re.sub(r"[^A-Za-z0-9_.-]", "_", host.host.split(".")[0]) or "host"
        return f"{short}-{index}"

    def ssh_command(self, host: Host, remote: str) -> list[str]:
        ssh = self.cfg.launcher.ssh
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=15",
               "-o", "ServerAliveCountMax=4"]
        for opt in ssh.options:
            cmd += ["-o", opt]
        if ssh.identity_file:
            cmd += ["-i", str(Path(ssh.identity_file).expanduser())]
        if host.port:
            cmd += ["-p", str(host.port)]
        return [*cmd, host.target, remote]

    def remote_command(self, spec: AgentSpec, node_id: str, host: Host) -> str:
        env = dict(self.cfg.job.env)
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env_words = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        agent = " ".join(shlex.quote(w) for w in [
            spec.python, SAFE_PATH, "-m", "orchestrator", "agent", "--head", spec.head_url,
            "--node-id", node_id, "--addr", host.host,
            "--procs", str(self.cfg.cluster.procs_per_node),
            "--run-dir", str(spec.run_dir.root),
            "--orphan-timeout", str(REMOTE_ORPHAN_TIMEOUT_S)])
        if self.cfg.api.tls_ca:
            env_words += f" {TLS_CA}={shlex.quote(self.cfg.api.tls_ca)}"
        return (f"IFS= read -r {TOKEN} && export {TOKEN} && "
                f"exec env {env_words} {agent}")

    def _spawn(self, spec: AgentSpec, node_id: str, host: Host) -> None:
        spec.run_dir.agents.mkdir(parents=True, exist_ok=True)
        out = open(spec.run_dir.agents / f"{node_id}.ssh.log", "ab")
        proc = subprocess.Popen(self.ssh_command(host, self.remote_command(spec, node_id, host)),
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        out.close()
        assert proc.stdin is not None
        proc.stdin.write((spec.credential(node_id) + "\n").encode())
        proc.stdin.close()
        self._procs[node_id] = proc
        self._by_node[node_id] = host
        self.record(AgentSpawned(node_id=node_id, pid=proc.pid, launcher=self.kind,
                                 host=host.host))

    async def start(self, spec: AgentSpec) -> None:
        for i, host in enumerate(self.hosts[: self.wanted_nodes]):
            self._spawn(spec, self.node_id(i, host), host)

    async def adopt(self, spec: AgentSpec, spawned: dict[str, int]) -> None:
        for i, host in enumerate(self.hosts[: self.wanted_nodes]):
            node_id = self.node_id(i, host)
            self._by_node[node_id] = host
            if node_id in spawned and not pid_alive(spawned[node_id]):
                self._spawn(spec, node_id, host)

    async def replace(self, spec: AgentSpec, node_id: str) -> bool:
        host = self._by_node.get(node_id)
        if host is None:
            return False
        proc = self._procs.get(node_id)
        if proc is not None and proc.poll() is None:
            proc.kill()
        self._spawn(spec, node_id, host)
        return True

    async def close(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and any(p.poll() is None for p in self._procs.values()):
            await asyncio.sleep(0.1)
        live = [p.pid for p in self._procs.values() if p.poll() is None]
        await asyncio.to_thread(terminate_pids, live, 3.0)
