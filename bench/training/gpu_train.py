"""Training throughput and MFU of our trainer on one GPU: the 1.14B Llama, eager and compiled.

Builds the model, sharding, optimizer and loader with the trainer's own builders (the code
that runs under ``orchestrator up``), times ``train_step`` after a warm-up, and reports
tokens/s and MFU against both 989 TFLOP/s (H100 SXM dense bf16) and a bf16 matmul peak
measured in the same run. Also measures the monitoring overhead: the same steps with the
worker SDK's heartbeat thread and the stability norms (param norm every step) on, against
both off, interleaved in blocks so drift hits both equally.

    python bench/training/gpu_train.py --out bench/results/gpu-train-h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.common import header, write  # noqa: E402

H100_BF16_DENSE = 989e12
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def matmul_peak(n: int = 8192, iters: int = 20) -> float:
    if DEVICE != "cuda":
        n, iters = 512, 3
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync()
    return 2 * n**3 * iters / (time.perf_counter() - t)


class _NoWorker:  # noqa: D101
    """The SDK's surface with nothing behind it (monitoring off)."""

    def step_done(self, step: int, **_: Any) -> None:
        return None

    @contextlib.contextmanager
    def phase(self, name: str):
        yield

    def event(self, name: str, **_: Any) -> None:
        return None


def build(compile_: bool, strategy: str, mbs: int, seq: int, ac: str, data: str,
          preset: str):
    from orchestrator.worker import WorkerContext
    from trainer.build import build_parts
    from trainer.config import CheckpointConfig, TrainerConfig
    from trainer.distributed import init_distributed
    from trainer.settings import WorkerSettings
    from stability.config import StabilityConfig

    cfg = TrainerConfig.model_validate({
        "steps": 10_000, "device": DEVICE, "deterministic": False,
        "model": {"preset": preset},
        "data": {"path": data, "seq_len": seq, "micro_batch_size": mbs},
        "optimizer": {"lr": 3e-4, "fused": True}, "schedule": {"warmup_steps": 10},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "parallelism": {"strategy": strategy, "backend": "nccl" if DEVICE == "cuda" else "gloo",
                        "compile": compile_,
                        "activation_checkpointing": ac},
        "param_norm_every": 10_000,
    })
    import tempfile

    # A fresh, empty checkpoint root: nothing to restore, nothing of another run mixed in.
    settings = WorkerSettings(cfg, CheckpointConfig(interval_steps=10**9), StabilityConfig(),
                              "bench", tempfile.mkdtemp(prefix="bench-ckpt-"), "bench")
    dctx = init_distributed(cfg)
    return build_parts(settings, dctx, WorkerContext(), _NoWorker(), lambda m: None)


def time_steps(parts, n: int) -> list[float]:
    from trainer.loop import train_step

    out = []
    for _ in range(n):
        _sync()
        t = time.perf_counter()
        train_step(parts)
        _sync()
        out.append(time.perf_counter() - t)
    return out


def run_mode(compile_: bool, strategy: str, mbs: int, args: argparse.Namespace,
             peak: float) -> dict[str, Any]:
    from trainer.presets import PRESETS

    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    parts = build(compile_, strategy, mbs, args.seq, args.ac, args.data, args.preset)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = time_steps(parts, args.warmup)
    warm_s = time.perf_counter() - t0
    steps = time_steps(parts, args.steps)
    step_s = statistics.median(steps)
    tokens = mbs * args.seq
    flops = PRESETS[args.preset].flops_per_token(args.seq) * tokens
    result = {
        "compile": compile_, "strategy": strategy, "activation_checkpointing": args.ac,
        "micro_batch_size": mbs, "seq_len": args.seq, "build_s": round(build_s, 2),
        "warmup_s": round(warm_s, 2), "first_step_s": round(warm[0], 3),
        "median_step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s),
        "mfu_vs_989": round(flops / step_s / H100_BF16_DENSE, 4),
        "mfu_vs_measured_peak": round(flops / step_s / peak, 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if DEVICE == "cuda" else None,
    }
    if args.overhead and args.overhead_run:
        result["monitoring"] = [monitoring_overhead(parts, args.overhead, every)
                                for every in (10, 1)]
        args.overhead_run = False
    del parts
    return result


@contextlib.contextmanager
def agent_sink():
    """A stand-in agent: a unix socket that reads and drops the worker's beats."""
    import socket
    import tempfile
    import threading

    path = os.path.join(tempfile.mkdtemp(prefix="sink-"), "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)

    def drain() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while conn.recv(1 << 16):
                    pass

    threading.Thread(target=drain, daemon=True).start()
    try:
        yield path
    finally:
        server.close()


def monitoring_overhead(parts, blocks: int, norm_every: int) -> dict[str, Any]:
    """Step time with the SDK (beat thread sending to an agent socket, a record per step)
    and the param norm every ``norm_every`` steps, against both off; interleaved blocks of
    10 steps."""
    from orchestrator.worker.sdk import Worker
    from trainer.loop import train_step

    off, on = [], []
    with agent_sink() as sock:
        worker = Worker(env={"RANK": "0", "ORCH_AGENT_SOCKET": sock,
                             "ORCH_HEARTBEAT_INTERVAL": "0.5"}).start()
        for _ in range(blocks):
            parts.cfg = parts.cfg.model_copy(update={"param_norm_every": 10_000})
            off += time_steps(parts, 10)
            parts.cfg = parts.cfg.model_copy(update={"param_norm_every": norm_every})
            for _ in range(10):
                _sync()
                t0 = time.perf_counter()
                rec = train_step(parts)
                worker.step_done(parts.progress.step, **rec)
                _sync()
                on.append(time.perf_counter() - t0)
        worker.close()
    a, b = statistics.median(off), statistics.median(on)
    return {"step_s_off": round(a, 5), "step_s_on": round(b, 5),
            "overhead_pct": round(100 * (b - a) / a, 3), "steps_each": len(off),
            "param_norm_every": norm_every, "heartbeat_interval_s": 0.5}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=os.path.expanduser(
        "~/.cache/orchestrator/datasets/stdlib-byte"))
    ap.add_argument("--runs", default="eager:fsdp2:4,compiled:fsdp2:4,compiled:none:4,"
                    "compiled:fsdp2:8,compiled:none:8",
                    help="comma-separated mode:strategy:micro_batch runs")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ac", default="none")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--overhead", type=int, default=4, help="blocks of 10+10 steps; 0 skips")
    ap.add_argument("--out", default="gpu-train.json")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from trainer.data.prepare import prepare_dataset

    prepare_dataset("stdlib", args.data, "byte", max_bytes=64 * 2**20)
    peak = matmul_peak()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else None
    report = {**header(device), "matmul_peak_tflops": round(peak / 1e12, 1),
              "reference_tflops": H100_BF16_DENSE / 1e12, "model": args.preset, "runs": []}
    args.overhead_run = True  # measured once, on the first run (eager: no compile noise)
    for spec in args.runs.split(","):
        mode, strategy, mbs = spec.split(":")
        report["runs"].append(run_mode(mode == "compiled", strategy, int(mbs), args, peak))
        print(report["runs"][-1], flush=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    path = write(os.path.basename(args.out), report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
