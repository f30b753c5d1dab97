"""A torchrun-style DDP script that snapshots into its working directory, the way
pytorch/examples' ``multinode.py`` does: rank 0 saves ``snapshot.pt`` (model, Adam state, the
step) every SAVE_EVERY steps, and every rank resumes from ``./snapshot.pt`` when it is there.
No SDK. Ranks that do not share their working directory resume from different steps.

Environment: STEPS (default 40), SAVE_EVERY (5), STEP_S (seconds a step sleeps, 0.05),
KILL_RANK / KILL_STEP (that rank SIGKILLs itself after that step, in the first generation).
"""

import os
import signal
import time

import torch
import torch.distributed as dist


def main() -> None:
    steps = int(os.environ.get("STEPS", "40"))
    save_every = int(os.environ.get("SAVE_EVERY", "5"))
    step_s = float(os.environ.get("STEP_S", "0.05"))
    kill_rank = int(os.environ.get("KILL_RANK", "-1"))
    kill_step = int(os.environ.get("KILL_STEP", "-1"))
    first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists("snapshot.pt"):
        snap = torch.load("snapshot.pt", weights_only=False)
        model.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optim"])
        start = snap["step"]
        print(f"rank {rank}: resuming from snapshot at step {start}", flush=True)
    for step in range(start, steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank}: step {step + 1}", flush=True)
        if rank == 0 and (step + 1) % save_every == 0:
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(),
                        "step": step + 1}, "snapshot.pt.tmp")
            os.replace("snapshot.pt.tmp", "snapshot.pt")
        if first_generation and rank == kill_rank and step + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(step_s)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
