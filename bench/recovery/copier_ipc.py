"""Whether a rank that never page-locks the memory tier's slots dies faster, when another
process (a standby) makes the device-to-host copies for it through CUDA IPC.

A killed rank's teardown holds the GPU driver's global lock while the driver unpins what the
rank page-locked: the memory tier's slots, about 0.3 s for 14 GB on huge pages
(``lock-after-death-h200-2gpu.json``), and a replacement's first allocation waits for it.
Here a *victim* holds ``--gpu-gb`` of GPU memory, of which ``--state-gb`` is the state the
memory tier copies, and:

- ``own``: the victim registers ``--shm-gb`` of a shared-memory file (``cudaHostRegister``)
  and copies the state into it itself, as a rank does today;
- ``copier-torch`` / ``copier-ctypes`` (``copier`` is ``copier-torch``): a second process
  (the standby) registers the file, opens the victim's state through CUDA IPC (the fields
  of ``UntypedStorage._share_cuda_``, as the slot copier gets them: torch's
  ``_new_shared_cuda``, or the driver API by ctypes, ``trainer.checkpoint.copier
  .IpcMappings``) and makes the copy; the victim registers nothing. The state is ~500
  tensors of a 1.14B model's sizes (``PIECES_MIB``).

Then the victim is SIGKILLed. A *probe* (another process, allocating and freeing 2 MiB with
``cuMemAlloc`` in a loop) times the driver lock's hold. The copier lets the victim's
tensors go at once (as it does on the rank's end of stream, before the victim is reaped),
timing that and the longest its own ticker thread waited for the GIL meanwhile, then
allocates ``--gpu-gb`` itself, as a takeover does. Each copy is timed from the copying
process (GB/s) so the paths' bandwidths compare.

Usage: ``python bench/recovery/copier_ipc.py --shm-dir /mnt/orch-mem --modes own
copier-torch copier-ctypes --out FILE``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header
from bench.recovery.lock_after_death import alloc_stalls, driver

# A 1.14B model's state on one rank, as FSDP2 and AdamW hold it: per parameter its fp32
# shard and two moments, large ones in segments of their own, norms and step counters small.
PIECES_MIB = [64, 64, 16, 16, 16, 16, 44, 44, 44] * 6 + [0.0078125, 0.0000038] * 40


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
    want, state, i = int(state_gb * (1 << 30)), [], 0
    while sum(t.numel() for t in state) < want:
        n = max(4, int(PIECES_MIB[i % len(PIECES_MIB)] * (1 << 20)))
        state.append(torch.full((n,), 7, dtype=torch.uint8, device="cuda"))
        i += 1
    rest = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            for _ in range(int(gpu_gb - state_gb))]
    info = {"pid": os.getpid()}
    keep = []
    if mode == "own":
        keep.append(_register(int(shm_gb * (1 << 30)), shm_dir))
        info["register_s"] = round(keep[0][3], 3)
        info["copy_s"] = [round(_copy(state, keep[0][2]), 3) for _ in range(3)]
    else:  # shared through CUDA IPC (the fields the slot copier sends); kept alive here
        q.put([tuple(t.untyped_storage()._share_cuda_()) for t in state])
        info["pieces"] = len(state)
    torch.cuda.synchronize()
    ready.put(info)
    _ = rest, keep
    time.sleep(3600)


def _ticker(stop, gaps: list) -> None:
    """The longest this thread waited for the GIL (a 1 ms sleep loop)."""
    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def copier(how: str, gpu_gb: float, shm_gb: float, shm_dir: str, q, out, go) -> None:
    import threading

    import torch

    from trainer.checkpoint.copier import IpcMappings

    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    buf, anchor, host, reg_s = _register(int(shm_gb * (1 << 30)), shm_dir)
    out.put({"register_s": round(reg_s, 3)})
    fields = q.get()
    maps = IpcMappings(0)
    t0 = time.perf_counter()
    if how == "ctypes":
        state = [maps.tensor(f[1], f[3], f[2]) for f in fields]
    else:
        state = [torch.empty(0, dtype=torch.uint8, device="cuda").set_(
            torch.UntypedStorage._new_shared_cuda(*f)) for f in fields]
    opened_s = time.perf_counter() - t0
    copies = [round(_copy(state, host), 3) for _ in range(3)]
    out.put({"open": how, "opened_s": round(opened_s, 4), "copy_s": copies})
    stop, gaps = threading.Event(), []
    ticker = threading.Thread(target=_ticker, args=(stop, gaps))
    ticker.start()
    go.get()  # the victim was just killed (not yet reaped): the rank's EOF, as the copier sees it
    t0 = time.perf_counter()
    del state
    maps.close()
    torch.cuda.ipc_collect()
    closed_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(int(gpu_gb))]
    torch.cuda.synchronize()
    alloc_s = time.perf_counter() - t0
    stop.set()
    ticker.join()
    out.put({"closed_s": round(closed_s, 4), "alloc_after_s": round(alloc_s, 4),
             "alloc_done_at": time.time(), "max_gil_wait_s": round(max(gaps), 4)})
    _ = mine, buf, anchor
    time.sleep(3600)  # killed by the parent after the probe's window: its exit unpins too


def probe(window_s: float, start_q, out) -> None:
    import torch

    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    lib = driver()
    out.put("ready")
    out.put(alloc_stalls(lib, start_q.get(), window_s))


def one(ctx, mode: str, a) -> dict:
    q, ready, cout, go, pstart, pout = (ctx.Queue() for _ in range(6))
    t0 = time.time()
    c = None
    if mode.startswith("copier"):
        how = mode.partition("-")[2] or "torch"
        c = ctx.Process(target=copier, args=(how, a.gpu_gb, a.shm_gb, a.shm_dir, q, cout, go))
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
    if c is not None:
        go.put(True)
    v.join()
    row["reaped_s"] = round(time.time() - kill, 4)
    if c is not None:
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
                    choices=["own", "copier", "copier-torch", "copier-ctypes"])
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
