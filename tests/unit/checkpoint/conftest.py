"""Fixtures the checkpoint tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group, as the trainer's checkpoint group would be."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
