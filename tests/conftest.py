"""Shared fixtures: a small prepared dataset, job configs, and running real jobs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level shards of 1 MiB of the stdlib's source, prepared once per session."""
    from trainer.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "stdlib-1m"
    prepare_dataset("stdlib", out, "byte", max_bytes=1 << 20)
    return out


@pytest.fixture(autouse=True)
def _no_inherited_orchestrator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A test run from inside a rank (or a developer shell) must not leak worker settings.
    for key in list(os.environ):
        if key.startswith("ORCH_"):
            monkeypatch.delenv(key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests run only where CUDA is (the lent H100); elsewhere they are skipped."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
