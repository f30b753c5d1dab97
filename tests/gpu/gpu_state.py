"""What the memory tier's GPU tests share: a model whose every tensor one fused AdamW step
rewrites, its state as the tier sees it, and slots on shared memory as the agent makes
them (a file on disk cannot be page-locked), each of the two own slots holding the whole
state."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fakes import Box

from orchestrator.agent.memory import NodeMemory


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"s{i}.{k}"] = v
    return out


def trained(dev: torch.device) -> tuple[torch.optim.Optimizer, Callable[[], None],
                                        dict[str, Any], int]:
    """The optimizer, one training step, the state after a first step, and its bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(8192, 4096, device=dev)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()
    state = {"train": Box(_flat(model, opt))}
    nbytes = sum(t.numel() * t.element_size() for t in state["train"].value.values())
    return opt, step, state, nbytes


def slots(tmp_path: Path, nbytes: int) -> tuple[Path, NodeMemory]:
    """A shared-memory directory (the caller removes it) and one rank's slots in it."""
    shm = Path(tempfile.mkdtemp(prefix="orch-", dir="/dev/shm"))
    mem = NodeMemory(shm, tmp_path / "run", "n0")
    mem.provision([0], 1, 1, 2 * (nbytes + 2**26), partner=False)
    return shm, mem
