"""The memory tier's copies land beside the next step on a GPU (``memory_landing``): the
copy committed is the state at the save, though an optimizer step that changes every tensor
it reads is issued right after the save, while the copy still moves. Runs on the lent GPU;
skipped elsewhere."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fakes import Box
from gpu_state import slots, trained

from trainer.checkpoint import signing
from trainer.checkpoint.memory import MemoryTier

pytestmark = pytest.mark.gpu

TRUST = signing.Trust(b"k" * 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_landing_beside_the_next_step_is_the_state_at_the_save(tmp_path: Path) -> None:
    opt, step, state, nbytes = trained(torch.device("cuda", 0))
    shm, mem = slots(tmp_path, nbytes)
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
