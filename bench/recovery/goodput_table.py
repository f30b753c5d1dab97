"""Goodput of the two recovery paths, computed from a measured paths benchmark.

    python bench/recovery/goodput_table.py bench/results/recovery-gpu2-paths-h100.json

From the benchmark's one call (both paths on the same cards): the median time from a
SIGKILL to the next step done (MTTR), the steps a recovery redoes (half the memory tier's
interval on average: the restore point is the newest step every rank committed), the slow
steps after it (their median seconds beyond the median step: ``settle``, where the report
has it), and the blocking time of the saves per step. At a failure every ``period`` seconds,
the fraction of wall time that is training progress is

    goodput = (1 - save_blocking_per_step / step_time) * (1 - (mttr + redone + settle) / period)

Failure periods: one per 3 h and one per 14 min (Meta's published rates at 16k and 131k
GPUs). Prints a markdown table and writes it beside the benchmark as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PERIODS = {"1 per 3 h": 3 * 3600.0, "1 per 14 min": 14 * 60.0}


def _set(overrides: list[str], key: str) -> float | None:
    for item in overrides:
        name, _, value = item.partition("=")
        if name == key:
            return float(value)
    return None


def table(report: dict) -> dict:
    step = report["median_step_s"]
    memory_every = _set(report["overrides"], "checkpoint.memory_interval_steps") or 0
    redone_s = step * memory_every / 2
    out: dict = {"step_s": step, "memory_interval_steps": memory_every,
                 "redone_s": round(redone_s, 3), "paths": {}}
    for run in report["runs"]:
        kills = [r["total_s"] for r in run["recoveries"]
                 if r.get("signal") == "SIGKILL" and r.get("total_s") is not None]
        blocks = run["step_blocking"]
        saving_steps = blocks["saving_steps"]
        steps_total = _set(report["overrides"], "trainer.steps") or 1
        # Blocking spread over every step: the median blocking save times the saves a step.
        per_step = (blocks["median_s"] or 0.0) * saving_steps / steps_total
        mttr = statistics.median(kills) if kills else None
        slow = [r["settle"]["excess_s"] for r in run["recoveries"]
                if r.get("signal") == "SIGKILL" and (r.get("settle") or {}).get("excess_s")
                is not None]
        settle_s = statistics.median(slow) if slow else 0.0
        row = {"mttr_s": mttr, "settle_s": round(settle_s, 3),
               "save_blocking_per_step_s": round(per_step, 5)}
        for name, period in PERIODS.items():
            if mttr is None:
                row[name] = None
                continue
            goodput = (1 - per_step / step) * (1 - (mttr + redone_s + settle_s) / period)
            row[name] = round(100 * goodput, 2)
        out["paths"][run["path"]] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", type=Path)
    args = ap.parse_args()
    report = json.loads(args.report.read_text())
    t = table(report)
    print(f"{report['device']}, commit {report['commit']}, step {t['step_s']} s, "
          f"memory tier every {t['memory_interval_steps']:.0f} steps")
    print("| path | SIGKILL -> next step (median) | slow steps after it | saves' blocking a step | "
          + " | ".join(f"goodput at {p}" for p in PERIODS) + " |")
    print("|---|---|---|---|" + "---|" * len(PERIODS))
    for path, row in t["paths"].items():
        cells = " | ".join(f"{row[p]} %" if row[p] is not None else "-" for p in PERIODS)
        print(f"| {path} | {row['mttr_s']} s | {row['settle_s']} s "
              f"| {row['save_blocking_per_step_s'] * 1000:.1f} ms "
              f"| {cells} |")
    out = args.report.with_name(args.report.stem + "-goodput.json")
    record = {"script": "bench/recovery/goodput_table.py", "device": report["device"],
              "commit": report["commit"],
              "commit_note": f"derived from {args.report.name} (its commit and device)",
              "source": args.report.name, **t}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
