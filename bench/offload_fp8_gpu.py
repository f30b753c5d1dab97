"""FP8 against bf16, and FSDP2 CPU offload against none, for the 1.14B model on one GPU.

Every run is built by the trainer's own builders (``trainer.build.build_parts``) under a
one-rank NCCL process group, strategy fsdp2 (so FSDP2's mixed precision, its float8
all-gather and its ``CPUOffloadPolicy`` are the code that runs), and timed with
``train_step`` after a warm-up, as bench/gpu_train.py does:

- ``fp8``: bf16 and then ``trainer.precision.fp8: true``, both compiled, same data and seed:
  tokens/s, MFU (model FLOPs against 989 TFLOP/s dense bf16 and against a bf16 matmul peak
  measured here; the FP8 run's MFU is counted the same way, bf16-equivalent), peak GPU
  memory, and the loss of every step of ``--curve`` steps for both, side by side.
- ``offload``: eager, without and with ``trainer.parallelism.offload: params``: median step
  time and peak GPU memory (``max_memory_allocated``).

    python bench/offload_fp8_gpu.py --out offload-fp8-gpu-h100.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from common import header, write
from gpu_train import H100_BF16_DENSE, _NoWorker, matmul_peak

_DCTX: Any = None


def build(args: argparse.Namespace, mbs: int, compile_: bool, fp8: bool, offload: bool):
    from orchestrator.worker import WorkerContext
    from stability.config import StabilityConfig
    from trainer.build import build_parts
    from trainer.config import CheckpointConfig, TrainerConfig
    from trainer.distributed import init_distributed
    from trainer.settings import WorkerSettings

    global _DCTX
    cfg = TrainerConfig.model_validate({
        "steps": 100_000, "device": "cuda", "deterministic": False, "seed": 0,
        "model": {"preset": args.preset},
        "data": {"path": args.data, "seq_len": args.seq, "micro_batch_size": mbs},
        "optimizer": {"lr": 3e-4, "fused": not offload}, "schedule": {"warmup_steps": 20},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "fp8": fp8},
        "parallelism": {"strategy": "fsdp2", "backend": "nccl", "compile": compile_,
                        "offload": "params" if offload else "none"},
        "param_norm_every": 100_000,
    })
    if _DCTX is None:
        _DCTX = init_distributed(cfg)
    settings = WorkerSettings(cfg, CheckpointConfig(interval_steps=10**9), StabilityConfig(),
                              "bench", tempfile.mkdtemp(prefix="bench-ckpt-"), "bench")
    return build_parts(settings, _DCTX, WorkerContext(), _NoWorker(), lambda m: None)


def steps(parts, n: int) -> tuple[list[float], list[float]]:
    from trainer.loop import train_step

    times, losses = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        rec = train_step(parts)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(round(float(rec["loss"]), 5))
    return times, losses


def run(args: argparse.Namespace, peak: float, name: str, mbs: int, compile_: bool,
        fp8: bool, offload: bool, n: int) -> dict[str, Any]:
    from trainer.presets import PRESETS

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    parts = build(args, mbs, compile_, fp8, offload)
    build_s = time.perf_counter() - t0
    warm, warm_losses = steps(parts, args.warmup)
    times, losses = steps(parts, n)
    step_s = statistics.median(times[len(times) // 2:])  # the settled half
    tokens = mbs * args.seq
    flops = PRESETS[args.preset].flops_per_token(args.seq) * tokens
    out = {"run": name, "micro_batch_size": mbs, "compile": compile_, "fp8": fp8,
           "offload": "params" if offload else "none", "build_s": round(build_s, 1),
           "first_step_s": round(warm[0], 2), "median_step_s": round(step_s, 4),
           "tokens_per_s": round(tokens / step_s),
           "mfu_vs_989": round(flops / step_s / H100_BF16_DENSE, 4),
           "mfu_vs_measured_peak": round(flops / step_s / peak, 4),
           "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "losses": warm_losses + losses}
    print({k: v for k, v in out.items() if k != "losses"}, flush=True)
    del parts
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=os.path.expanduser(
        "~/.cache/orchestrator/datasets/stdlib-byte"))
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--curve", type=int, default=200, help="timed steps of each fp8 run")
    ap.add_argument("--offload-mbs", type=int, default=4)
    ap.add_argument("--offload-steps", type=int, default=6)
    ap.add_argument("--parts", default="fp8,offload")
    ap.add_argument("--out", default="offload-fp8-gpu.json")
    args = ap.parse_args()
    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    peak = matmul_peak()
    report: dict[str, Any] = {**header(torch.cuda.get_device_name()), "preset": args.preset,
                              "seq_len": args.seq, "bf16_matmul_peak_tflops":
                              round(peak / 1e12, 1), "runs": []}
    parts = args.parts.split(",")
    if "fp8" in parts:
        for fp8 in (False, True):
            report["runs"].append(run(args, peak, "fp8" if fp8 else "bf16", args.mbs, True,
                                      fp8, False, args.curve))
        bf16, fp8r = report["runs"][-2], report["runs"][-1]
        report["fp8_vs_bf16_tokens_per_s"] = round(fp8r["tokens_per_s"] / bf16["tokens_per_s"],
                                                   3)
        n = min(len(bf16["losses"]), len(fp8r["losses"]))
        report["loss_gap_last_20_mean"] = round(statistics.mean(
            f - b for f, b in zip(fp8r["losses"][n - 20:n], bf16["losses"][n - 20:n])), 4)
    if "offload" in parts:
        for offload in (False, True):
            report["runs"].append(run(args, peak, "offload" if offload else "no-offload",
                                      args.offload_mbs, False, False, offload,
                                      args.offload_steps))
        plain, off = report["runs"][-2], report["runs"][-1]
        report["offload_vs_none_step_time"] = round(off["median_step_s"]
                                                    / plain["median_step_s"], 3)
        report["offload_vs_none_peak_memory"] = round(off["peak_gpu_memory_gib"]
                                                      / plain["peak_gpu_memory_gib"], 3)
        for r in report["runs"][-2:]:
            r.pop("losses")
    print(write(args.out, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
