"""Launchers: how agents get started on the nodes (local, ssh, slurm, kubernetes, sagemaker)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orchestrator.config.schema import Config
from orchestrator.launchers.base import AgentSpec, Launcher


def build_launcher(cfg: Config, record: Callable[..., dict[str, Any]]) -> Launcher:
    kind = cfg.launcher.kind
    if kind == "local":
        from orchestrator.launchers.local import LocalLauncher

        return LocalLauncher(cfg, record)
    if kind == "ssh":
        from orchestrator.launchers.ssh import SSHLauncher

        return SSHLauncher(cfg, record)
    if kind == "slurm":
        from orchestrator.launchers.slurm import SlurmLauncher

        return SlurmLauncher(cfg, record)
    if kind == "kubernetes":
        from orchestrator.launchers.external import ExternalLauncher

        return ExternalLauncher(cfg, record)
    if kind == "sagemaker":
        from orchestrator.launchers.sagemaker import SageMakerLauncher

        return SageMakerLauncher(cfg, record)
    raise ValueError(f"launcher.kind {kind!r} is not available in this build")


__all__ = ["AgentSpec", "Launcher", "build_launcher"]
