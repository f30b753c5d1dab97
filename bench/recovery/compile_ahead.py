"""A replacement rank's first compiled step, with and without its standby compiling ahead.

Three fresh processes in a row, one rank each (world 1, the job's backend), sharing one
Inductor cache directory:

    prime   builds the job's model and runs its first step: a cold compile that fills the
            on-disk caches (what the job's first rank pays once)
    cached  the same in a new process: today's replacement, which finds the caches warm but
            still traces and compiles the model's graphs at its first step
    ahead   a new process that first runs ``trainer.standby_compile.compile_ahead`` (the
            standby's work, off the critical path), then builds the whole model and runs its
            first step: the graphs it looks up are the copy's

Each reports its first step's seconds, the graphs it compiled and the compiler's phases;
``ahead`` also the copy's seconds, graphs and peak GPU memory.

    python bench/recovery/compile_ahead.py configs/gpu-1b-h100.yaml \\
        --set trainer.data.micro_batch_size=8 --device "1 x H200" --out compile-ahead.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("prime", "cached", "ahead")


def _settings(config: str, sets: list[str]):
    from orchestrator.config.loader import apply_overrides, read_yaml
    from trainer.settings import load_settings

    data = apply_overrides(read_yaml(config), sets)
    data.setdefault("trainer", {}).setdefault("parallelism", {})["compile"] = True
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(data))
    return load_settings(str(path))


def one(phase: str, config: str, sets: list[str]) -> dict:
    """In this process: (the standby's compile ahead, then) the whole model's first step."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    import trainer.warm_compile  # noqa: F401 - the spare's imports
    from trainer import standby_compile
    from trainer.backends import backend_for
    from trainer.distributed import init_distributed

    settings = _settings(config, sets)
    out: dict = {"phase": phase}
    if phase == "ahead":
        out.update(standby_compile.compile_ahead(settings, 0, 0, 1))
    graphs = counters["stats"]["unique_graphs"]
    compiled = dict(compilation_time_metrics)
    t0 = time.perf_counter()
    dctx = init_distributed(settings.trainer)
    backend = backend_for(settings.trainer.parallelism.strategy)
    backend.setup(settings, dctx)
    model = backend.build_model(settings, dctx)
    stepper = backend.build_stepper(model, None, None, settings, dctx)
    t_built = time.perf_counter()
    inputs, targets = standby_compile.random_batch(settings, dctx.device)
    stepper.forward_backward(inputs, targets, True, 1.0)
    if dctx.device.type == "cuda":
        torch.cuda.synchronize()
    t_first = time.perf_counter()
    stepper.forward_backward(inputs, targets, True, 1.0)
    if dctx.device.type == "cuda":
        torch.cuda.synchronize()
    out.update({
        "build_s": round(t_built - t0, 3), "first_step_s": round(t_first - t_built, 3),
        "second_step_s": round(time.perf_counter() - t_first, 3),
        "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
        "compile_phases_s": {k: round(sum(v) - sum(compiled.get(k, [])), 3)
                             for k, v in compilation_time_metrics.items()
                             if sum(v) - sum(compiled.get(k, [])) >= 0.01}})
    import torch.distributed as dist

    dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--phase", choices=PHASES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help="device name for the report")
    ap.add_argument("--out", default="compile-ahead.json")
    args = ap.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(one(args.phase, args.config, args.sets)), flush=True)
        return 0
    cache = tempfile.mkdtemp(prefix="inductor-")
    runs = []
    for i, phase in enumerate(PHASES):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(29700 + i)}
        cmd = [sys.executable, __file__, args.config, "--phase", phase,
               *[a for s in args.sets for a in ("--set", s)]]
        proc = subprocess.run(cmd, check=False, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=900)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        runs.append(json.loads(line.removeprefix("RESULT ")))
        print(json.dumps(runs[-1]), flush=True)
    cached, ahead = runs[1], runs[2]
    import torch

    result = {"script": "bench/recovery/compile_ahead.py",
              "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
              "device": args.device, "torch": torch.__version__, "config": args.config,
              "overrides": args.sets, "runs": runs,
              "first_step_ratio_ahead_to_cached": round(ahead["first_step_s"]
                                                        / cached["first_step_s"], 3)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
