"""A torchrun-style DDP script that knows nothing of the orchestrator: no SDK, plain
``torch.distributed``, torch elastic's ``@record``. Written for the torchrun-parity tests.

Environment (all optional):
  STEPS       optimizer steps to run (default 20)
  STEP_S      seconds each step sleeps, standing in for compute (default 0)
  ENV_OUT     directory: write this rank's environment there as rank-N.json, first thing,
              and its working directory as cwd-N.txt
  RAISE_RANK  rank that raises ValueError ...
  RAISE_STEP  ... after this step (under @record, so its error file carries the traceback)
  SNAPSHOT    a file rank 0 saves {"step": n} to every 5 steps and every rank resumes from
  DEFAULT_SIGUSR1_RANK  rank that resets SIGUSR1 to its default action (kills the process):
              a script that replaced the stack-dump handler
  EVAL_EVERY  rank 0 evaluates every N steps (model.eval(), no_grad) ...
  EVAL_S      ... for this many seconds (default 0) while the others wait in their next step
  SAVE_EVERY  rank 0 saves the model with torch.save every N steps ...
  SAVE_S      ... to a slow disk: the save takes this many seconds (default 0)
"""

import gc
import io
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


class SlowDisk(io.BytesIO):
    """A file whose writes take ``seconds`` in all (a slow shared filesystem)."""

    def __init__(self, path: str, seconds: float) -> None:
        super().__init__()
        self.path, self.seconds = path, seconds

    def write(self, data) -> int:
        if self.seconds:  # inside torch.save: the first write waits for the disk
            time.sleep(self.seconds)
            self.seconds = 0.0
        return super().write(data)

    def close(self) -> None:
        with open(self.path, "wb") as f:
            f.write(self.getvalue())
        super().close()


def main() -> None:
    out = os.environ.get("ENV_OUT")
    if out:
        path = os.path.join(out, f"rank-{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump(dict(os.environ), f)
        with open(os.path.join(out, f"cwd-{os.environ['RANK']}.txt"), "w") as f:
            f.write(os.getcwd())
    steps = int(os.environ.get("STEPS", "20"))
    step_s = float(os.environ.get("STEP_S", "0"))
    raise_rank = int(os.environ.get("RAISE_RANK", "-1"))
    raise_step = int(os.environ.get("RAISE_STEP", "-1"))
    snapshot = os.environ.get("SNAPSHOT")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == int(os.environ.get("DEFAULT_SIGUSR1_RANK", "-1")):
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if snapshot and os.path.exists(snapshot):
        start = json.load(open(snapshot))["step"]
        print(f"rank {rank}: resuming at step {start}", flush=True)
    for step in range(start, steps):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank}: step {step + 1} loss {loss.item():.4f}", flush=True)
        if rank == raise_rank and step + 1 == raise_step:
            raise ValueError(f"boom at step {step + 1} on rank {rank}")
        if snapshot and rank == 0 and (step + 1) % 5 == 0:
            with open(snapshot + ".tmp", "w") as f:
                json.dump({"step": step + 1}, f)
            os.replace(snapshot + ".tmp", snapshot)
        if rank == 0 and every(step, "EVAL_EVERY"):
            model.eval()
            with torch.no_grad():
                model(torch.randn(64, 4)).sum().item()
            time.sleep(float(os.environ.get("EVAL_S", "0")))
            model.train()
        if rank == 0 and every(step, "SAVE_EVERY"):
            disk = SlowDisk(os.path.join(os.getcwd(), "model.pt"),
                            float(os.environ.get("SAVE_S", "0")))
            torch.save(model.state_dict(), disk)
            disk.close()
        if step_s:
            time.sleep(step_s)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


def every(step: int, name: str) -> bool:
    n = int(os.environ.get(name, "0"))
    return n > 0 and (step + 1) % n == 0


if __name__ == "__main__":
    record(main)()
    # Free the DDP model and its gloo group now: left to the interpreter's finalization, a
    # gloo worker that still holds the last backward's work releases a Python object there
    # and the process aborts at exit (torch 2.13; "terminate called without an active
    # exception").
    gc.collect()
