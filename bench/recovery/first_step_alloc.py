"""Where a replacement's first step goes beyond a steady one: the caching allocator.

A rank that takes over starts with an empty CUDA caching allocator, so its first step
asks the driver for every block its activations, gradients and unsharded parameters need.
This builds the trainer's parts for a config (world 1, as a one-rank job), runs a few
steps (compiles, steady state), then times steps in one process: steady; after
``torch.cuda.empty_cache()`` (every block asked for again, as in a new process); and after
``empty_cache()`` plus one reservation of the bytes the step took from the driver (one
request, split by the allocator). Old path beside new in one run. Then it builds a second
set of parts in the same process, as a replacement builds its own, and profiles that
set's first step.

    python bench/recovery/first_step_alloc.py configs/gpu-1b-h100.yaml \\
        --set trainer.data.micro_batch_size=8 --out first-step-alloc-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _commit() -> str:
    if os.environ.get("ORCH_BENCH_COMMIT"):
        return os.environ["ORCH_BENCH_COMMIT"][:7]
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--warm-steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="first-step-alloc.json")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import orchestrator.worker as ow
    from orchestrator.config.loader import load_config
    from orchestrator.worker import WorkerContext
    from trainer.build import build_parts
    from trainer.data.prepare import prepare_dataset
    from trainer.distributed import init_distributed
    from trainer.loop import train_step
    from trainer.settings import load_settings

    tmp = Path(tempfile.mkdtemp(prefix="first-step-"))
    data = tmp / "data"
    prepare_dataset("stdlib", data, "byte", max_bytes=8 << 20)
    cfg = load_config(args.config, [*args.sets, f"trainer.data.path={data}",
                                    f"checkpoint.url={tmp / 'ckpt'}",
                                    "checkpoint.interval_steps=100000"])
    config = tmp / "config.json"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29561"), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ[k] = v
    settings = load_settings(str(config))
    cuda = torch.cuda.is_available()  # elsewhere: a dry run of the plumbing, on the CPU
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    empty = torch.cuda.empty_cache if cuda else (lambda: None)
    reserved_now = torch.cuda.memory_reserved if cuda else (lambda: 0)
    dctx = init_distributed(settings.trainer)
    parts = build_parts(settings, dctx, WorkerContext(), ow.init(), print)

    def timed() -> float:
        sync()
        t0 = time.perf_counter()
        train_step(parts)
        sync()
        return time.perf_counter() - t0

    for _ in range(args.warm_steps):
        timed()
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        steady = timed()
        empty()
        kept = reserved_now()
        cold = timed()  # every block of the step asked for again
        taken = reserved_now() - kept
        empty()
        t0 = time.perf_counter()
        block = torch.empty(taken, dtype=torch.uint8, device="cuda" if cuda else "cpu")
        del block
        sync()
        reserve_s = time.perf_counter() - t0
        reserved = timed()
        rounds.append({"steady_s": steady, "cold_allocator_s": cold,
                       "reserved_s": reserved, "reserve_s": reserve_s,
                       "step_bytes_from_driver": taken,
                       "segments_after": len(torch.cuda.memory_snapshot()) if cuda else 0})
        print(json.dumps(rounds[-1]), flush=True)

    # A second set of parts in this process, as a replacement builds its own: its first
    # step beside the steady one, with the compiled code already loaded (as the standby
    # has it) and where its time goes (torch.profiler's CPU-side table).
    second = build_parts(settings, dctx, WorkerContext(), ow.init(), print)
    first_steps: list[float] = []
    table = ""
    for i in range(3):
        sync()
        t0 = time.perf_counter()
        if i == 0:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                train_step(second)
                sync()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        else:
            train_step(second)
            sync()
        first_steps.append(time.perf_counter() - t0)
    print(table)
    print(json.dumps({"second_parts_steps_s": first_steps}), flush=True)

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 4)

    report = {
        "script": "bench/recovery/first_step_alloc.py", "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": args.device or (torch.cuda.get_device_name(0) if cuda else "cpu"),
        "python": platform.python_version(), "torch": torch.__version__,
        "config": args.config, "overrides": args.sets, "rounds": rounds,
        # The first (profiled) and two later steps of a second set of parts built in this
        # process, and the profile of the first.
        "second_parts_steps_s": first_steps, "second_parts_first_step_profile": table,
        "median": {k: med(k) for k in ("steady_s", "cold_allocator_s", "reserved_s",
                                       "reserve_s")},
    }
    out = ROOT / "bench" / "results" / Path(args.out).name
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["median"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
