"""FP8 against bf16, and CPU offload against none (FSDP2 and DeepSpeed), for the 1.14B model.

Every run is built by the trainer's own builders (``trainer.build.build_parts``) under a
one-rank process group (NCCL on a GPU) and timed with ``train_step`` after a warm-up, as
bench/training/gpu_train.py does. Parts (``--parts``, comma-separated):

- ``fp8``: strategy fsdp2, bf16 and then ``trainer.precision.fp8: true``, both compiled, same
  data and seed: tokens/s, MFU (model FLOPs against 989 TFLOP/s dense bf16 and against a bf16
  matmul peak measured here; the FP8 run's MFU is counted the same way, bf16-equivalent),
  peak GPU memory, and the loss of every step (``--warmup`` + ``--curve``) of both, side by
  side. About 4 minutes on one H100 at the defaults (300 curve steps at ~0.23 s each).
- ``offload``: strategy fsdp2, eager, without and with ``trainer.parallelism.offload: params``
  (FSDP2's ``CPUOffloadPolicy``): median step time and peak GPU memory.
- ``deepspeed``: strategy deepspeed, eager: ZeRO stage 2 without and with ZeRO-Offload of the
  optimizer (``offload: optimizer``), then stage 3 without and with the parameters offloaded
  too (``offload: params``): median step time and peak GPU memory. Each run is a process of
  its own (a ZeRO-3 engine leaves hooks and partitions behind). Skipped, with the reason in
  the JSON, where ``import deepspeed`` fails (PyPI has DeepSpeed 0.19.8 as an sdist only; it
  builds into a pure-Python wheel, ``pip wheel --no-deps deepspeed==0.19.8``, which a machine
  without network installs with hjson, py-cpuinfo, msgpack, ninja and einops).

The data is the byte-level stdlib dataset, prepared first when it is missing. On a GPU:

    python bench/training/offload_fp8_gpu.py --parts fp8 --out offload-fp8-gpu-h100-fp8.json
    python bench/training/offload_fp8_gpu.py --parts deepspeed --out offload-deepspeed-gpu-h100.json

``--device cpu --preset tiny --seq 64`` is a smoke run of the same code on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from bench.common import header, write
from gpu_train import H100_BF16_DENSE, _NoWorker, matmul_peak

_DCTX: Any = None
# Each DeepSpeed run: (name, zero_stage, offload); compared pairwise within a stage.
DEEPSPEED_RUNS = [("ds-zero2", 2, "none"), ("ds-zero2-offload-optimizer", 2, "optimizer"),
                  ("ds-zero3", 3, "none"), ("ds-zero3-offload-params", 3, "params")]
RESULT = "RESULT "  # the line a DeepSpeed child prints its JSON after


def cuda(args: argparse.Namespace) -> bool:
    return args.device == "cuda"


def sync(args: argparse.Namespace) -> None:
    if cuda(args):
        torch.cuda.synchronize()


def reset_peak(args: argparse.Namespace) -> None:
    if cuda(args):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(args: argparse.Namespace) -> float:
    """Peak GPU memory allocated (on a CPU smoke run: the process's peak RSS)."""
    if cuda(args):
        return round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, 2)


def build(args: argparse.Namespace, mbs: int, compile_: bool, fp8: bool,
          parallelism: dict[str, Any]):
    from orchestrator.worker import WorkerContext
    from stability.config import StabilityConfig
    from trainer.build import build_parts
    from trainer.config import CheckpointConfig, TrainerConfig
    from trainer.distributed import init_distributed
    from trainer.settings import WorkerSettings

    global _DCTX
    offload = parallelism.get("offload", "none") != "none"
    cfg = TrainerConfig.model_validate({
        "steps": 100_000, "device": args.device, "deterministic": False, "seed": 0,
        "model": {"preset": args.preset},
        "data": {"path": args.data, "seq_len": args.seq, "micro_batch_size": mbs},
        "optimizer": {"lr": 3e-4, "fused": cuda(args) and not offload},
        "schedule": {"warmup_steps": 20},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "fp8": fp8},
        "parallelism": {"strategy": "fsdp2", "backend": "nccl" if cuda(args) else "gloo",
                        "compile": compile_, **parallelism},
        "param_norm_every": 100_000,
    })
    if _DCTX is None:
        _DCTX = init_distributed(cfg)
    settings = WorkerSettings(cfg, CheckpointConfig(interval_steps=10**9), StabilityConfig(),
                              "bench", tempfile.mkdtemp(prefix="bench-ckpt-"), "bench")
    return build_parts(settings, _DCTX, WorkerContext(), _NoWorker(), lambda m: None)


