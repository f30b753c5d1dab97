"""Helpers for the health-check unit tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.health.base import Level
from orchestrator.health.config import HealthConfig
from orchestrator.health.context import NodeContext, build_node_context


@pytest.fixture
def make_ctx(tmp_path: Path):
    """A CPU node's context over ``tmp_path`` (checkpoint root, scratch dir)."""

    def make(checks: list[str], node_id: str = "local-0", **health: Any) -> NodeContext:
        cfg = HealthConfig(**({"scratch_dir": str(tmp_path / "scratch" / "{node_id}")}
                              | health))
        return build_node_context(cfg, nonce="n0nce", node_id=node_id, level=Level.FULL,
                                  checks=checks, accelerator="cpu", devices=1,
                                  checkpoint_root=str(tmp_path / "ckpt"))
    return make
