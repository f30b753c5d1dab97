"""What profiling on demand and the step-time breakdown cost a training step, in one run.

Builds our trainer's parts (model, optimizer, loader, one process) with the trainer's own
builders and times ``train_step`` in blocks, interleaved round by round so drift (other
processes, clocks) hits every variant alike:

- ``plain``: no optimizer timer (the step record without ``optim_s``: the loop before the
  breakdown);
- ``breakdown``: the loop's :class:`trainer.steptime.OptimizerTimer` installed (global
  optimizer step pre/post hooks: the ``fwd_bwd_s`` / ``optim_s`` split);
- ``sdk``: ``breakdown`` plus the worker SDK's ``step_done`` with no profile armed (the one
  attribute test per step, and the step-time / data-wait summary kept for the beat).

It also times ``step_done`` alone (many calls) and the hooks alone (optimizer steps of a
one-parameter optimizer), the figures to trust when the step-time differences sit inside the
noise. Then it profiles ``--profile-steps`` steps with the SDK's :class:`ProfileSession`
(torch.profiler: CPU, plus CUDA on a GPU, shapes and memory recorded), as ``orchestrator
profile`` does in a rank, and reports those steps' time against unprofiled ones, the
profiler's start and export time, and the trace's size.

    python bench/training/profiling.py                                    # CPU, tiny model
    python bench/training/profiling.py --device cuda --preset 1b --seq 2048 --mbs 4 \\
        --out profiling-h100.json                                # one GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.common import header, write  # noqa: E402


class _NoAgent:
    """The SDK's surface the loop calls, with nothing behind it (``plain``)."""

    def step_done(self, step: int, **_: Any) -> None:
        return None

    def event(self, name: str, **_: Any) -> None:
        return None

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        yield


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(args: argparse.Namespace) -> Any:
    from orchestrator.worker import WorkerContext
    from stability.config import StabilityConfig
    from trainer.build import build_parts
    from trainer.config import CheckpointConfig, TrainerConfig
    from trainer.distributed import init_distributed
    from trainer.settings import WorkerSettings

    cuda = args.device == "cuda"
    cfg = TrainerConfig.model_validate({
        "steps": 10**6, "device": args.device, "deterministic": False, "num_threads": 1,
        "model": {"preset": args.preset},
        "data": {"path": args.data, "seq_len": args.seq, "micro_batch_size": args.mbs},
        "optimizer": {"lr": 3e-4, "fused": cuda}, "schedule": {"warmup_steps": 10},
        "precision": {"param_dtype": "bf16" if cuda else "fp32", "reduce_dtype": "fp32"},
        "parallelism": {"strategy": "fsdp2" if cuda else "none",
                        "backend": "nccl" if cuda else "gloo"},
        "param_norm_every": 10**6,
    })
    settings = WorkerSettings(cfg, CheckpointConfig(interval_steps=10**9), StabilityConfig(),
                              "bench", tempfile.mkdtemp(prefix="bench-ckpt-"), "bench")
    dctx = init_distributed(cfg)
    return build_parts(settings, dctx, WorkerContext(), _NoAgent(), lambda m: None)


def timed_steps(parts: Any, n: int, device: str, worker: Any = None,
                first_step: int = 0) -> list[float]:
    from trainer.loop import train_step

    out = []
    for i in range(n):
        _sync(device)
        t = time.perf_counter()
        rec = train_step(parts)
        if worker is not None:
            worker.step_done(first_step + i + 1, **rec)
        _sync(device)
        out.append(time.perf_counter() - t)
    return out


def overhead(parts: Any, args: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.worker.sdk import Worker
    from trainer.steptime import OptimizerTimer

    worker = Worker(env={"RANK": "0"})  # unmanaged: no socket, no beat thread
    timer = OptimizerTimer()
    times: dict[str, list[float]] = {"plain": [], "breakdown": [], "sdk": []}
    step = 0
    for _ in range(args.rounds):
        for variant in times:
            if variant == "plain":
                parts.optimizer_timer = None
            else:
                parts.optimizer_timer = timer.install()
            times[variant] += timed_steps(parts, args.block, args.device,
                                          worker if variant == "sdk" else None, step)
            step += args.block
            if parts.optimizer_timer is not None:
                timer.remove()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"rounds": args.rounds, "block": args.block,
            "median_step_s": {k: round(v, 6) for k, v in medians.items()},
            "mean_step_s": {k: round(statistics.fmean(v), 6) for k, v in times.items()},
            "breakdown_minus_plain_pct": round(100 * (medians["breakdown"] / medians["plain"]
                                                      - 1), 2),
            "sdk_minus_plain_pct": round(100 * (medians["sdk"] / medians["plain"] - 1), 2)}