def steps(args: argparse.Namespace, parts, n: int) -> tuple[list[float], list[float]]:
    from trainer.loop import train_step

    times, losses = [], []
    for _ in range(n):
        sync(args)
        t = time.perf_counter()
        rec = train_step(parts)
        sync(args)
        times.append(time.perf_counter() - t)
        losses.append(round(float(rec["loss"]), 5))
    return times, losses


def run(args: argparse.Namespace, peak: float, name: str, mbs: int, compile_: bool,
        fp8: bool, parallelism: dict[str, Any], n: int) -> dict[str, Any]:
    from trainer.presets import PRESETS

    reset_peak(args)
    t0 = time.perf_counter()
    parts = build(args, mbs, compile_, fp8, parallelism)
    build_s = time.perf_counter() - t0
    warm, warm_losses = steps(args, parts, args.warmup)
    times, losses = steps(args, parts, n)
    step_s = statistics.median(times[len(times) // 2:])  # the settled half
    tokens = mbs * args.seq
    flops = PRESETS[args.preset].flops_per_token(args.seq) * tokens
    out = {"run": name, "micro_batch_size": mbs, "compile": compile_, "fp8": fp8,
           "strategy": parallelism.get("strategy", "fsdp2"),
           "zero_stage": parallelism.get("zero_stage"),
           "offload": parallelism.get("offload", "none"), "build_s": round(build_s, 1),
           "first_step_s": round(warm[0], 2), "median_step_s": round(step_s, 4),
           "tokens_per_s": round(tokens / step_s),
           "mfu_vs_989": round(flops / step_s / H100_BF16_DENSE, 4),
           "mfu_vs_measured_peak": round(flops / step_s / peak, 4),
           "peak_gpu_memory_gib": peak_gib(args), "losses": warm_losses + losses}
    print({k: v for k, v in out.items() if k != "losses"}, flush=True)
    del parts
    return out


def ratios(report: dict[str, Any], plain: dict[str, Any], other: dict[str, Any],
           key: str) -> None:
    """``key``_step_time and ``key``_peak_memory: ``other`` against ``plain``."""
    report[f"{key}_step_time"] = round(other["median_step_s"] / plain["median_step_s"], 3)
    report[f"{key}_peak_memory"] = round(other["peak_gpu_memory_gib"]
                                         / plain["peak_gpu_memory_gib"], 3)


def fp8_part(args: argparse.Namespace, peak: float, report: dict[str, Any]) -> None:
    for fp8 in (False, True):
        report["runs"].append(run(args, peak, "fp8" if fp8 else "bf16", args.mbs,
                                  cuda(args), fp8, {}, args.curve))
    bf16, fp8r = report["runs"][-2], report["runs"][-1]
    report["fp8_vs_bf16_tokens_per_s"] = round(fp8r["tokens_per_s"] / bf16["tokens_per_s"], 3)
    n = min(len(bf16["losses"]), len(fp8r["losses"]))
    last = min(20, n)
    report["curve_steps"] = n
    report["loss_gap_last_20_mean"] = round(statistics.mean(
        f - b for f, b in zip(fp8r["losses"][n - last:n], bf16["losses"][n - last:n])), 4)


def offload_part(args: argparse.Namespace, peak: float, report: dict[str, Any]) -> None:
    for offload in ("none", "params"):
        report["runs"].append(run(args, peak, "offload" if offload != "none" else
                                  "no-offload", args.offload_mbs, False, False,
                                  {"offload": offload}, args.offload_steps))
        report["runs"][-1].pop("losses")
    ratios(report, report["runs"][-2], report["runs"][-1], "offload_vs_none")


def deepspeed_child(args: argparse.Namespace, peak: float) -> dict[str, Any]:
    """One DeepSpeed run (this process was started for it by ``deepspeed_part``)."""
    try:
        import deepspeed
    except Exception as err:  # noqa: BLE001 (any import failure means: skip, saying why)
        return {"skipped": f"import deepspeed failed: {type(err).__name__}: {err}"}
    name, stage, offload = next(r for r in DEEPSPEED_RUNS if r[0] == args.deepspeed_run)
    out = run(args, peak, name, args.offload_mbs, False, False,
              {"strategy": "deepspeed", "zero_stage": stage, "offload": offload},
              args.offload_steps)
    out.pop("losses")
    out["deepspeed"] = deepspeed.__version__
    return out


def deepspeed_part(args: argparse.Namespace, report: dict[str, Any]) -> None:
    results = []
    for name, _, _ in DEEPSPEED_RUNS:
        cmd = [sys.executable, __file__, "--deepspeed-run", name, "--parts", "deepspeed",
               "--device", args.device,
               "--data", args.data, "--preset", args.preset, "--seq", str(args.seq),
               "--warmup", str(args.warmup), "--offload-mbs", str(args.offload_mbs),
               "--offload-steps", str(args.offload_steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        if proc.returncode != 0 or not lines:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"DeepSpeed run {name} failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(lines[-1][len(RESULT):])
        if "skipped" in result:
            print(f"deepspeed part skipped: {result['skipped']}", flush=True)
            report["deepspeed_skipped"] = result["skipped"]
            return
        print({k: v for k, v in result.items()}, flush=True)
        results.append(result)
    report["runs"].extend(results)
    by = {r["run"]: r for r in results}
    ratios(report, by["ds-zero2"], by["ds-zero2-offload-optimizer"],
           "ds_zero2_offload_optimizer_vs_none")
    ratios(report, by["ds-zero3"], by["ds-zero3-offload-params"],
           "ds_zero3_offload_params_vs_none")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.expanduser(
        "~/.cache/orchestrator/datasets/stdlib-byte"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda, or cpu for a smoke run of the same code")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--curve", type=int, default=300, help="timed steps of each fp8 run")
    ap.add_argument("--offload-mbs", type=int, default=4)
    ap.add_argument("--offload-steps", type=int, default=6)
    ap.add_argument("--parts", default="fp8,offload,deepspeed")
    ap.add_argument("--deepspeed-run", choices=[r[0] for r in DEEPSPEED_RUNS],
                    help=argparse.SUPPRESS)  # a child of the deepspeed part
    ap.add_argument("--out", default="offload-fp8-gpu.json")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"fp8", "offload", "deepspeed"})
    if unknown:
        ap.error(f"unknown parts {unknown}: choose from fp8, offload, deepspeed")
    if args.device == "cpu" and "fp8" in parts:
        ap.error("the fp8 part needs an FP8 GPU (trainer.precision.fp8 is refused on a CPU)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu for a smoke run")
    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    import gpu_train

    gpu_train.DEVICE = args.device
    if args.deepspeed_run:
        print(RESULT + json.dumps(deepspeed_child(args, matmul_peak())), flush=True)
        return 0
    from trainer.data.prepare import prepare_dataset

    prepare_dataset("stdlib", args.data, "byte", max_bytes=64 * 2**20)
    peak = matmul_peak()
    report: dict[str, Any] = {**header(torch.cuda.get_device_name() if cuda(args) else None),
                              "preset": args.preset, "seq_len": args.seq,
                              "peak_gpu_memory_gib_is": "torch.cuda.max_memory_allocated"
                              if cuda(args) else "peak RSS of the process (CPU smoke run)",
                              "bf16_matmul_peak_tflops": round(peak / 1e12, 1), "runs": []}
    t0 = time.perf_counter()
    if "fp8" in parts:
        fp8_part(args, peak, report)
    if "offload" in parts:
        offload_part(args, peak, report)
    if "deepspeed" in parts:
        deepspeed_part(args, report)
    report["wall_s"] = round(time.perf_counter() - t0)
    print(write(args.out, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
