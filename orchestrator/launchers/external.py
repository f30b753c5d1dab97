"""Agents started by someone else: Kubernetes (a StatefulSet of agent pods, deploy/kubernetes)
or an operator's own tooling. The supervisor only waits for them to register; they read the
token from a mounted Secret (``--token-file``) and exit when the job ends."""

from __future__ import annotations

from orchestrator.events import AgentsExpected
from orchestrator.launchers.base import AgentSpec, Launcher


class ExternalLauncher(Launcher):
    kind = "kubernetes"

    async def start(self, spec: AgentSpec) -> None:
        self.record(AgentsExpected(count=self.wanted_nodes, launcher=self.kind,
                                   head_url=spec.head_url))

    async def close(self, timeout: float) -> None:
        return None  # the pods' controller owns their lifecycle
