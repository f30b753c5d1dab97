"""How long a dead GPU process's teardown keeps every other process out of the GPU driver.

After a rank's SIGKILL the dead process is gone within 10 ms, but the driver frees its
resources afterwards, holding the driver's global lock (``rmapiLockAcquire``): in an
in-place recovery on 2 x H200 the replacement's first allocation and the survivor's NCCL
abort both sat in an ``ioctl`` waiting for that lock for 0.15-0.8 s
(``recovery.py``'s ``death`` record). This script times that hold by what the dead process
held, with nothing else running:

- a *victim* process allocates ``--gpu-gb`` of GPU memory (1 GiB blocks, as the caching
  allocator's segments), then page-locks ``--pin-gb`` of host memory the way a rank's
  staging buffers are (``torch.empty(pin_memory=True)`` under
  ``pinned_use_cuda_host_register``, in 256 MiB tensors) and registers ``--shm-gb`` of a
  shared-memory file (``cudaHostRegister``, as the memory tier's slots);
- a *probe* process on the other GPU (the lock is the whole driver's) allocates and frees
  2 MiB with the driver's ``cuMemAlloc``/``cuMemFree`` in a loop;
- the victim is SIGKILLed; the probe's longest stall in the next ``--window`` seconds, and
  when it began and ended after the kill, are the lock's hold.

``--thp 1`` starts the victim with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (its malloc'd
blocks, the pinned staging included, on transparent huge pages). ``--shm-dir`` should be a
tmpfs mounted with ``huge=within_size`` for the slots' case.

Usage: ``python bench/recovery/lock_after_death.py --case 30,0,0,0 30,7,0,0 30,7,0,1
30,0,14,0 --out FILE`` (each case: gpu_gb,pin_gb,shm_gb,thp).
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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header

STEP_BYTES = 2 << 20


def victim(gpu_gb: float, pin_gb: float, shm_gb: float, shm_dir: str) -> None:
    import torch

    torch.cuda.set_device(0)
    held = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            for _ in range(int(gpu_gb))]
    pinned = [torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
              for _ in range(int(pin_gb * 4))]
    for t in pinned:
        t.fill_(1)
    maps = []
    if shm_gb > 0:
        path = os.path.join(shm_dir, f"lock-after-death-{os.getpid()}")
        size = int(shm_gb * (1 << 30))
        with open(path, "w+b") as f:
            f.truncate(size)
            buf = mmap.mmap(f.fileno(), size)
        os.unlink(path)
        anchor = ctypes.c_char.from_buffer(buf)
        code = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(anchor), size, 0)
        if code != 0:
            raise SystemExit(f"cudaHostRegister failed: {code}")
        maps.append((buf, anchor))
    torch.cuda.synchronize()
    print("ready", flush=True)
    _ = held, pinned, maps
    time.sleep(3600)


def driver() -> ctypes.CDLL:
    """The CUDA driver, its ``cuMemAlloc``/``cuMemFree`` typed (the primary context must be
    current on the calling thread)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    return lib


def alloc_stalls(lib: ctypes.CDLL, start: float, window_s: float) -> dict:
    """Allocate and free 2 MiB in a loop until ``window_s`` after ``start`` (the kill's
    wall-clock time): the longest stall, when it began and ended after the kill, the
    median call, and every stall over 20 ms."""
    ptr = ctypes.c_uint64()
    stamps = []
    while time.time() < start + window_s:
        if lib.cuMemAlloc_v2(ctypes.byref(ptr), STEP_BYTES) == 0:
            lib.cuMemFree_v2(ptr)
        stamps.append(time.time())
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(stamps)]
    worst = max(gaps, default=(0.0, start, start))
    return {"stall_s": round(worst[0], 4), "stall_from_s": round(worst[1] - start, 4),
            "stall_to_s": round(worst[2] - start, 4),
            "median_call_s": statistics.median(g[0] for g in gaps) if gaps else None,
            "calls": len(stamps),
            "stalls_over_20ms": [[round(a - start, 3), round(g, 3)]
                                 for g, a, _b in gaps if g > 0.02]}


def probe(window_s: float) -> None:
    import torch

    torch.cuda.set_device(1 if torch.cuda.device_count() > 1 else 0)
    torch.ones(1, device="cuda")  # the primary context, current on this thread
    lib = driver()
    print("ready", flush=True)
    start = float(sys.stdin.readline())  # the kill's wall-clock time
    print(json.dumps(alloc_stalls(lib, start, window_s)), flush=True)


def one(gpu_gb: float, pin_gb: float, shm_gb: float, thp: bool, shm_dir: str,
        window_s: float) -> dict:
    me = [sys.executable, os.path.abspath(__file__)]
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = ("pinned_use_cuda_host_register:True,"
                                      "pinned_num_register_threads:8")
    if thp:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    t0 = time.time()
    v = subprocess.Popen([*me, "--role", "victim", "--case", f"{gpu_gb},{pin_gb},{shm_gb},0",
                          "--shm-dir", shm_dir], env=env, stdout=subprocess.PIPE, text=True)
    if v.stdout.readline().strip() != "ready":
        raise SystemExit("victim did not get ready")
    ready_s = time.time() - t0
    p = subprocess.Popen([*me, "--role", "probe", "--window", str(window_s)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise SystemExit("probe did not get ready")
    time.sleep(0.5)
    kill = time.time()
    p.stdin.write(f"{kill}\n")
    p.stdin.flush()
    os.kill(v.pid, signal.SIGKILL)
    v.wait()
    reaped = time.time() - kill
    out = json.loads(p.stdout.readline())
    p.wait()
    return {"gpu_gb": gpu_gb, "pin_gb": pin_gb, "shm_gb": shm_gb, "thp": thp,
            "victim_setup_s": round(ready_s, 2), "reaped_s": round(reaped, 4), **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["parent", "victim", "probe"], default="parent")
    ap.add_argument("--case", nargs="+", default=["30,0,0,0"],
                    help="gpu_gb,pin_gb,shm_gb,thp (thp: 0 or 1)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = []
    for c in args.case:
        try:
            g, p, s, t = (float(x) for x in c.split(","))
        except ValueError:
            ap.error(f"--case {c!r}: want gpu_gb,pin_gb,shm_gb,thp")
        if min(g, p, s) < 0 or t not in (0, 1):
            ap.error(f"--case {c!r}: sizes >= 0, thp 0 or 1")
        cases.append((g, p, s, bool(t)))
    if args.role == "victim":
        victim(*cases[0][:3], args.shm_dir)
        return 0
    if args.role == "probe":
        probe(args.window)
        return 0
    import torch

    runs = []
    for case in cases:
        for _ in range(args.repeat):
            r = one(*case, args.shm_dir, args.window)
            print(json.dumps(r), flush=True)
            runs.append(r)
    device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    result = {**header(device), "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
