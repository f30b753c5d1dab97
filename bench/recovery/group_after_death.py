"""How long the next NCCL process group takes to form right after a rank's death.

In an in-place recovery on 2 x H200 the survivor and the replacement both reached the new
rendezvous within 0.1-0.9 s of the kill, yet their default group (``init_process_group``
with ``device_id``: the NCCL communicator made at once) was ready only 1.3-2.9 s after the
kill, 0.5-2.3 s after both had arrived (``bench/results/recovery-gpu2-overlap-abort-ab-
h200.json``). This script asks why, with two GPUs and no orchestrator:

- **fresh**: two warm processes (CUDA context made, nothing else) on GPU 0 and GPU 1 make a
  group together: NCCL's own set-up time.
- **after death**: a survivor on GPU 0 trains with a victim on GPU 1 that holds
  ``--hold-gb`` of GPU memory and has ``--pin-gb`` of shared host memory registered
  (``cudaHostRegister``, as the memory tier's slots are); the victim is SIGKILLed, the
  survivor aborts its group and leaves it, then makes a new one with a warm replacement on
  GPU 1, either at once (``now``) or once ``nvidia-smi`` no longer lists the victim
  (``released``: its GPU context torn down).

Each case reports the group's set-up seconds (the later of the two ranks' ``init_process_group``
returns, from the moment both called it), the first all-reduce, and in the death cases
the kill -> victim reaped and kill -> GPU released times.

    python bench/recovery/group_after_death.py --hold-gb 60 --pin-gb 7 --repeat 2 \\
        --variant default --variant nocumem:NCCL_CUMEM_ENABLE=0 --out F
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _gpu_pids() -> set[int] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
        return {int(x) for x in out.split() if x.strip().isdigit()}
    except (OSError, subprocess.TimeoutExpired):
        return None


def _join(rank: int, port: int, dev):
    """init_process_group on ``port``: (call time, return time); then a first all-reduce."""
    import datetime

    import torch
    import torch.distributed as dist

    t0 = time.time()
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    t1 = time.time()
    x = torch.ones(1 << 20, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t2 = time.time()
    return t0, t1, t2


def _warm(rank_gpu: int):
    import torch

    torch.cuda.set_device(rank_gpu)
    dev = torch.device("cuda", rank_gpu)
    torch.empty(1, device=dev)
    return dev


def replacement(rank: int, gpu: int, conn) -> None:
    """A warm process: context made, then joins a group on the port it is sent."""
    dev = _warm(gpu)
    conn.send("ready")
    port = conn.recv()
    conn.send(_join(rank, port, dev))
    conn.recv()


def victim(port: int, hold_gb: float, pin_gb: float, shm: str, conn) -> None:
    import torch
    import torch.distributed as dist

    dev = _warm(1)
    held = torch.empty(int(hold_gb * (1 << 30)), dtype=torch.uint8, device=dev) \
        if hold_gb > 0 else None
    if pin_gb > 0:
        n = int(pin_gb * (1 << 30))
        host = torch.from_file(shm, shared=True, size=n, dtype=torch.uint8)
        host[:: 1 << 12] = 1  # fault the pages in
        torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 0)
    _join(1, port, dev)
    grad = torch.randn(64 << 20, device=dev)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    conn.send("ready")
    while True:
        for _ in range(20):
            a = (a @ a).tanh_()
        dist.all_reduce(grad)
        float(grad.norm())
    del held


def survivor(port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    dev = _warm(0)
    _join(0, port, dev)
    grad = torch.randn(64 << 20, device=dev)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    marks: dict[str, float] = {}

    def order() -> None:
        conn.recv()
        marks["order"] = time.time()
        dist.distributed_c10d._get_default_group().abort()
        marks["aborted"] = time.time()

    threading.Thread(target=order, daemon=True).start()
    conn.send("ready")
    try:
        while True:
            for _ in range(20):
                a = (a @ a).tanh_()
            dist.all_reduce(grad)
            float(grad.norm())
    except Exception:  # noqa: BLE001 - the abort's error is expected
        marks["raised"] = time.time()
    while "aborted" not in marks:
        time.sleep(0.001)
    dist.destroy_process_group()
    marks["left"] = time.time()
    conn.send(marks)
    new_port = conn.recv()
    conn.send(_join(0, new_port, dev))
    conn.recv()


def _result(a, b) -> dict:
    (a0, a1, a2), (b0, b1, b2) = a, b
    both = max(a0, b0)
    return {"group_s": round(max(a1, b1) - both, 4), "first_all_reduce_s":
            round(max(a2, b2) - max(a1, b1), 4), "arrival_gap_s": round(abs(a0 - b0), 4),
            "at": both}


def fresh(port: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=replacement, args=(r, r, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    for parent, _ in pipes:
        parent.recv()
    for parent, _ in pipes:
        parent.send(port)
    out = _result(pipes[0][0].recv(), pipes[1][0].recv())
    for parent, _ in pipes:
        parent.send("bye")
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    out.pop("at")
    return {"case": "fresh", **out}


def after_death(mode: str, port: int, hold_gb: float, pin_gb: float, shm: str) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    s_parent, s_child = ctx.Pipe()
    v_parent, v_child = ctx.Pipe()
    r_parent, r_child = ctx.Pipe()
    procs = [ctx.Process(target=survivor, args=(port, s_child)),
             ctx.Process(target=victim, args=(port, hold_gb, pin_gb, shm, v_child)),
             ctx.Process(target=replacement, args=(1, 1, r_child))]
    for p in procs:
        p.start()
    for conn in (s_parent, v_parent, r_parent):
        conn.recv()
    time.sleep(1.0)
    vpid = procs[1].pid
    t_kill = time.time()
    os.kill(vpid, signal.SIGKILL)
    procs[1].join()
    t_reaped = time.time()
    s_parent.send("order")
    marks = s_parent.recv()
    if mode == "released":
        while True:
            pids = _gpu_pids()
            if pids is None or vpid not in pids or time.time() - t_kill > 60:
                break
            time.sleep(0.02)
    t_released = None
    s_parent.send(port + 1)
    r_parent.send(port + 1)
    out = _result(s_parent.recv(), r_parent.recv())
    if mode == "now":  # when nvidia-smi stopped listing the victim, for the record
        while time.time() - t_kill < 60:
            pids = _gpu_pids()
            if pids is None or vpid not in pids:
                break
            time.sleep(0.02)
    t_released = time.time()
    for conn in (s_parent, r_parent):
        conn.send("bye")
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    at = out.pop("at")
    return {"case": f"after death, {mode}", **out,
            "group_called_after_kill_s": round(at - t_kill, 4),
            "group_ready_after_kill_s": round(at + out["group_s"] - t_kill, 4),
            "reaped_s": round(t_reaped - t_kill, 4),
            "gpu_released_s": round(t_released - t_kill, 4),
            "abort_s": round(marks["aborted"] - marks["order"], 4),
            "raised_after_order_s": round(marks.get("raised", marks["aborted"]) -
                                          marks["order"], 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-gb", type=float, default=60.0)
    ap.add_argument("--pin-gb", type=float, default=7.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--shm", default="/dev/shm/group-after-death")
    ap.add_argument("--device", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME or NAME:K=V,K=V: the environment the ranks start with "
                         "(repeatable; default: the environment as it is)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = []
    port = 29700
    base = dict(os.environ)
    for variant in args.variant or ["default"]:
        name, _, assigns = variant.partition(":")
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(dict(a.split("=", 1) for a in assigns.split(",") if a))
        for _ in range(args.repeat):
            for case in ("fresh", "now", "released"):
                port += 2
                r = fresh(port) if case == "fresh" else \
                    after_death(case, port, args.hold_gb, args.pin_gb, args.shm)
                r = {"variant": name, **r}
                print(json.dumps(r), flush=True)
                runs.append(r)
    os.environ.clear()
    os.environ.update(base)
    Path(args.shm).unlink(missing_ok=True)
    import torch

    result = {"script": "bench/recovery/group_after_death.py",
              "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
              "commit": os.environ.get("ORCH_BENCH_COMMIT", "unknown"),
              "device": args.device or torch.cuda.get_device_name(0),
              "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "hold_gb": args.hold_gb, "pin_gb": args.pin_gb, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
