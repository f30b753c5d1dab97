"""Time to recover under ``orchestrator up``: SIGKILL a rank -> the next completed step.

One run, two injections: rank 0 SIGKILLs itself after step ``--kill-step``, then (in the
next generation) SIGSTOPs itself after step ``--stop-step``. Each recovery is broken down
from the journal and the new generation's ``startup`` event (the rank's own wall-clock
milestones):

    detection   kill -> STOPPING             (agent waitpid -> supervisor)
    teardown    STOPPING -> RECOVERING       (stop every rank, confirm)
    backoff     RECOVERING -> HEALTH_CHECK   (restart.backoff_initial_s)
    placement   HEALTH_CHECK -> LAUNCHING
    launch      generation_launched -> new process started
    interpreter process start -> main() (Python start-up + worker SDK import)
    imports     main() -> torch and trainer imported
    dist_init   process group up (rendezvous)
    build_load  model, optimizer, data built; checkpoint restored (load_s of it)
    first_step  restored -> first step done (compile, allocator warm-up)

Hang detection latency is SIGSTOP -> STOPPING (cause hang).

    python bench/recovery.py [CONFIG] [--set key=value ...] --out recovery-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import header, write


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _first(events: list[dict], after: float, **match: Any) -> dict[str, Any]:
    for e in events:
        if e["ts"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    raise LookupError(f"no event {match} after {after}")


def breakdown(events: list[dict[str, Any]], chaos: dict[str, Any]) -> dict[str, Any]:
    kill = chaos["ts"]
    stopping = _first(events, kill, kind="transition", to="STOPPING")
    out: dict[str, Any] = {"signal": chaos["signal"], "at_step": chaos["step"],
                           "detected_as": stopping["cause"],
                           "detection_s": stopping["ts"] - kill}
    recovering = _first(events, stopping["ts"], kind="transition", to="RECOVERING")
    health = _first(events, recovering["ts"], kind="transition", to="HEALTH_CHECK")
    launching = _first(events, health["ts"], kind="transition", to="LAUNCHING")
    launched = _first(events, launching["ts"], kind="generation_launched")
    startup = _first(events, launched["ts"], kind="startup")
    resumed = next((e for e in events if e["kind"] == "resumed"
                    and e.get("generation") == launched["generation"]), {})
    out.update({
        "teardown_s": recovering["ts"] - stopping["ts"],
        "backoff_s": health["ts"] - recovering["ts"],
        "placement_s": launching["ts"] - health["ts"],
        "launch_s": startup["process_start"] - launched["ts"],
        "interpreter_s": startup["main"] - startup["process_start"],
        "imports_s": startup["imports_done"] - startup["main"],
        "dist_init_s": startup["dist_ready"] - startup["imports_done"],
        "build_load_s": startup["built"] - startup["dist_ready"],
        "of_which_load_s": resumed.get("load_s"),
        "first_step_s": startup["first_step_done"] - startup["built"],
        "total_s": startup["first_step_done"] - kill,
        "resumed_from_step": resumed.get("step"),
    })
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="job YAML (default: configs/local.yaml)")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--kill-step", type=int, default=60)
    ap.add_argument("--stop-step", type=int, default=120)
    ap.add_argument("--device", default=None, help="device name for the report")
    ap.add_argument("--out", default="recovery-cpu.json")
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="bench-recover-")) / "run"
    sets = [*args.sets, "chaos.kill=[{step: %d, rank: 0, signal: SIGKILL}, "
            "{step: %d, rank: 0, signal: SIGSTOP}]" % (args.kill_step, args.stop_step)]
    cmd = [sys.executable, "-m", "orchestrator", "up", "--run-dir", str(run)]
    cmd += [args.config] if args.config else []
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        print(out.stdout[-4000:], out.stderr[-4000:])
        return 1
    events = _events(run)
    chaos = [e for e in events if e["kind"] == "chaos"]
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    times = sorted(r["step_time"] for r in steps if r.get("step_time"))
    report = {**header(args.device), "config": args.config or "configs/local.yaml",
              "overrides": sets, "median_step_s": round(times[len(times) // 2], 4),
              "recoveries": [breakdown(events, c) for c in chaos]}
    path = write(Path(args.out).name, report)
    print(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
