"""The Slurm launcher: inside an allocation, ``srun`` one agent per node.

Run ``orchestrator up`` inside ``salloc``/``sbatch``: the nodes come from
``SLURM_JOB_NODELIST``, and one ``srun`` step starts ``agents_per_node`` agents on each (one
for a real cluster; more lets a single machine act as several nodes in tests). Each agent's
node id is ``slurm-<SLURM_PROCID>``, known only inside the task, so each node's credential is
written beforehand to ``<run dir>/agents/credentials/<node id>`` (0600, on the allocation's
shared filesystem) and the task's shell reads its own into ``ORCH_TOKEN``: never on a command
line, and the job secret never reaches the tasks.
"""

from __future__ import annotations

import asyncio
import math
import os
import shlex
import shutil
import subprocess

from orchestrator.contracts.env import TLS_CA, TOKEN
from orchestrator.contracts.events import AgentSpawned
from orchestrator.launchers.base import (
    SAFE_PATH,
    AgentSpec,
    Launcher,
    pid_alive,
    terminate_pids,
)
from orchestrator.launchers.ssh import REMOTE_ORPHAN_TIMEOUT_S


def expand_nodelist(nodelist: str) -> list[str]:
    """``node[01-03],gpu7`` -> hostnames, through ``scontrol show hostnames``."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, check=True, timeout=30)
    return [h for h in out.stdout.split() if h]


class SlurmLauncher(Launcher):
    kind = "slurm"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps: list[subprocess.Popen] = []

    def _agent_script(self, spec: AgentSpec, node_id: str) -> str:
        slurm = self.cfg.launcher.slurm
        words = [spec.python, SAFE_PATH, "-m", "orchestrator", "agent",
                 "--head", spec.head_url,
                 "--procs", str(self.cfg.cluster.procs_per_node),
                 "--run-dir", str(spec.run_dir.root),
                 "--orphan-timeout", str(REMOTE_ORPHAN_TIMEOUT_S)]
        creds = shlex.quote(str(spec.run_dir.credentials))
        # node id and address are expanded by each task's shell, from its own environment.
        return (f"IFS= read -r {TOKEN} < {creds}/{node_id} && export {TOKEN} && "
                f"exec {' '.join(shlex.quote(w) for w in words)} --node-id {node_id} "
                f"--addr {slurm.addr}")

    def _srun(self, spec: AgentSpec, args: list[str], node_id: str, name: str) -> None:
        if shutil.which("srun") is None:
            raise RuntimeError("launcher.kind slurm needs srun on the PATH")
        env = {k: v for k, v in os.environ.items() if k != TOKEN}
        env.update(self.cfg.job.env)
        if self.cfg.api.tls_ca:
            env[TLS_CA] = self.cfg.api.tls_ca
        spec.run_dir.agents.mkdir(parents=True, exist_ok=True)
        out = open(spec.run_dir.agents / f"{name}.srun.log", "ab")
        cmd = ["srun", "--export=ALL", "--kill-on-bad-exit=0", "--job-name=orchestrator-agent",
               *args, *self.cfg.launcher.slurm.srun_args, "bash", "-c",
               self._agent_script(spec, node_id)]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self._steps.append(proc)
        self.record(AgentSpawned(node_id=name, pid=proc.pid, launcher=self.kind))

    async def start(self, spec: AgentSpec) -> None:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not os.environ.get("SLURM_JOB_ID") or not nodelist:
            raise RuntimeError("launcher.kind slurm runs inside an allocation: start "
                               "`orchestrator up` under salloc or sbatch")
        hosts = expand_nodelist(nodelist)
        per_node = self.cfg.launcher.slurm.agents_per_node
        wanted = self.wanted_nodes
        if len(hosts) * per_node < wanted:
            raise RuntimeError(f"the allocation has {len(hosts)} node(s) x {per_node} agent(s); "
                               f"the job needs {wanted} (cluster.nodes + cluster.spares)")
        nodes = math.ceil(wanted / per_node)
        for i in range(wanted):
            # One line: the task's `read` fails on a last line with no newline.
            spec.run_dir.write_secret(spec.run_dir.credentials / f"slurm-{i}",
                                      spec.credential(f"slurm-{i}") + "\n")
        self._srun(spec, [f"--nodes={nodes}", f"--ntasks={wanted}",
                          f"--ntasks-per-node={per_node}"], "slurm-$SLURM_PROCID", "srun")

    async def adopt(self, spec: AgentSpec, spawned: dict[str, int]) -> None:
        # The srun step of the supervisor before us still runs its agents; they re-register.
        if not any(pid_alive(pid) for pid in spawned.values()):
            await self.start(spec)

    async def replace(self, spec: AgentSpec, node_id: str) -> bool:
        """One more srun task for a lost node id (on any node of the allocation)."""
        if not node_id.startswith("slurm-"):
            return False
        spec.run_dir.write_secret(spec.run_dir.credentials / node_id,
                                  spec.credential(node_id) + "\n")
        self._srun(spec, ["--nodes=1", "--ntasks=1", "--overlap"], shlex.quote(node_id),
                   node_id)
        return True

    async def close(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and any(p.poll() is None for p in self._steps):
            await asyncio.sleep(0.1)
        await asyncio.to_thread(terminate_pids, [p.pid for p in self._steps
                                                 if p.poll() is None], 3.0)
