"""Goodput of a run with two kills, with the memory tier and without, side by side.

The question it answers: the goodput of a 10-minute run with two kills, with and without the
memory tier. Each *variant* is one ``orchestrator up`` job of the same config
and steps, rank 0 SIGKILLed after ``--kills`` steps (chosen off every checkpoint interval,
so each restart loses steps: the tier's point is that it can checkpoint more often). With
``--concurrent`` the variants run at the same time, each on its own GPUs
(``--gpus 0;1``: CUDA_VISIBLE_DEVICES per variant), so one call of a borrowed GPU machine holds
both; each job has its own name, data path and memory root, so nothing is shared but the
compile cache. The report has each job's summary (goodput, the badput by cause, restarts)
and each recovery's breakdown (``recovery.breakdown``).

    python bench/recovery/goodput_kills.py --profile h200 --concurrent --gpus "0;1" \\
        --device "NVIDIA H200 x2" --out goodput-kills-h200.json
    python bench/recovery/goodput_kills.py --profile cpu --out goodput-kills-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header, write  # noqa: E402
from bench.recovery.recovery import _events, _kill_run, breakdown, median_step  # noqa: E402

# ``memory``: the tier on (a copy in host memory every 50 steps); ``disk``: off.
VARIANTS: dict[str, list[str]] = {
    "memory": ["checkpoint.memory_interval_steps=50",
               "checkpoint.memory_max_bytes=68719476736"],
    "disk": [],
}

PROFILES: dict[str, dict[str, Any]] = {
    # The embedded default: 2 simulated nodes x 1 rank on gloo (a CPU smoke run).
    "cpu": {"config": None, "steps": 300, "kills": [95, 215], "sets": [
        "trainer.steps={steps}", "checkpoint.interval_steps=60",
        "timeouts.training_floor_s=5", "job.warm_start=false"],
        "variant_sets": {"memory": ["checkpoint.memory_interval_steps=10",
                                    "checkpoint.memory_max_bytes=1073741824"]}},
    # The 1.14B model compiled at micro-batch 8 on ONE GPU per job (~0.2 s steps), so two
    # jobs run at once on a 2-GPU machine: ~2,200 steps is ~8 minutes with two recoveries.
    "h200": {"config": "configs/gpu-1b-h100.yaml", "steps": 2200, "kills": [725, 1530],
             "sets": ["trainer.steps={steps}", "trainer.data.micro_batch_size=8",
                      "trainer.parallelism.compile=true", "checkpoint.interval_steps=150",
                      "checkpoint.keep_last=2", "timeouts.training_floor_s=10",
                      "timeouts.training_floor_calibrated_s=1",
                      "timeouts.training_multiplier=3", "job.warm_start=true",
                      "health.preflight=quick"],
             "variant_sets": {}},
}


def command(config: str | None, sets: list[str], run: Path) -> list[str]:
    cmd = [sys.executable, "-m", "orchestrator", "up", "--run-dir", str(run),
           "--log-format", "json"]
    cmd += [config] if config else []
    for s in sets:
        cmd += ["--set", s]
    return cmd


def report_of(name: str, run: Path, wall: float, rc: int | None) -> dict[str, Any]:
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.journal.status import load_view
    from orchestrator.cli.summary import build_summary

    events = _events(run)
    summary = build_summary(load_view(RunDir(run)), RunDir(run))
    return {"variant": name, "rc": rc, "wall_s": round(wall, 1),
            "goodput": summary["goodput"], "productive_s": summary["productive_s"],
            "time_lost_s": summary["time_lost_s"], "time_lost_by": summary["time_lost_by"],
            "restarts": summary["restarts"], "causes": summary["causes"],
            "state": summary["state"], "steps": summary["steps"],
            "median_step_s": median_step(run),
            "recoveries": [breakdown(events, c) for c in events if c["kind"] == "chaos"],
            "restore_tiers": [{k: e.get(k) for k in ("generation", "tier", "reason", "step")}
                              for e in events if e["kind"] == "restore_tier"],
            "run_dir": str(run)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--kills", default=None, help="comma-separated steps (default: the "
                    "profile's)")
    ap.add_argument("--variants", default="memory,disk")
    ap.add_argument("--concurrent", action="store_true", help="run the variants at once")
    ap.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES per variant, ';'-"
                    "separated (e.g. '0;1')")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="goodput-kills-cpu.json")
    args = ap.parse_args()
    profile = PROFILES[args.profile]
    steps = args.steps or profile["steps"]
    kills = [int(k) for k in args.kills.split(",")] if args.kills else profile["kills"]
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {sorted(VARIANTS)}")
    gpus = args.gpus.split(";") if args.gpus else []
    if gpus and len(gpus) != len(names):
        raise SystemExit(f"--gpus names {len(gpus)} device sets for {len(names)} variants")
    chaos = "chaos.kill=[" + ", ".join(f"{{step: {k}, rank: 0, signal: SIGKILL}}"
                                        for k in kills) + "]"
    root = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    jobs: list[tuple[str, Path, subprocess.Popen, float]] = []
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def finish(name: str, run: Path, proc: subprocess.Popen, started: float) -> None:
        try:
            proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            _kill_run(proc, run)
            proc.wait()
        wall = time.monotonic() - started
        if proc.returncode != 0:
            print((run.parent / "up.log").read_text()[-3000:])
        results.append(report_of(name, run, wall, proc.returncode))
        print(json.dumps(results[-1]), flush=True)

    for i, name in enumerate(names):
        run = root / name / "run"
        sets = [s.format(steps=steps) for s in profile["sets"]]
        sets += profile["variant_sets"].get(name, VARIANTS[name])
        sets += [f"job.name=goodput-{name}", chaos, *args.sets]
        if args.profile != "cpu":
            sets.append(f"trainer.data.path={root / name / 'data'}")
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        run.parent.mkdir(parents=True, exist_ok=True)
        # Into a file, never a pipe: a pipe nobody reads while the other job is waited for
        # fills, and the supervisor blocks writing its log (a 400 s stall, measured).
        with open(run.parent / "up.log", "wb") as out:
            proc = subprocess.Popen(command(profile["config"], sets, run), env=env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        jobs.append((name, run, proc, time.monotonic()))
        if not args.concurrent:
            finish(*jobs.pop())
    for job in jobs:
        finish(*job)
    report = {**header(args.device), "profile": args.profile,
              "config": profile["config"] or "configs/local.yaml", "steps": steps,
              "kills": kills, "concurrent": args.concurrent, "gpus": gpus,
              "variants": results, "wall_s": round(time.monotonic() - t0, 1)}
    path = write(Path(args.out).name, report)
    print(json.dumps({v["variant"]: {"goodput": v["goodput"], "wall_s": v["wall_s"],
                                      "lost": v["time_lost_by"]} for v in results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
