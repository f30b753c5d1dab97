"""A plain PyTorch DDP training loop made fault-tolerant with the worker SDK (the README's
example, runnable): its own checkpoint file, its own data, nothing from our trainer."""

import os
import sys

import torch
import torch.distributed as dist

import orchestrator.worker as ow

STEPS = int(os.environ.get("STEPS", "30"))
CKPT = os.environ["CKPT"]


def main() -> int:
    ow.init()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    with ow.phase("loading"):
        if os.path.exists(CKPT):
            state = torch.load(CKPT)
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"]
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ow.step_done(step + 1, loss=loss.item())
        if (step + 1) % 5 == 0 and rank == 0:
            with ow.phase("checkpointing"):
                tmp = CKPT + ".tmp"
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, tmp)
                os.replace(tmp, CKPT)
        dist.barrier()
    if rank == 0:
        print("final", model.module.weight.detach().tolist(), flush=True)
    dist.destroy_process_group()
    ow.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
