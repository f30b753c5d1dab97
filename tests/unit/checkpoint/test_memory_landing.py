"""What of the memory tier's overlapped copies can be checked without a GPU: who turns them
on, and the host's wait for a copy (its cancel). The copies themselves on a GPU:
tests/gpu/test_memory_overlap.py."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from orchestrator.agent.memory import NodeMemory
from trainer.build import persistent_buffers
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.memory_landing import Landing
from trainer.model import build_model
from trainer.presets import PRESETS


class Event:
    """A CUDA event's ``query``: True once ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done.is_set()


def test_a_wait_ends_when_the_copies_land_or_a_recovery_cancels_it() -> None:
    event, cancel = Event(), threading.Event()
    landing = Landing(event, torch.device("cpu"))  # type: ignore[arg-type]
    threading.Timer(0.05, event.done.set).start()
    assert landing.wait(cancel) and event.queries > 1
    stuck = Landing(Event(), torch.device("cpu"))  # type: ignore[arg-type]
    threading.Timer(0.05, cancel.set).start()
    assert stuck.wait(cancel) is False


def test_only_a_gpu_rank_of_a_model_without_persistent_buffers_overlaps(tmp_path: Path) -> None:
    # Our model keeps its RoPE tables out of its state dict: every tensor a copy reads is
    # a parameter or optimizer state, which only the optimizer step changes.
    assert persistent_buffers(build_model(PRESETS["tiny"])) == []
    norm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    assert persistent_buffers(norm) == ["1.running_mean", "1.running_var",
                                        "1.num_batches_tracked"]
    mem = NodeMemory(tmp_path, tmp_path / "run", "n0")
    mem.provision([0], 1, 1, 2**20, partner=False)
    args = {"rank": 0, "world_size": 1, "procs_per_node": 1, "job": "j", "config_hash": "c",
            "generation": 1, "partner": False, "group": None, "trust": lambda: None,
            "log": lambda _m: None}
    assert MemoryTier(mem.path, device_type="cuda", overlap=True, **args).overlap
    assert not MemoryTier(mem.path, device_type="cpu", overlap=True, **args).overlap
    assert not MemoryTier(mem.path, device_type="cuda", **args).overlap
