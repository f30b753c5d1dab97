"""A user's own DDP training script with the worker SDK's in-job recovery (``ow.recoverable``),
for ``recovery.py --profile sdk-gpu2``: on GPUs over NCCL (gloo on a CPU), a stack of
``LAYERS`` linear layers of width ``HIDDEN``, Adam, random batches that are a function of
(step, rank). Nothing of our trainer runs: the script registers its model and optimizer,
reports each step, and calls ``recover`` when a step fails.

    STEPS=500 HIDDEN=4096 LAYERS=8 BATCH=64 python bench/recovery/sdk_script.py  # under up
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import orchestrator.worker as ow

STEPS = int(os.environ.get("STEPS", "500"))
HIDDEN = int(os.environ.get("HIDDEN", "1024"))
LAYERS = int(os.environ.get("LAYERS", "4"))
BATCH = int(os.environ.get("BATCH", "64"))


def main() -> int:
    ow.init()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    ids = [local] if cuda else None
    ddp = {"model": DDP(net, device_ids=ids)}

    def regroup() -> None:  # DDP holds the default group: wrap again in the new one
        ddp["model"] = DDP(net, device_ids=ids)

    state = ow.recoverable(model=net, optimizer=opt, regroup=regroup)
    step = state.restore()
    rank = dist.get_rank()
    print(f"rank {rank} starting at step {step}", flush=True)
    while step < STEPS:
        try:
            g = torch.Generator().manual_seed(step * 1000 + rank)
            x = torch.randn(BATCH, HIDDEN, generator=g).to(device, non_blocking=True)
            loss = ddp["model"](x).float().pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            state.step_done(step, loss=loss.item())
        except Exception as exc:  # noqa: BLE001 - a peer's failure is recovered in place
            step = state.recover(exc)
    state.close()
    dist.destroy_process_group()
    ow.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
