"""Page-locking host memory beside GPU work: ``cudaHostAlloc`` against PyTorch's
``pinned_use_cuda_host_register`` (pages faulted in by the allocator's threads, then
``cudaHostRegister``), the two ways a rank can allocate its checkpoint staging.

    python bench/recovery/pin_host.py --mib 6500 --out pin-host-h200.json

Each mode runs in a fresh process: a thread pins ``--mib`` MiB while the main thread runs
8192 x 8192 matmuls; reported are the pin's seconds and the matmuls' seconds per call
during it against before it (how much the pinning holds GPU work up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {"cudaHostAlloc": "pinned_use_cuda_host_register:False",
         "register": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"}


def child(mib: int) -> dict:
    import threading

    import torch

    torch.cuda.set_device(0)
    x = torch.randn(8192, 8192, device="cuda")

    def matmuls(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            x @ x
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    matmuls(10)
    idle = matmuls(50)
    out: dict = {}

    def pin() -> None:
        t = time.perf_counter()
        buf = torch.empty(mib * 2**20, dtype=torch.uint8).pin_memory()
        out["pin_s"] = time.perf_counter() - t
        out["pinned"] = buf.is_pinned()

    thread = threading.Thread(target=pin)
    thread.start()
    during = []
    while thread.is_alive():
        during.append(matmuls(5))
    thread.join()
    out.update(matmul_idle_s=idle, matmul_during_s=sum(during) / max(len(during), 1),
               matmul_batches_during=len(during))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=6500)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.mib)))
        return 0
    results = {}
    for name, conf in MODES.items():
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        done = subprocess.run([sys.executable, __file__, "--child", "--mib", str(args.mib)],
                              env=env, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, results[name], flush=True)
    if args.out:
        import torch

        record = {"script": "bench/recovery/pin_host.py", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "mib": args.mib, "modes": MODES, "results": results}
        path = Path(__file__).resolve().parents[1] / "results" / args.out
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
