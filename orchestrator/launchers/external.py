"""Agents started by someone else: Kubernetes (an Indexed Job of agent pods, rendered by
``orchestrator deploy kubernetes``) or an operator's own tooling. The supervisor only waits
for them to register; they exit when the job ends. Each agent should get its own node's
credential (``contracts.auth.node_credential(secret, node_id)``, e.g. one Secret key per
pod, read with ``--token-file``); an agent given the job secret itself derives its
credential from it and its ``--node-id`` (``SupervisorClient``), which works but lets that
pod act as the operator."""

from __future__ import annotations

from orchestrator.contracts.events import AgentsExpected
from orchestrator.launchers.base import AgentSpec, Launcher


class ExternalLauncher(Launcher):
    kind = "kubernetes"

    async def start(self, spec: AgentSpec) -> None:
        self.record(AgentsExpected(count=self.wanted_nodes, launcher=self.kind,
                                   head_url=spec.head_url))

    async def close(self, timeout: float) -> None:
        return None  # the pods' controller owns their lifecycle