def isolated(calls: int) -> dict[str, float]:
    """Microseconds per call: the optimizer hooks, and step_done with no profile armed."""
    from orchestrator.worker.sdk import Worker
    from trainer.steptime import OptimizerTimer

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    p.grad = torch.zeros(1)

    def per_call(fn: Any) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6

    # Alternated five times, the fastest of each kept: the machine's noise only adds.
    bare, hooked = [], []
    for _ in range(5):
        bare.append(per_call(opt.step))
        timer = OptimizerTimer().install()
        hooked.append(per_call(opt.step))
        timer.remove()
    bare_us, hooked_us = min(bare), min(hooked)
    worker = Worker(env={"RANK": "1"})
    counter = iter(range(1, 10**9))
    rec = {"loss": 1.0, "step_time": 0.1, "data_s": 0.01}
    step_done = per_call(lambda: worker.step_done(next(counter), **rec))
    return {"optimizer_step_us": round(bare_us, 2),
            "optimizer_step_with_timer_us": round(hooked_us, 2),
            "timer_hooks_us": round(hooked_us - bare_us, 2),
            "step_done_no_profile_us": round(step_done, 2)}


def profile(parts: Any, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    from orchestrator.worker.profiling import ProfileOrder, ProfileSession, warm_up
    from trainer.loop import train_step

    warm_up()  # as the beat thread does when an order arrives
    sent: list[tuple[str, dict[str, Any]]] = []
    base = parts.progress.step
    before = timed_steps(parts, args.profile_steps, args.device)
    session = ProfileSession(ProfileOrder(1, base + args.profile_steps + 2, args.profile_steps),
                             0, out_dir, lambda name, **d: sent.append((name, d)))
    profiled: list[float] = []
    t_start = None
    while not session.done:
        _sync(args.device)
        t = time.perf_counter()
        train_step(parts)
        _sync(args.device)
        step_s = time.perf_counter() - t
        if session._prof is not None and t_start is not None:
            profiled.append(step_s)
        t0 = time.perf_counter()
        spent = session.on_step(parts.progress.step)
        if session._prof is not None and t_start is None:
            t_start = time.perf_counter() - t0
        del spent
    name, data = sent[-1]
    assert name == "profile_written", data
    return {"steps": args.profile_steps, "activities": "cpu+cuda" if args.device == "cuda"
            else "cpu", "median_step_s_unprofiled": round(statistics.median(before), 6),
            "median_step_s_profiled": round(statistics.median(profiled), 6),
            "profiled_over_unprofiled": round(statistics.median(profiled)
                                              / statistics.median(before), 3),
            "profiler_start_s": round(t_start or 0.0, 4), "export_s": data["export_s"],
            "trace_bytes": data["bytes"],
            "trace_mib_per_step": round(data["bytes"] / 2**20 / args.profile_steps, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--data", default=os.path.expanduser(
        "~/.cache/orchestrator/datasets/stdlib-byte"))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--out", default="profiling-cpu.json")
    args = ap.parse_args()
    if not Path(args.data).exists():
        from trainer.data.prepare import prepare_dataset

        prepare_dataset("stdlib", args.data, "byte", max_bytes=16 * 2**20)
    parts = build(args)
    timed_steps(parts, args.warmup, args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else None
    report = {**header(device), "what": "step-time breakdown and profiling on demand",
              "preset": args.preset, "seq_len": args.seq, "micro_batch_size": args.mbs,
              "threads": torch.get_num_threads()}
    report["overhead"] = overhead(parts, args)
    report["isolated"] = isolated(args.calls)
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        report["profile"] = profile(parts, args, Path(tmp))
    path = write(args.out, report)
    print(path)
    import json

    print(json.dumps({k: report[k] for k in ("overhead", "isolated", "profile")}, indent=1))


if __name__ == "__main__":
    main()
