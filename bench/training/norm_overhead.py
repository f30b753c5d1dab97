"""What the stability norms cost a training step, measured in one run on this machine.

The trainer takes the total grad norm from the clipping it does anyway
(``stability.norms.clip_grad_norm_``) and the parameter norm every ``param_norm_every`` steps.
This script times training steps of the trainer's own model, optimizer and schedule in four
variants, interleaved round by round so that drift (other processes, thermal) hits all alike:

- ``no_clip``: forward, backward, optimizer step (what clipping itself costs, for scale);
- ``baseline``: plus ``torch.nn.utils.clip_grad_norm_`` with the norm left unread;
- ``grad_norm``: plus the norm taken from our clip and read out as a Python float, as the
  trainer's step record does;
- ``grad_and_param_norm``: plus ``stability.norms.param_norm`` on every step (k = 1, the worst
  case), from which the cost at the default k = 10 is the per-call cost divided by 10.

It also times the two extractions in isolation (many calls, no training around them), which is
the figure to trust when the step-time differences are inside the noise. Times are CPU time of
this process (``time.process_time``, one torch thread), which other processes on a shared
machine disturb far less than wall time; wall-clock medians are recorded beside them.

    python bench/training/norm_overhead.py [--preset tiny --preset small] [--steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stability.norms import clip_grad_norm_, param_norm  # noqa: E402
from trainer.config import OptimizerConfig, ScheduleConfig  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.optim import build_optimizer, build_scheduler  # noqa: E402
from trainer.presets import PRESETS  # noqa: E402

VARIANTS = ("no_clip", "baseline", "grad_norm", "grad_and_param_norm")


def step(model, optimizer, scheduler, batch, variant: str) -> tuple[float, float]:
    """One training step in ``variant``; returns its (CPU, wall) time in seconds."""
    inputs, targets = batch
    c0, t0 = time.process_time(), time.perf_counter()
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    loss.backward()
    if variant == "baseline":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    elif variant != "no_clip":
        float(clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if variant == "grad_and_param_norm":
        float(param_norm(model.parameters()))
    return time.process_time() - c0, time.perf_counter() - t0


def isolated(model, calls: int) -> dict[str, float]:
    """CPU microseconds per call of each operation, with gradients present."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    ops = {
        "torch_clip_grad_norm_us": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                          1e9),
        "stability_clip_and_read_grad_norm_us": lambda: float(
            clip_grad_norm_(model.parameters(), 1e9)),
        "param_norm_us": lambda: float(param_norm(model.parameters())),
    }
    out = {name: [] for name in ops}
    for _ in range(5):  # interleaved batches of calls, the median batch counts
        for name, op in ops.items():
            c0 = time.process_time()
            for _ in range(calls):
                op()
            out[name].append((time.process_time() - c0) / calls * 1e6)
    model.zero_grad(set_to_none=True)
    return {name: statistics.median(v) for name, v in out.items()}


def describe_device() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"kind": "cpu", "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform()}


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def summarize(times: list[tuple[float, float]]) -> dict[str, float]:
    cpu = sorted(c * 1000 for c, _ in times)
    wall = [w * 1000 for _, w in times]
    return {"cpu_median_ms": round(statistics.median(cpu), 4),
            "cpu_p10_ms": round(cpu[len(cpu) // 10], 4),
            "cpu_p90_ms": round(cpu[(9 * len(cpu)) // 10], 4),
            "wall_median_ms": round(statistics.median(wall), 4), "steps": len(cpu)}


def measure(preset: str, seq_len: int, batch_size: int, steps: int, rounds: int,
            calls: int) -> dict[str, object]:
    """Every variant on one model shape; the overheads relative to ``baseline``."""
    torch.manual_seed(0)
    model_args = PRESETS[preset]
    model = build_model(model_args)
    optimizer = build_optimizer(model, OptimizerConfig(), "cpu")
    scheduler = build_scheduler(optimizer, ScheduleConfig(warmup_steps=5), 100_000)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model_args.vocab_size, (batch_size, seq_len + 1), generator=gen)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    for _ in range(5):  # warm-up: allocator, optimizer state
        step(model, optimizer, scheduler, batch, "grad_norm")
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    per_round = max(1, steps // rounds)
    for r in range(rounds):
        # Rotate the order each round so no variant always runs first or last.
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            for _ in range(per_round):
                times[variant].append(step(model, optimizer, scheduler, batch, variant))
    stats = {v: summarize(t) for v, t in times.items()}
    base_ms = stats["baseline"]["cpu_median_ms"]
    micro = isolated(model, calls)
    base_us = base_ms * 1000
    return {
        "preset": preset, "params": sum(p.numel() for p in model.parameters()),
        "seq_len": seq_len, "batch": batch_size, "steps_per_variant": per_round * rounds,
        "step_time": stats,
        "step_overhead_vs_baseline_pct": {
            v: round((stats[v]["cpu_median_ms"] / base_ms - 1) * 100, 3) for v in VARIANTS},
        "isolated_cpu_us": {k: round(v, 2) for k, v in micro.items()},
        "isolated_overhead_pct_of_baseline_step": {
            "grad_norm_from_clip_vs_torch_clip": round(
                (micro["stability_clip_and_read_grad_norm_us"]
                 - micro["torch_clip_grad_norm_us"]) / base_us * 100, 4),
            "param_norm_every_step": round(micro["param_norm_us"] / base_us * 100, 4),
            "param_norm_every_10_steps": round(micro["param_norm_us"] / 10 / base_us * 100, 4),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS),
                        help="Model preset (repeatable; default: tiny and small).")
    parser.add_argument("--steps", type=int, default=48, help="Timed steps per variant.")
    parser.add_argument("--rounds", type=int, default=6, help="Interleaved rounds.")
    parser.add_argument("--calls", type=int, default=50, help="Calls per isolated timing.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "norm_overhead_cpu.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    # (seq_len, batch): tiny is the integration tests' shape, small a 1,024-token step.
    shapes = {"tiny": (64, 4), "small": (128, 8)}
    results = [measure(p, *shapes.get(p, (128, 8)), args.steps, args.rounds, args.calls)
               for p in args.preset or ["tiny", "small"]]
    report = {
        "benchmark": "stability norm overhead per training step (CPU time, one process)",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": describe_device(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
