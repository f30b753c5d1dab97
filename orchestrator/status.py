"""``orchestrator status``: the job as its journal tells it, live or long after it ended."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from orchestrator.journal import read_events
from orchestrator.jobview import JobView
from orchestrator.rundir import RunDir


def load_view(run: RunDir) -> JobView:
    return JobView.from_events(read_events(run.journal))


def last_step_record(run: RunDir) -> dict[str, Any] | None:
    """The last complete line of steps.jsonl (read from the end; the file can be large)."""
    path: Path = run.steps
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def build_status(view: JobView, run: RunDir, live_nodes: Any = None) -> dict[str, Any]:
    """One JSON-able object: state, steps, restarts and causes, checkpoints, nodes, failure."""
    last = last_step_record(run)
    last_step = max(view.last_step, (last or {}).get("step", 0) or 0)
    end = view.ended_ts or time.time()
    nodes: dict[str, Any] = {}
    for node_id, nv in view.nodes.items():
        nodes[node_id] = {"state": nv.state, "node_rank": nv.node_rank, "host": nv.host,
                          "history": nv.history[-20:]}
    if live_nodes is not None:
        for node_id, rec in live_nodes.nodes.items():
            entry = nodes.setdefault(node_id, {"history": []})
            entry.update({"state": rec.state.value, "node_rank": rec.node_rank,
                          "host": rec.host,
                          "silent_s": round(live_nodes.silent_for(rec), 2)})
    failure = view.failures[-1] if view.failures else None
    return {
        "job": view.job,
        "run_dir": str(run.root),
        "state": view.state.value,
        "generation": view.generation,
        "last_step": last_step,
        "total_steps": view.total_steps,
        "tokens": (last or {}).get("tokens", view.tokens),
        "loss": (last or {}).get("loss"),
        "wall_time_s": round(end - view.created_ts, 3) if view.created_ts else 0.0,
        "restarts": [{"generation": r["generation"], "cause": r["cause"],
                      "resume_step": r.get("resume_step"), "ts": r["ts"]}
                     for r in view.restarts],
        "failures": [{k: f.get(k) for k in ("generation", "cause", "rank", "node_id",
                                            "exit_code", "signal", "message")}
                     for f in view.failures],
        "root_cause": None if failure is None else {
            **{k: failure.get(k) for k in ("cause", "rank", "node_id", "exit_code", "signal",
                                           "message")},
            "log_tail": failure.get("log_tail", [])[-20:]},
        "failed_reason": view.last_failure_reason,
        "checkpoints": [{"step": c["step"], "tier": c["tier"], "path": c["path"],
                         "paths": c["paths"], "ts": c["ts"]}
                        for c in view.committed_checkpoints],
        "nodes": nodes,
        "supervisor_restarts": max(0, len(view.supervisor_starts) - 1),
        "rollbacks": view.rollbacks,
    }
