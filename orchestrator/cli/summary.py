"""The end-of-run summary: steps, tokens, wall time, restarts and causes, checkpoints, loss,
and where the time went (from the goodput books)."""

from __future__ import annotations

from typing import Any

from orchestrator.journal.books import Ledger
from orchestrator.journal.view import JobView
from orchestrator.contracts.rundir import RunDir


def build_summary(view: JobView, run: RunDir, ledger: Ledger | None = None) -> dict[str, Any]:
    """The summary of a run; ``ledger`` defaults to the books rebuilt from ``run``."""
    from orchestrator.journal.status import last_step_record, load_books

    last = last_step_record(run) or {}
    books = ledger or load_books(run, now=view.ended_ts or view.last_ts)
    productive = books.seconds["productive"]
    losses = sorted(((s, c) for c, s in books.badput.items() if s > 0), reverse=True)
    return {
        "state": view.state.value,
        "steps": last.get("step", view.last_step),
        "total_steps": view.total_steps,
        "tokens": last.get("tokens", view.tokens),
        "final_loss": last.get("loss"),
        "wall_time_s": round(books.total_s, 2),
        "restarts": len(view.restarts),
        "causes": view.cause_counts(),
        "checkpoints_committed": len({c["step"] for c in view.checkpoints}),
        "productive_s": round(productive, 2),
        "goodput": round(books.goodput, 4),
        "time_lost_s": round(books.total_s - productive, 2),
        "time_lost_by": {c: round(s, 2) for s, c in losses},
        "failed_reason": view.last_failure_reason,
    }
