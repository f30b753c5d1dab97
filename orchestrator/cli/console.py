"""The operator's console: a job's progress and its story, read from the run directory.

Everything here reads files the supervisor already writes (the journal ``events.jsonl`` and
rank 0's ``steps.jsonl``), incrementally, and turns them into one progress line (state,
step/total, loss, tokens/s, goodput so far, ETA, checkpoint age) and short human lines for the
events an operator must see (state changes, failures, restarts, stability warnings). The same
code serves ``up`` in a terminal and ``status --watch``; it holds no supervisor object, so it
works the same for a supervisor in this process, a daemon, or a finished run.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contracts import readback
from orchestrator.journal.follow import JsonlFollower

# Tokens/s and the ETA are measured over this many recent step records (about 10-30 s of
# the CPU demo): long enough to smooth a checkpoint stall, short enough to follow a restart.
_RATE_WINDOW = 32
# A human line quotes at most this much of an error message (the journal has all of it).
_SHORT = 120


def _num(value: Any) -> float | None:
    """A finite float from a record field, or None (a boundary value is checked, not trusted)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


@dataclass
class Progress:
    """What the progress line shows; None where not known yet."""

    job: str = ""
    state: str = "PENDING"
    generation: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    steps_per_s: float | None = None
    goodput: float | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_ts: float | None = None
    restarts: int = 0

    @property
    def eta_s(self) -> float | None:
        if not self.steps_per_s or self.total_steps <= 0:
            return None
        return max(0, self.total_steps - self.step) / self.steps_per_s


@dataclass
class JobFollower:
    """Follows a run directory: ``poll()`` returns the new events since the last call and
    keeps ``progress`` current. Cheap enough to call twice a second."""

    root: Path
    progress: Progress = field(default_factory=Progress)
    _recent: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(
        maxlen=_RATE_WINDOW))

    def __post_init__(self) -> None:
        self._journal = JsonlFollower(self.root / "events.jsonl")
        self._steps = JsonlFollower(self.root / "steps.jsonl", readback.STEPS)

    @property
    def skipped_lines(self) -> int:
        return self._journal.skipped + self._steps.skipped

    def poll(self) -> list[dict[str, Any]]:
        """The journal's new events, each validated by its model (``contracts.events``) and
        given back as its line's JSON object; a line no model accepts is counted, skipped."""
        from orchestrator.contracts.events import parse_event, to_line_dict

        events = []
        for raw in self._journal.read():
            envelope, _ = parse_event(raw)
            if envelope is None:
                self._journal.skipped += 1
                continue
            events.append(to_line_dict(envelope.seq, envelope.ts, envelope.event))
        for e in events:
            self._apply_event(e)
        for rec in self._steps.read():
            self._apply_record(rec)
        return events

    def _apply_event(self, e: dict[str, Any]) -> None:
        p, kind = self.progress, e.get("kind")
        if kind == "job_created":
            p.job = str(e.get("job", ""))[:200]
            p.total_steps = _int(e.get("steps")) or p.total_steps
        elif kind == "transition" and isinstance(e.get("to"), str):
            p.state = e["to"][:40]
        elif kind == "generation_launched":
            p.generation = _int(e.get("generation")) or p.generation
            if p.generation > 1 and e.get("after_cause") not in (None, "operator"):
                p.restarts += 1
            # The new generation starts from its checkpoint: the old one's step, loss and
            # rate are not its own (they show again once its first step is recorded).
            p.step = _int(e.get("resume_step")) or 0
            p.loss = p.tokens_per_s = p.steps_per_s = None
            self._recent.clear()
        elif kind == "checkpoint_committed":
            step = _int(e.get("step"))
            if step is not None and step >= (p.last_checkpoint_step or 0):
                p.last_checkpoint_step, p.last_checkpoint_ts = step, _num(e.get("ts"))
        elif kind == "progress" and not self._stale(e):
            step = _int(e.get("step"))
            if step is not None and step > p.step:
                p.step = step

    def _stale(self, e: dict[str, Any]) -> bool:
        """From a generation older than the newest launched (read after its launch)."""
        gen = _int(e.get("generation"))
        return gen is not None and gen < self.progress.generation

    def _apply_record(self, rec: dict[str, Any]) -> None:
        p = self.progress
        step, ts, tokens = _int(rec.get("step")), _num(rec.get("ts")), _int(rec.get("tokens"))
        if step is None or self._stale(rec):
            return
        if step < p.step:  # a restart or rollback went back: the rate restarts with it
            self._recent.clear()
        p.step = step
        loss = _num(rec.get("loss"))
        p.loss = loss if loss is not None else p.loss
        if ts is None or tokens is None:
            return
        self._recent.append((ts, step, tokens))
        first, last = self._recent[0], self._recent[-1]
        dt = last[0] - first[0]
        if dt > 0 and last[1] > first[1]:
            p.steps_per_s = (last[1] - first[1]) / dt
            p.tokens_per_s = (last[2] - first[2]) / dt


# -- rendering -------------------------------------------------------------------------------

def fmt_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_rate(per_s: float | None) -> str:
    if per_s is None:
        return "-"
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f}M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.1f}k"
    return f"{per_s:.0f}"


