"""A rank's memory-tier copies made by its standby through CUDA IPC (``copier``): the rank
lets go of its page-locked slots, the committed copy is the state at the save though the
next optimizer step is issued while it moves, and a restore into fresh tensors comes back
through the copier too. Then the standby goes away and the rank copies on its own again.
Runs on the lent GPU; skipped elsewhere."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fakes import Box
from gpu_state import slots, trained

from trainer.checkpoint import signing
from trainer.checkpoint.memory import MemoryTier

pytestmark = pytest.mark.gpu

TRUST = signing.Trust(b"k" * 32)
ROOT = Path(__file__).resolve().parents[2]

_STANDBY = """
import sys, time, torch
from pathlib import Path
from trainer.checkpoint.memory_slots import serve_own_slots
torch.cuda.set_device(0)
torch.empty(1, device="cuda")
serve_own_slots(Path(sys.argv[1]), 0, lambda m: print(m, flush=True))
print("serving", flush=True)
time.sleep(600)
"""


def _wait(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_standby_copies_for_a_rank_that_page_locks_nothing(tmp_path: Path) -> None:
    opt, step, state, nbytes = trained(torch.device("cuda", 0))
    shm, mem = slots(tmp_path, nbytes)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    standby = subprocess.Popen([sys.executable, "-c", _STANDBY, str(mem.path)], env=env,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    logs: list[str] = []
    tier = MemoryTier(mem.path, rank=0, world_size=1, procs_per_node=1, job="j",
                      config_hash="c", generation=1, partner=False, group=None,
                      trust=lambda: TRUST, log=logs.append, device_type="cuda",
                      overlap=True, copier=True)
    try:
        assert standby.stdout.readline().strip() == "serving"
        tier.prepare_saves(state)  # this rank page-locks its slots first, as at a start
        tier.wait()
        assert tier._pinned, "the rank could not page-lock its own slots"
        tier.save(0, 0, state)  # on its own: no copier is asked before a first save
        assert type(tier._copies.last).__name__ == "Landing"
        tier.wait()
        assert tier._copier_for_save() is not None or _wait(
            lambda: tier._copier_for_save() is not None), logs
        tier.wait()
        assert _wait(lambda: not tier._pinned and not tier.slots.pinned), \
            "the rank kept its slots page-locked"
        for save_step in (1, 2, 3):  # now the standby's
            torch.cuda.synchronize()
            want = {k: v.detach().cpu().clone() for k, v in state["train"].value.items()}
            tier.save(save_step, 0, state)
            assert type(tier._copies.last).__name__ == "CopierLanding", logs
            opt.step()  # rewrites every tensor the standby is about to copy
            step()
            tier.wait()
            torch.cuda.synchronize()
            assert [k for k, v in want.items()
                    if not torch.equal(v, state["train"].value[k].cpu())], "nothing changed"
            got = {"train": Box({k: torch.zeros_like(v) for k, v in want.items()})}
            plan = tier.plan(durable_step=None, max_step=None)
            assert plan.use and plan.step == save_step, plan.reason
            tier.load(plan, got)  # into fresh tensors: shared, then copied by the standby
            wrong = [k for k, v in want.items() if not torch.equal(v, got["train"].value[k])]
            assert not wrong, f"save {save_step}: {len(wrong)} tensors differ: {wrong[:4]}"
        # The standby goes away: the rank page-locks its slots again and saves on its own.
        os.killpg(standby.pid, signal.SIGKILL)
        standby.wait()
        assert _wait(lambda: tier._copier is not None and tier._copier.dead is not None)
        tier.save(4, 0, state)  # skipped: the slots are being page-locked again
        assert tier.last_step == 3
        assert _wait(lambda: tier._repin is not None and tier._repin.done())
        torch.cuda.synchronize()
        want = {k: v.detach().cpu().clone() for k, v in state["train"].value.items()}
        tier.save(5, 0, state)
        assert type(tier._copies.last).__name__ == "Landing"
        tier.wait()
        got = {"train": Box({k: torch.zeros_like(v) for k, v in want.items()})}
        plan = tier.plan(durable_step=None, max_step=None)
        assert plan.use and plan.step == 5, plan.reason
        tier.load(plan, got)
        assert all(torch.equal(v, got["train"].value[k]) for k, v in want.items())
    finally:
        tier.close()
        if standby.poll() is None:
            os.killpg(standby.pid, signal.SIGKILL)
            standby.wait()
        shutil.rmtree(shm, ignore_errors=True)
