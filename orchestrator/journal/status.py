"""``orchestrator status``: the job as its journal tells it, live or long after it ended."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator.journal.books import Ledger, compute_books
from orchestrator.journal.view import JobView
from orchestrator.journal.store import read_journal
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.steprecord import parse_stored_line, read_steps


def load_view(run: RunDir) -> JobView:
    return JobView.from_events(read_journal(run.journal))


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every step record of ``steps.jsonl`` with its generation (``steprecord.read_steps``:
    a line that is not a record is skipped)."""
    for generation, rec, _ in read_steps(path, tail=False):
        yield {**rec, "generation": generation}


def load_books(run: RunDir, now: float | None = None) -> Ledger:
    """The goodput books of a run directory, at ``now`` while the job is live."""
    return compute_books(read_journal(run.journal), read_records(run.steps),
                         time.time() if now is None else now)


def last_step_record(run: RunDir) -> dict[str, Any] | None:
    """The last complete record of steps.jsonl (read from the end; the file can be large)."""
    path: Path = run.steps
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        parsed = parse_stored_line(line)
        if parsed is not None:
            return {**parsed[1], "generation": parsed[0]}
    return None


def build_status(view: JobView, run: RunDir, live_nodes: Any = None,
                 ledger: Ledger | None = None) -> dict[str, Any]:
    """One JSON-able object: state, steps, restarts and causes, checkpoints, nodes, failure,
    and the goodput books (``ledger``, or computed from the run directory)."""
    last = last_step_record(run)
    books = (ledger or load_books(run)).to_json()
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
                                            "exit_code", "signal", "message",
                                            "recovery_path", "recovery_reason")}
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
        "goodput": books["goodput"],
        "books": books,
        "stability": stability_status(view, run),
        "profiles": [profile_summary(p, view.generation)
                     for _, p in sorted(view.profiles.items())[-20:]],
        "stragglers": {"named": [{k: s.get(k) for k in _STRAGGLER_KEYS}
                                 for _, s in sorted(view.stragglers.items())],
                       "events": [{k: s.get(k) for k in ("action", "node_id", "ts")}
                                  for s in view.straggler_log[-10:]]},
        "memory_tier": view.memory_tier,
        "restore_tiers": view.restore_tiers,
        "resume_mismatch": view.resume_mismatch,
    }


_STRAGGLER_KEYS = ("node_id", "ranks", "excess_s", "step_time_s", "data_wait_s",
                   "peer_step_time_s", "peer_data_wait_s", "window_s", "ts", "generation")


def profile_summary(profile: dict[str, Any], generation: int) -> dict[str, Any]:
    """What ``status`` shows of a profile: how many ranks wrote, where, how big, and which
    ranks started late (the order reached them after the first step)."""
    written, ranks = profile["written"], set(profile["ranks"])
    done = set(written) | set(profile["failed"])
    state = ("written" if ranks <= set(written) else "failed" if ranks <= done
             else "abandoned" if profile["generation"] != generation else "pending")
    return {"id": profile["id"], "start_step": profile["start_step"],
            "steps": profile["steps"], "ranks": len(ranks), "written": len(written),
            "failed": {str(r): e for r, e in sorted(profile["failed"].items())[:8]},
            "state": state, "dir": profile["dir"],
            "bytes": sum(w.get("bytes") or 0 for w in written.values()),
            "late_ranks": sorted(r for r, w in written.items()
                                 if (w.get("first_step") or 0) > profile["start_step"])[:16]}


_PICTURE_KEYS = ("step", "last_grad_norm", "running_mean", "threshold", "last_param_norm",
                 "last_loss", "spikes_total", "spike_length_histogram", "longest_spike",
                 "current_spike_length", "growth_ratio", "lowest_grad_norm",
                 "loss_spikes_total", "nonfinite_total", "param_norm_jumps_total")


def stability_status(view: JobView, run: RunDir) -> dict[str, Any]:
    """The stability picture: the detectors' figures on the current lineage (rebuilt from
    ``steps.jsonl`` as the supervisor holds them), journaled events by kind, and rollbacks."""
    from orchestrator.supervisor.stability import load_lineage, run_lineage

    lineage, _ = load_lineage(run, run_lineage(run))
    summary = lineage.monitor.summary()
    picture = {k: summary.get(k) for k in _PICTURE_KEYS}
    rollbacks = [{k: r.get(k) for k in ("action", "detected_step", "onset_step", "onset_batch",
                                          "restore_step", "skip_window", "lr_scale_total",
                                          "wasted_steps", "generation")}
                 | {"event": (r.get("trigger") or {}).get("kind")} for r in view.rollbacks]
    return {**picture, "events": dict(sorted(view.stability_counts.items())),
            "updates_skipped": view.stability_counts.get("update_skipped", 0),
            "rollbacks": rollbacks, "skip_windows": view.skip_windows,
            "lr_scale": view.lr_scale}