def progress_line(p: Progress, now: float) -> str:
    """One line: ``RUNNING  step 120/600 (20%)  loss 2.4512  18.4k tok/s  goodput 81%
    ETA 4m10s  ckpt 100 (12s ago)``."""
    pct = f" ({p.step / p.total_steps:.0%})" if p.total_steps else ""
    parts = [f"{p.state:<12}", f"step {p.step}/{p.total_steps or '?'}{pct}"]
    if p.generation > 1:
        parts.append(f"gen {p.generation}")
    parts.append("loss " + ("-" if p.loss is None else f"{p.loss:.4f}"))
    parts.append(f"{fmt_rate(p.tokens_per_s)} tok/s")
    parts.append("goodput " + ("-" if p.goodput is None else f"{p.goodput:.0%}"))
    parts.append(f"ETA {fmt_duration(p.eta_s)}" if p.state == "RUNNING" else "ETA -")
    if p.last_checkpoint_step is None:
        parts.append("ckpt none yet")
    else:
        age = None if p.last_checkpoint_ts is None else now - p.last_checkpoint_ts
        parts.append(f"ckpt {p.last_checkpoint_step} ({fmt_duration(age)} ago)")
    return "  ".join(parts)


# What a stability event means and what an operator can do about it, by detector kind.
STABILITY_ADVICE: dict[str, tuple[str, str]] = {
    "grad_spike": ("the gradient norm jumped above its running mean's threshold",
                   "one spike is harmless; many in a row mean the LR is too high or a batch is "
                   "bad. Tune with `orchestrator stability replay RUN_DIR/steps.jsonl`"),
    "persistent_spike": ("the gradient norm stayed above its threshold for several steps",
                         "training may be diverging: lower the LR or set the rule's action to "
                         "rollback"),
    "growth": ("the gradient norm grew far above the lowest value seen in this run",
               "a slow climb warns of divergence; if the loss still falls it is drift: raise "
               "stability.growth.ratio after replaying the run"),
    "nonfinite": ("the loss or gradient norm was NaN or infinite",
                  "the update is lost; check the data at this step and the LR, or set the "
                  "rule's action to skip_step or rollback"),
    "loss_spike": ("the loss jumped above its recent level",
                   "look at the batch at this step; repeated loss spikes call for a lower LR"),
    "param_norm_jump": ("the parameter norm moved more than its limit in one step",
                        "an update this large usually follows a gradient spike; see the grad "
                        "norm at this step"),
    "update_skipped": ("the workers skipped this optimizer update",
                       "the guard did its job; frequent skips mean the LR is too high"),
}


def _figures(e: dict[str, Any]) -> str:
    keys = ("g", "r", "threshold", "ratio", "lowest", "length", "loss")
    shown = []
    for k in keys:
        v = _num(e.get(k))
        if v is not None:
            shown.append(f"{k} {v:.4g}")
    return ", ".join(shown)


def describe(e: dict[str, Any], *, verbose: bool = False) -> tuple[str, str] | None:
    """A short human line for a journal event and its level ("info", "warning", "error"),
    or None for the events only ``--verbose`` (or nobody) needs on the console."""
    kind = e.get("kind")
    # A field a line leaves out (or null) reads "?": never Python's None.
    text = lambda key: "?" if e.get(key) is None else str(e[key])[:300]
    if kind == "transition":
        to, cause, reason = text("to"), e.get("cause"), e.get("reason")
        tail = "".join([f" ({cause})" if cause and cause != "completed" else "",
                        f": {str(reason)[:300]}" if reason else ""])
        level = "error" if to == "FAILED" else "warning" if to == "STOPPING" else "info"
        return level, f"job {text('from')} -> {to}{tail}"
    if kind == "failure":
        where = " ".join(x for x in (f"rank {e['rank']}" if _int(e.get("rank")) is not None
                                     else "", f"on {text('node_id')}" if e.get("node_id")
                                     else "") if x)
        gen = _int(e.get("generation"))
        what = f"generation {gen} failed" if gen is not None else "the job cannot start"
        return "error", (f"{what}: {text('cause')}"
                         f"{' ' + where if where else ''}: {text('message')}")
    if kind == "generation_launched":
        gen = _int(e.get("generation")) or 0
        resume = _int(e.get("resume_step"))
        start = f"from checkpoint {resume}" if resume else "from scratch"
        after = e.get("after_cause")
        if gen > 1 and after == "operator":
            return "info", f"continued: generation {gen} launched {start} after the stop"
        if gen > 1 and isinstance(after, str) and after:
            return "warning", (f"restart: generation {gen} launched {start} after "
                               f"{after[:40]}")
        return "info", f"generation {gen} launched {start}"
    if kind == "stability":
        ev = text("event")
        if ev == "grad_spike_end" and not verbose:
            return None
        meaning, todo = STABILITY_ADVICE.get(ev, ("a stability rule fired", "see "
                                                   "`orchestrator status` for the picture"))
        figures = _figures(e)
        return "warning", (f"stability: {ev} at step {text('step')} ({figures}; action "
                           f"{text('action')}): {meaning}. What to do: {todo}")
    if kind == "rollback":
        return "warning", (f"rollback: restoring checkpoint {text('restore_step')}, onset "
                           f"step {text('onset_step')}, skipping batches "
                           f"{e.get('skip_window') or 'none'}")
    if kind == "node_state" and e.get("state") in ("lost", "excluded", "failed"):
        return "warning", (f"node {text('node_id')} {text('state')}"
                           + (f": {text('reason')}" if e.get("reason") else ""))
    if kind == "resume_mismatch":
        return "warning", f"generation {text('generation')}: {text('message')}"
    if kind in ("checkpoint_failed", "checkpoint_skipped"):
        why = (text("reason") or text("error")).strip().splitlines()
        why_short = why[0][:_SHORT] + ("..." if len(why[0]) > _SHORT or len(why) > 1 else "") \
            if why else "no reason given"
        return "warning", f"{kind.replace('_', ' ')} at step {text('step')}: {why_short}"
    if verbose and kind == "checkpoint_committed":
        return "info", f"checkpoint {text('step')} committed ({text('tier') or 'local'})"
    if verbose and kind == "supervisor_started":
        return "info", f"supervisor started (pid {text('pid')}, {text('url')})"
    return None
