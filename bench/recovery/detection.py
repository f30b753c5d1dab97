"""Failure detection latency on the local default: SIGKILL -> detected, SIGSTOP -> detected.

Runs ``orchestrator up`` (configs/local.yaml) with two injections: rank 1 SIGKILLs itself
after step 100, and rank 0 SIGSTOPs itself after step 250 of the next generation. Each
injection's moment is the rank's own timestamp on its ``chaos`` event (sent just before the
signal); detection is the supervisor's STOPPING transition. Same host, same clock.

Targets: crash detection < 1 s; hang detection <= 3 x step time + 2 s. The hang
timeout is the calibrated one, max(training_floor_s, training_multiplier x largest recent
step); the run uses floor 1 s and multiplier 3 (production defaults are 30 s and 5: the
floor is the operator's safety margin, the rule is what is measured here).

    python bench/recovery/detection.py [--floor 1] [--multiplier 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import header, write  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--floor", type=float, default=1.0)
    ap.add_argument("--multiplier", type=float, default=3.0)
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="bench-detect-")) / "run"
    sets = ["trainer.steps=400", f"timeouts.training_floor_s={args.floor}",
            f"timeouts.training_multiplier={args.multiplier}",
            "chaos.kill=[{step: 100, rank: 1, signal: SIGKILL}, "
            "{step: 250, rank: 0, signal: SIGSTOP}]"]
    cmd = [sys.executable, "-m", "orchestrator", "up", "--run-dir", str(run)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        print(out.stdout[-3000:], out.stderr[-3000:])
        return 1
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    chaos = [e for e in events if e["kind"] == "chaos"]
    stops = [e for e in events if e["kind"] == "transition" and e["to"] == "STOPPING"]
    calib = [e for e in events if e["kind"] == "calibration"]
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    step_times = [r["step_time"] for r in steps if "step_time" in r]
    step_s = statistics.median(step_times)
    results = {}
    for inj, stop in zip(chaos, stops, strict=True):
        latency = stop["ts"] - inj["ts"]
        kind = "crash" if inj["signal"] == "SIGKILL" else "hang"
        target = 1.0 if kind == "crash" else 3 * step_s + 2.0
        results[kind] = {"signal": inj["signal"], "at_step": inj["step"],
                         "detected_as": stop["cause"], "latency_s": round(latency, 3),
                         "target_s": round(target, 3), "met": latency <= target}
    report = {**header(), "config": "configs/local.yaml", "overrides": sets,
              "median_step_s": round(step_s, 4),
              "training_timeout_s": calib[-1]["training_timeout_s"] if calib else None,
              "heartbeat_interval_s": 0.5, "results": results}
    path = write("detection-cpu.json", report)
    print(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
