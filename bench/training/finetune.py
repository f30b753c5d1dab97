"""Full fine-tuning vs LoRA vs QLoRA on the small preset, on this CPU.

Each method runs in a fresh process (so its peak resident memory is its own): the small
preset (dim 256, 4 layers) built from one seed, adapters through ``trainer.finetune`` exactly as
the trainer adds them (rank 8 on wqkv, wo, w13, w2; QLoRA's base in NF4), AdamW over the
trainable parameters, then ``--steps`` optimizer steps of ``--mbs`` x ``--seq`` tokens.
Reported: trainable and total parameters, the median step time, and the process's peak RSS
(``ru_maxrss``) with the part that the model, gradients and optimizer add over the same process
before building them. Ratios against full fine-tuning come from the same run.

    python bench/training/finetune.py            # writes bench/results/finetune-cpu.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

METHODS = ("full", "lora", "qlora")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(method: str, steps: int, mbs: int, seq: int, rank: int) -> dict:
    """One method in this process."""
    # Imported by every method before the baseline: peft and torchao's own resident size
    # (~100 MB) is not what LoRA costs per step.
    import peft  # noqa: F401
    import torch
    import torchao.quantization  # noqa: F401

    from trainer.backends.base import lm_loss
    from trainer.config import FinetuneConfig
    from trainer.finetune import add_adapters, quantize_base, trainable_counts
    from trainer.model import Transformer
    from trainer.presets import PRESETS

    torch.set_num_threads(1)
    args = PRESETS["small"]
    tokens = torch.randint(0, args.vocab_size, (steps + 1, mbs, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    before = _rss_mb()
    with torch.device("meta"):
        model = Transformer(args)
    ft = None if method == "full" else FinetuneConfig(method=method, rank=rank, alpha=2 * rank)
    if ft is not None:
        model = add_adapters(model, ft)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    if ft is not None and ft.method == "qlora":
        quantize_base(model, ft)
    trainable, total = trainable_counts(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                            foreach=True)
    times = []
    for i in range(steps + 1):  # the first step (allocations, lazy state) is not timed
        t0 = time.perf_counter()
        batch = tokens[i]
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    peak = _rss_mb()
    return {"method": method, "trainable_params": trainable, "total_params": total,
            "step_time_s_median": round(statistics.median(times), 4),
            "peak_rss_mb": round(peak, 1), "peak_rss_over_baseline_mb": round(peak - before, 1),
            "final_loss": round(float(loss), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--one", choices=METHODS, help=argparse.SUPPRESS)  # child process
    parser.add_argument("--out", default="finetune-cpu.json")
    a = parser.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.steps, a.mbs, a.seq, a.rank)))
        return 0
    from bench.common import header, write

    rows = []
    for method in METHODS:
        out = subprocess.run([sys.executable, __file__, "--one", method, "--steps",
                              str(a.steps), "--mbs", str(a.mbs), "--seq", str(a.seq),
                              "--rank", str(a.rank)], capture_output=True, text=True,
                             check=True, timeout=1800)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    full = rows[0]
    for row in rows:
        row["step_time_vs_full"] = round(row["step_time_s_median"] / full["step_time_s_median"],
                                         3)
        row["memory_over_baseline_vs_full"] = round(
            row["peak_rss_over_baseline_mb"] / full["peak_rss_over_baseline_mb"], 3)
    report = {**header(), "model": "small preset (dim 256, 4 layers, 8 heads, 4 kv heads)",
              "batch": f"{a.mbs} x {a.seq} tokens, fp32, 1 thread", "lora_rank": a.rank,
              "targets": "wqkv, wo, w13, w2", "steps_timed": a.steps, "results": rows}
    print(write(a.out, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
