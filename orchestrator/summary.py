"""The end-of-run summary: steps, tokens, wall time, restarts and causes, checkpoints, loss."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.jobview import JobView
from orchestrator.rundir import RunDir


def productive_seconds(run: RunDir) -> float:
    """Seconds of steps that count: each step's interval, for the last time it was trained.

    A step trained again after a restart or rollback counts once, in its final run; its
    earlier runs are wasted progress. A generation's first step has no interval (it includes
    start-up) and is not counted here.
    """
    if not run.steps.exists():
        return 0.0
    last_by_step: dict[int, float] = {}
    prev: tuple[int, float] | None = None  # (generation, ts) of the previous record
    with open(run.steps) as f:
        for line in f:
            try:
                rec = json.loads(line)
                gen, step, ts = rec["generation"], int(rec["step"]), float(rec["ts"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if prev is not None and prev[0] == gen and ts >= prev[1]:
                last_by_step[step] = ts - prev[1]
            else:
                last_by_step.pop(step, None)
            prev = (gen, ts)
    return sum(last_by_step.values())


def build_summary(view: JobView, run: RunDir) -> dict[str, Any]:
    from orchestrator.status import last_step_record

    last = last_step_record(run) or {}
    wall = (view.ended_ts or view.last_ts or 0.0) - (view.created_ts or 0.0)
    productive = productive_seconds(run)
    return {
        "state": view.state.value,
        "steps": last.get("step", view.last_step),
        "total_steps": view.total_steps,
        "tokens": last.get("tokens", view.tokens),
        "final_loss": last.get("loss"),
        "wall_time_s": round(max(wall, 0.0), 2),
        "restarts": len(view.restarts),
        "causes": view.cause_counts(),
        "checkpoints_committed": len({c["step"] for c in view.checkpoints}),
        "productive_s": round(productive, 2),
        "time_lost_s": round(max(wall - productive, 0.0), 2),
        "failed_reason": view.last_failure_reason,
    }
