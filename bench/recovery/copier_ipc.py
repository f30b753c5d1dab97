"""Whether a rank that never page-locks the memory tier's slots dies faster, when another
process (a standby) makes the device-to-host copies for it through CUDA IPC.

A killed rank's teardown holds the GPU driver's global lock while the driver unpins what the
rank page-locked: the memory tier's slots, about 0.3 s for 14 GB on huge pages
(``lock-after-death-h200-2gpu.json``), and a replacement's first allocation waits for it.
Here a *victim* holds ``--gpu-gb`` of GPU memory, of which ``--state-gb`` is the state the
memory tier copies, and:

- ``own``: the victim registers ``--shm-gb`` of a shared-memory file (``cudaHostRegister``)
  and copies the state into it itself, as a rank does today;
- ``copier``: a second process (the standby) registers the file, opens the victim's state
  through CUDA IPC (``torch.multiprocessing``'s sharing of CUDA tensors) and makes the copy;
  the victim registers nothing.

Then the victim is SIGKILLed. A *probe* (another process, allocating and freeing 2 MiB with
``cuMemAlloc`` in a loop) times the driver lock's hold; in ``copier`` the copier then drops
the victim's tensors (``ipc_collect``) and allocates ``--gpu-gb`` itself, as a takeover does.
Each copy is timed from the copying process (GB/s) so the two paths' bandwidths compare.

Usage: ``python bench/recovery/copier_ipc.py --shm-dir /mnt/orch-mem --out FILE``.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header

STEP_BYTES = 2 << 20
PIECE = 256 << 20  # state in 256 MiB tensors, as FSDP2's flat shards come in a few big ones


def _register(size: int, shm_dir: str):
    import torch

    path = os.path.join(shm_dir, f"copier-ipc-{os.getpid()}")
    with open(path, "w+b") as f:
        f.truncate(size)
        buf = mmap.mmap(f.fileno(), size)
    os.unlink(path)
    anchor = ctypes.c_char.from_buffer(buf)
    t0 = time.perf_counter()
    code = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(anchor), size, 0)
    if code != 0:
        raise SystemExit(f"cudaHostRegister failed: {code}")
    reg_s = time.perf_counter() - t0
    host = torch.frombuffer(buf, dtype=torch.uint8, count=size)
    return buf, anchor, host, reg_s


def _copy(srcs, host) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    for s in srcs:
        n = s.numel()
        host[off:off + n].copy_(s, non_blocking=True)
        off += n
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def victim(mode: str, gpu_gb: float, state_gb: float, shm_gb: float, shm_dir: str,
           q, ready) -> None:
    import torch

    torch.cuda.set_device(0)
    state = [torch.full((PIECE,), 7, dtype=torch.uint8, device="cuda")
             for _ in range(int(state_gb * (1 << 30)) // PIECE)]
    rest = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            for _ in range(int(gpu_gb - state_gb))]
    info = {"pid": os.getpid()}
    keep = []
    if mode == "own":
        keep.append(_register(int(shm_gb * (1 << 30)), shm_dir))
        info["register_s"] = round(keep[0][3], 3)
        info["copy_s"] = [round(_copy(state, keep[0][2]), 3) for _ in range(3)]
    else:
        q.put(state)  # shared through CUDA IPC; kept alive here
    torch.cuda.synchronize()
    ready.put(info)
    _ = rest, keep
    time.sleep(3600)


def copier(gpu_gb: float, shm_gb: float, shm_dir: str, q, out, go) -> None:
    import torch

    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    buf, anchor, host, reg_s = _register(int(shm_gb * (1 << 30)), shm_dir)
    out.put({"register_s": round(reg_s, 3)})
    state = q.get()
    t0 = time.perf_counter()
    _ = [s.data_ptr() for s in state]
    opened_s = time.perf_counter() - t0
    copies = [round(_copy(state, host), 3) for _ in range(3)]
    out.put({"opened_s": round(opened_s, 4), "copy_s": copies})
    go.get()  # the victim is dead
    t0 = time.perf_counter()
    del state
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    closed_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(int(gpu_gb))]
    torch.cuda.synchronize()
    alloc_s = time.perf_counter() - t0
    out.put({"closed_s": round(closed_s, 4), "alloc_after_s": round(alloc_s, 4),
             "alloc_done_at": time.time()})
    _ = mine, buf, anchor
    time.sleep(3600)  # killed by the parent after the probe's window: its exit unpins too


def probe(window_s: float, start_q, out) -> None:
    import torch

    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    ptr = ctypes.c_uint64()
    out.put("ready")
    start = start_q.get()
    stamps = []
    while time.time() < start + window_s:
        if lib.cuMemAlloc_v2(ctypes.byref(ptr), STEP_BYTES) == 0:
            lib.cuMemFree_v2(ptr)
        stamps.append(time.time())
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(stamps)]
    worst = max(gaps, default=(0.0, start, start))
    out.put({"stall_s": round(worst[0], 4), "stall_from_s": round(worst[1] - start, 4),
             "stall_to_s": round(worst[2] - start, 4),
             "median_call_s": statistics.median(g[0] for g in gaps) if gaps else None,
             "calls": len(stamps),
             "stalls_over_20ms": [[round(a - start, 3), round(g, 3)]
                                  for g, a, _b in gaps if g > 0.02]})


def one(ctx, mode: str, a) -> dict:
    q, ready, cout, go, pstart, pout = (ctx.Queue() for _ in range(6))
    t0 = time.time()
    c = None
    if mode == "copier":
        c = ctx.Process(target=copier, args=(a.gpu_gb, a.shm_gb, a.shm_dir, q, cout, go))
        c.start()
    v = ctx.Process(target=victim, args=(mode, a.gpu_gb, a.state_gb, a.shm_gb, a.shm_dir,
                                         q, ready))
    v.start()
    vinfo = ready.get(timeout=300)
    row: dict = {"mode": mode, "victim": vinfo}
    if c is not None:
        row["copier"] = {**cout.get(timeout=300), **cout.get(timeout=300)}
    row["setup_s"] = round(time.time() - t0, 2)
    p = ctx.Process(target=probe, args=(a.window, pstart, pout))
    p.start()
    assert pout.get(timeout=120) == "ready"
    time.sleep(0.5)
    kill = time.time()
    pstart.put(kill)
    os.kill(v.pid, signal.SIGKILL)
    v.join()
    row["reaped_s"] = round(time.time() - kill, 4)
    if c is not None:
        go.put(True)
        after = cout.get(timeout=120)
        after["alloc_done_s"] = round(after.pop("alloc_done_at") - kill, 4)
        row["copier"].update(after)
    row["probe"] = pout.get(timeout=120)
    p.join()
    if c is not None:
        c.kill()
        c.join()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["own", "copier"],
                    choices=["own", "copier"])
    ap.add_argument("--gpu-gb", type=float, default=30.0)
    ap.add_argument("--state-gb", type=float, default=6.75)
    ap.add_argument("--shm-gb", type=float, default=14.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not 0 < a.state_gb <= min(a.gpu_gb, a.shm_gb):
        ap.error("want 0 < --state-gb <= --gpu-gb and --shm-gb")
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    runs = []
    for _ in range(a.repeat):
        for mode in a.modes:
            r = one(ctx, mode, a)
            print(json.dumps(r), flush=True)
            runs.append(r)
    device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    result = {**header(device), "args": vars(a), "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
