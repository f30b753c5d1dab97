"""What a recovery benchmark's run wrote, read back: the save blocking of each step, the
hang timeout's calibrations, the saves' stalls, the median step, and the slow steps after a
recovery (``recovery.py`` reports them for each run)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

# The recovery target for a step's saves: the time they block training.
TARGET_SAVE_BLOCK_S = 0.2

def step_blocking(run: Path) -> dict[str, Any]:
    """Training's blocking time for saves, per step (both tiers together), from the steps."""
    path = run / "steps.jsonl"
    blocks = []
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("ckpt_block_s") is not None:
                blocks.append({"step": r["step"], "block_s": r["ckpt_block_s"],
                               "mem_block_s": r.get("mem_block_s")})
    values = sorted(b["block_s"] for b in blocks)
    both = [b for b in blocks if b["mem_block_s"] is not None and
            b["block_s"] > b["mem_block_s"] + 1e-9]
    return {"saving_steps": len(blocks), "max_s": values[-1] if values else None,
            "median_s": values[len(values) // 2] if values else None,
            "over_0_2_s": [b for b in blocks if b["block_s"] > TARGET_SAVE_BLOCK_S][:20],
            "both_tiers_max_s": max((b["block_s"] for b in both), default=None),
            "both_tiers_steps": len(both)}


def calibrations(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training timeout as the supervisor calibrated it, over the run."""
    return [{k: e.get(k) for k in ("ts", "max_interval_s", "training_timeout_s", "intervals")}
            for e in events if e["kind"] == "calibration"]


def save_stalls(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Blocking seconds of every committed save, a generation's first apart."""
    first: list[float] = []
    later: list[float] = []
    seen: set[int] = set()
    for e in events:
        if e["kind"] != "checkpoint_committed" or e.get("blocking_s") is None:
            continue
        gen = e.get("generation") or 0
        (later if gen in seen else first).append(e["blocking_s"])
        seen.add(gen)
    return {"first_of_generation_s": first, "later_s": later,
            "first_max_s": max(first, default=None),
            "later_median_s": round(statistics.median(later), 4) if later else None,
            "max_s": max(first + later, default=None)}


def settle(run: Path, failed_generation: int | None, median: float | None) -> dict[str, Any]:
    """After a recovery, the steps of the next generation until its steps are steady again
    (three in a row within 1.5 x the run's median step): how many, and the seconds they took
    beyond the median (training that ran, slowly: a replacement page-locking its staging
    holds every rank's steps up). The first step, in the recovery's own time, is left out."""
    path = run / "steps.jsonl"
    if failed_generation is None or median is None or not path.exists():
        return {}
    rows = [r for r in map(json.loads, path.read_text().splitlines())
            if r.get("generation") == failed_generation + 1 and r.get("step_time")]
    slow, steady, excess = 0, 0, 0.0
    for r in rows[1:]:
        if r["step_time"] <= 1.5 * median:
            steady += 1
            if steady == 3:
                break
            continue
        slow += 1 + steady
        excess += r["step_time"] - median
        steady = 0
    return {"slow_steps": slow, "excess_s": round(excess, 3)}


def median_step(run: Path) -> float | None:
    path = run / "steps.jsonl"
    if not path.exists():
        return None
    times = sorted(r["step_time"] for r in map(json.loads, path.read_text().splitlines())
                   if r.get("step_time"))
    return round(times[len(times) // 2], 4) if times else None
