"""How long a survivor takes to come out of a collective with a dead peer, once told.

In an in-place recovery (docs/recovery.md) the agent reports a dead rank within
milliseconds and writes each survivor a ``recover`` order; the survivor's order thread
aborts its process groups (``trainer.pgabort.abort_groups``) and its training thread, blocked
in the step, gets an error. On 2 x H200 that took 0.8-1.2 s after a SIGKILL of the peer and
0.06 s after a SIGSTOP (the peer killed once the hang was judged). This script measures it
alone, two ranks on two GPUs over NCCL, with no orchestrator:

- each rank holds ``--hold-gb`` of GPU memory (the model's state) and runs steps of
  matrix products and an all-reduce, ended by a host sync as the trainer's step is (its
  gradient norm);
- the parent kills rank 1 (``--signal KILL``, or ``STOP`` then KILL after ``--stop-s``),
  waits until ``/proc/<pid>/stat`` says it is exiting (as the agent does), and orders rank
  0 through a pipe; rank 0's order thread aborts its group (timing the call) and its
  training thread records when its step raised or returned;
- it then polls ``nvidia-smi`` until rank 1's GPU memory is released.

Usage: ``python bench/recovery/abort_latency.py --hold-gb 40 --signal KILL --repeat 3``
(``--out FILE`` writes the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _gpu_used_mib(index: int) -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits", "-i", str(index)], capture_output=True, text=True,
                             timeout=10).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _exiting(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X", "x")


def _rank(rank: int, port: int, hold_gb: float, conn, ready, order) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", TORCH_NCCL_ASYNC_ERROR_HANDLING="2")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    held = torch.empty(int(hold_gb * (1 << 30)), dtype=torch.uint8, device=dev) \
        if hold_gb > 0 else None
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    grad = torch.randn(64 << 20, device=dev)  # 256 MB reduced per step
    marks: dict[str, float] = {}

    def order_thread() -> None:
        order.recv()
        marks["order"] = time.time()
        dist.distributed_c10d._get_default_group().abort()
        marks["abort_returned"] = time.time()

    if rank == 0:
        threading.Thread(target=order_thread, daemon=True).start()
    step = 0
    try:
        while True:
            for _ in range(20):
                a = (a @ a).tanh_()
            dist.all_reduce(grad)
            float(grad.norm())  # the host sync of a real step
            step += 1
            if step == 5:
                ready.send(time.time())
    except Exception as exc:  # noqa: BLE001 - what the abort raises is the subject
        marks["raised"] = time.time()
        marks["error"] = type(exc).__name__
    marks["steps"] = step
    if rank == 0:
        # A step may have returned without raising (the abort let the kernels end): the
        # next collective raises then.
        conn.send(marks)
    del held
    time.sleep(3600)


def one(hold_gb: float, sig: str, stop_s: float, port: int, dump: str | None) -> dict:
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    ready_r, ready_w = ctx.Pipe(duplex=False)
    order_r, order_w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank, args=(r, port, hold_gb, child_conn, ready_w, order_r))
             for r in range(2)]
    for p in procs:
        p.start()
    ready_r.recv()
    ready_r.recv()
    time.sleep(0.5)
    used_before = _gpu_used_mib(1)
    victim = procs[1].pid
    t_kill = time.time()
    if sig == "STOP":
        os.kill(victim, signal.SIGSTOP)
        time.sleep(stop_s)
        t_kill = time.time()
    if sig != "NONE":
        os.kill(victim, signal.SIGKILL)
        while not _exiting(victim):
            time.sleep(0.001)
    t_seen = time.time()
    order_w.send("recover")
    stacks = []
    if dump:
        time.sleep(max(0.0, t_seen + 0.2 - time.time()))
        stacks.append(subprocess.run(dump.format(pid=procs[0].pid), shell=True,
                                     capture_output=True, text=True, timeout=60).stdout)
    marks = parent_conn.recv() if parent_conn.poll(60) else {}
    released = None
    while sig != "NONE" and time.time() - t_kill < 30:
        used = _gpu_used_mib(1)
        if used is not None and used_before is not None and used < used_before - 0.5 * \
                hold_gb * 1024:
            released = time.time() - t_kill
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return {"signal": sig, "hold_gb": hold_gb, "seen_s": round(t_seen - t_kill, 4),
            "abort_call_s": round(marks.get("abort_returned", 0) - marks.get("order", 0), 4)
            if "order" in marks else None,
            "order_to_raised_s": round(marks["raised"] - marks["order"], 4)
            if "raised" in marks and "order" in marks else None,
            "raised_before_order": "raised" in marks and "order" in marks
            and marks["raised"] < marks["order"],
            "error": marks.get("error"), "gpu_released_s": None if released is None
            else round(released, 3), "stacks": stacks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-gb", type=float, nargs="+", default=[40.0])
    ap.add_argument("--signal", nargs="+", default=["KILL", "STOP"], choices=["KILL", "STOP", "NONE"])
    ap.add_argument("--stop-s", type=float, default=1.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump", default=None, help="a shell command run 0.2 s into rank 0's "
                    "abort, {pid} its pid (cuda-gdb -p {pid} -batch -ex 'thread apply all bt'): "
                    "its output is kept in the result")
    args = ap.parse_args()
    runs = []
    port = 29600
    for hold in args.hold_gb:
        for sig in args.signal:
            for _ in range(args.repeat):
                port += 1
                r = one(hold, sig, args.stop_s, port, args.dump)
                print(json.dumps({k: v for k, v in r.items() if k != 'stacks'}), flush=True)
                runs.append(r)
    result = {"script": "bench/recovery/abort_latency.py", "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
              "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
