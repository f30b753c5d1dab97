"""Step time of the parallelism backends on one small config, each a real `orchestrator up` job.

Every strategy trains the same model (tiny preset unless --preset), data and schedule on 2
ranks (2 simulated nodes, gloo, CPU), with checkpoints only at the end; the step times come
from the job's own step records (steps.jsonl, rank 0), without the first --skip steps
(start-up, allocator warm-up). Runs go one after another, in rounds (--rounds), so drift on a
shared machine spreads over all strategies. The first step's loss shows which strategies
start from the same weights (same seed, same data).

    python bench/training/backends.py [--steps 60] [--rounds 2] [--preset tiny] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import header, write

STRATEGIES = [("ddp", {"strategy": "ddp"}), ("fsdp2", {"strategy": "fsdp2"})] + [
    (f"deepspeed-zero{z}", {"strategy": "deepspeed", "zero_stage": z}) for z in range(4)]


def job(data: Path, steps: int, preset: str, parallelism: dict[str, Any]) -> dict[str, Any]:
    return {
        "job": {"name": "bench"},
        "cluster": {"nodes": 2, "procs_per_node": 1},
        "trainer": {"steps": steps, "device": "cpu", "num_threads": 1, "log_every": steps,
                    "param_norm_every": steps, "model": {"preset": preset},
                    "data": {"path": str(data), "seq_len": 64, "micro_batch_size": 4,
                             "prepare_from": None},
                    "schedule": {"warmup_steps": 5}, "optimizer": {"lr": 3.0e-3},
                    "parallelism": {"backend": "gloo", **parallelism}},
        "checkpoint": {"interval_steps": steps, "keep_last": 1},
        "metrics": {"port": 0, "host": "127.0.0.1"},
        "stability": {"grad_spike": {"mode": "relative", "rel_margin": 1.0}},
    }


def run(cfg: dict[str, Any], tmp: Path, skip: int) -> dict[str, Any]:
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "orchestrator", "up", str(tmp / "job.yaml"),
                          "--run-dir", str(tmp / "run")], capture_output=True, text=True,
                         timeout=900, check=False)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:])
    records = [json.loads(line) for line in (tmp / "run" / "steps.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in records[skip:]]
    return {"median_step_s": statistics.median(times), "steps_timed": len(times),
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", default="backends-cpu.json")
    args = ap.parse_args()
    from trainer.data.prepare import prepare_dataset

    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in STRATEGIES}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as td:
        data = Path(td) / "data"
        prepare_dataset("stdlib", data, "byte", max_bytes=1 << 20)
        for r in range(args.rounds):
            for name, par in STRATEGIES:
                tmp = Path(td) / f"{name}-{r}"
                tmp.mkdir()
                results[name].append(run(job(data, args.steps, args.preset, par), tmp,
                                         args.skip))
                print(name, r, results[name][-1], flush=True)
    summary = {name: {"median_step_ms": round(1000 * statistics.median(
        x["median_step_s"] for x in runs), 1), "first_loss": runs[0]["first_loss"],
        "last_loss": runs[0]["last_loss"], "runs": runs} for name, runs in results.items()}
    report = {**header(), "preset": args.preset, "ranks": 2, "micro_batch_size": 4,
              "seq_len": 64, "steps": args.steps, "skipped_steps": args.skip,
              "results": summary}
    print(json.dumps({k: v["median_step_ms"] for k, v in summary.items()}, indent=1))
    print("written", write(args.out, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
