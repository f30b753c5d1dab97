"""A plain PyTorch DDP loop with the worker SDK's in-job recovery: its state registered
with ``ow.recoverable``, a peer's death recovered in this process. Its data is a function of
(step, rank), so an interrupted run must end bit-identical to an uninterrupted one; it
prints its final weights as the hex of their bytes."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import orchestrator.worker as ow

STEPS = int(os.environ.get("STEPS", "30"))
STEP_S = float(os.environ.get("STEP_S", "0"))  # a step's time, as a real model's


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 100 + rank))


def main() -> int:
    ow.init()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    ddp = {"model": DDP(net)}

    def regroup() -> None:  # DDP holds the default group: wrap again in the new one
        ddp["model"] = DDP(net)

    state = ow.recoverable(model=net, optimizer=opt, regroup=regroup)
    step = state.restore()
    print(f"starting at step {step} in pid {os.getpid()}", flush=True)
    while step < STEPS:
        try:
            x = batch(step, dist.get_rank())
            loss = (ddp["model"](x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(STEP_S)
            step += 1
            state.step_done(step, loss=loss.item())
        except Exception as exc:  # noqa: BLE001 - a peer's failure is recovered in place
            step = state.recover(exc)
    state.close()
    if dist.get_rank() == 0:
        data = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        print("final", data.numpy().tobytes().hex(), flush=True)
    dist.destroy_process_group()
    ow.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
