"""The memory tier's copies land beside the next step on a GPU (``memory_landing``): the
copy committed is the state at the save, though an optimizer step that changes every tensor
it reads is issued right after the save, while the copy still moves. Runs on the lent GPU;
skipped elsewhere."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from fakes import Box

from orchestrator.agent.memory import NodeMemory
from trainer.checkpoint import signing
from trainer.checkpoint.memory import MemoryTier

pytestmark = pytest.mark.gpu

TRUST = signing.Trust(b"k" * 32)



def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"s{i}.{k}"] = v
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_landing_beside_the_next_step_is_the_state_at_the_save(tmp_path: Path) -> None:
    dev = torch.device("cuda", 0)
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
    # Slots on shared memory, as the agent makes them (a file on disk cannot be page-locked),
    # each of the two own slots holding the whole state.
    shm = Path(tempfile.mkdtemp(prefix="orch-test-", dir="/dev/shm"))
    mem = NodeMemory(shm, tmp_path / "run", "n0")
    mem.provision([0], 1, 1, 2 * (nbytes + 2**26), partner=False)
    tier = MemoryTier(mem.path, rank=0, world_size=1, procs_per_node=1, job="j",
                      config_hash="c", generation=1, partner=False, group=None,
                      trust=lambda: TRUST, log=print, device_type="cuda", overlap=True)
    tier.prepare_saves(state)  # page-locks the slots: the copies are truly asynchronous
    tier.wait()
    try:
        for save_step in (1, 2, 3):
            torch.cuda.synchronize()
            want = {k: v.detach().cpu().clone() for k, v in state["train"].value.items()}
            tier.save(save_step, 0, state)
            # An update of every tensor the copy reads, issued at once: the copy (~4.8 GB)
            # is still moving while the fused AdamW (a few ms) would overwrite its sources.
            opt.step()
            step()  # and a whole step beside whatever is left of the copy
            tier.wait()
            torch.cuda.synchronize()
            changed = [k for k, v in want.items() if not torch.equal(
                v, state["train"].value[k].cpu())]
            assert changed, "the next step changed nothing: the test shows nothing"
            got = {"train": Box({k: torch.zeros_like(v) for k, v in want.items()})}
            plan = tier.plan(durable_step=None, max_step=None)
            assert plan.use and plan.step == save_step, plan.reason
            tier.load(plan, got)
            wrong = [k for k, v in want.items() if not torch.equal(v, got["train"].value[k])]
            assert not wrong, f"save {save_step}: {len(wrong)} tensors differ: {wrong[:4]}"
    finally:
        tier.close()
        shutil.rmtree(shm, ignore_errors=True)
