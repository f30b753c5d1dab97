"""Uptime accounting: every second of a job's wall time booked to productive or one badput.

The books are a pure function of the journal (supervisor clock) and rank 0's step records
(worker clock, ``steps.jsonl``), so the live supervisor, a restarted one and ``orchestrator
status`` all get the same answer. ``Books`` folds both streams incrementally; ``snapshot``
costs O(transitions + generations) and no scan of the steps, so it can run every few seconds.

The timeline rules (each second gets exactly one category; categories sum to wall time):

1. The job's wall time is ``[job_created, end)``: ``end`` is the terminal transition, or
   ``now`` while the job is live.
2. The journal's transitions cut it into state segments. A *generation window* runs from a
   transition into LAUNCHING to the next transition out of LAUNCHING/RUNNING (a supervisor
   restart that adopts the running generation leaves its window open). Outside windows:
   PENDING is ``provisioning``; HEALTH_CHECK is ``provisioning`` while fewer usable nodes are
   registered than the job needs (waiting for machines) and ``health_check`` otherwise;
   STOPPING and RECOVERING are ``recovery`` (stop, backoff), except a stop the operator asked
   for, which is ``other``.
3. Inside a window, rank 0's step end times ``ts`` (clamped into the window and made
   non-decreasing) cut it further. Launch to the end of the generation's first step is
   ``startup`` (process start, imports, compilation, the first step), less the ``load_s`` of
   the generation's ``resumed`` event, which is ``checkpoint_restore``. Each later interval
   ``(ts[i-1], ts[i]]`` belongs to step i: its ``data_s`` is ``data_loading``, its
   ``ckpt_block_s`` ``checkpoint_save`` (each capped at what is left of the interval), the
   rest ``productive``.
4. Wasted progress: a run is a stretch of strictly increasing steps (a generation, or its
   part after an in-process rollback). Each run has a resume point P: the lowest step any
   later run or generation resumed from (first step - 1, else the ``resumed`` event's step,
   else the launch's ``resume_step``). Steps above P were redone, so their whole intervals
   are ``wasted_progress``. The last run of a generation that failed or was stopped, with
   nothing launched after it, uses the newest committed checkpoint (its steps beyond it are
   lost), and that of a completed or still running generation has no P.
5. After the last step of a window: when it ends by failure, up to the first failing rank's
   exit (agent clock) is ``wasted_progress`` (the step in flight; ``startup`` if there was no
   step yet) and from there to the stop decision ``failure_detection``; a completed job, a
   last step that was the job's final one and an operator stop give ``other`` (shutdown).
   While the window is live, the time since the last step is provisionally ``productive``
   up to the generation's longest step interval and ``failure_detection`` beyond it (nothing
   has finished for longer than any step took); the next step or the stop re-books it.
6. A supervisor gap (from the last event before a ``supervisor_started`` with ``resumed`` to
   that event) keeps what the workers' records prove (steps, startup); time the journal's
   states or a failure tail would have booked is ``other``: nothing watched the job then.

Provisional time (rules 4 and 5 for a live job) can move between categories later; the
Prometheus counters never go down, so a category whose books shrank holds its counter until
the books pass it again (see ``SupervisorMetrics.set_books``).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.contracts import events as ev
from orchestrator.contracts.events import Envelope, as_envelope

BADPUT_CATEGORIES = (
    "provisioning", "health_check", "startup", "checkpoint_save", "checkpoint_restore",
    "wasted_progress", "failure_detection", "recovery", "data_loading", "other",
)
CATEGORIES = ("productive", *BADPUT_CATEGORIES)
_TERMINAL = ("COMPLETED", "FAILED", "STOPPED")
_WINDOW_STATES = ("LAUNCHING", "RUNNING")
_USABLE = ("registered", "active", "spare")
# Categories that come from the journal's states rather than the workers' own records:
# inside a supervisor gap nobody was watching, so they become ``other`` (rule 6).
_WATCHED = ("provisioning", "health_check", "recovery", "failure_detection")


@dataclass(frozen=True)
class Ledger:
    """The books at one instant: seconds per category, their total, and goodput."""

    seconds: dict[str, float]
    total_s: float
    goodput: float

    def to_json(self, digits: int = 3) -> dict[str, Any]:
        return {"goodput": round(self.goodput, 6), "total_s": round(self.total_s, digits),
                "seconds": {k: round(v, digits) for k, v in self.seconds.items()}}

    @property
    def badput(self) -> dict[str, float]:
        return {k: v for k, v in self.seconds.items() if k != "productive"}


@dataclass
class _Gen:
    """One generation: its launch facts and rank 0's records as prefix sums."""

    number: int
    window_start: float | None = None
    launch_resume: int | None = None
    launched: bool = False
    resumed_step: int | None = None
    load_s: float = 0.0
    exit_ts: float | None = None
    failure_ckpt: int | None = None
    ts: array = field(default_factory=lambda: array("d"))
    step: array = field(default_factory=lambda: array("q"))
    # s_x[i]: sum of part x over the intervals ending at records 1..i (s_x[0] = 0).
    s_tot: array = field(default_factory=lambda: array("d"))
    s_ck: array = field(default_factory=lambda: array("d"))
    s_dl: array = field(default_factory=lambda: array("d"))
    run_starts: list[int] = field(default_factory=list)
    max_interval: float = 0.0
    first_step_time: float = 0.0
    last_raw: tuple[int, float] | None = None

    def add(self, step: int, ts: float, data_s: float, ckpt_s: float, step_time: float) -> None:
        if (step, ts) == self.last_raw:
            return  # the same record delivered twice (a heartbeat resent)
        self.last_raw = (step, ts)
        n = len(self.ts)
        floor = self.ts[-1] if n else (self.window_start or ts)
        ts = max(ts, floor)
        if n == 0:
            self.run_starts.append(0)
            self.first_step_time = max(step_time, 0.0)
            tot = ck = dl = 0.0
        else:
            if step <= self.step[-1]:
                self.run_starts.append(n)  # steps went back: an in-process rollback
            tot = ts - self.ts[-1]
            dl = min(max(data_s, 0.0), tot)
            ck = min(max(ckpt_s, 0.0), tot - dl)
            self.max_interval = max(self.max_interval, tot)
        self.ts.append(ts)
        self.step.append(step)
        base = (self.s_tot[-1], self.s_ck[-1], self.s_dl[-1]) if n else (0.0, 0.0, 0.0)
        self.s_tot.append(base[0] + tot)
        self.s_ck.append(base[1] + ck)
        self.s_dl.append(base[2] + dl)

    def resume_estimate(self) -> int | None:
        """Where this generation's work began: the step it resumed from."""
        if len(self.step):
            return int(self.step[0]) - 1
        if self.resumed_step is not None:
            return self.resumed_step
        if self.launched:
            return self.launch_resume or 0
        return None


@dataclass
class _Window:
    start: float
    gen: int | None = None
    end: float | None = None
    close_state: str | None = None
    close_cause: str | None = None


class Books:
    """Folds journal events (``apply``) and step records (``add_record``); ``snapshot``.

    Events must be applied in journal order; a generation's records after its
    ``generation_launched`` event (they are written after it, so reading the journal first
    guarantees this).
    """

    def __init__(self) -> None:
        self.created_ts: float | None = None
        self.end_ts: float | None = None
        self.total_steps = 0
        self.nodes_needed = 0
        self.last_ts: float | None = None
        self.transitions: list[tuple[float, str, str | None]] = []
        self.windows: list[_Window] = []
        self.gens: dict[int, _Gen] = {}
        self.gaps: list[tuple[float, float]] = []
        self.short: list[list[float | None]] = []  # [start, end|None]: short of nodes
        self.node_state: dict[str, str] = {}
        self.newest_ckpt = 0
        self.paused: list[tuple[float, float]] = []  # STOPPED until continued

    # -- folding -------------------------------------------------------------------------
    def apply(self, env: Envelope | dict[str, Any]) -> None:
        """Fold one event (a raw dict, a test's or a tool's, is parsed first; one that does
        not parse is skipped as the journal reader would)."""
        parsed = as_envelope(env)
        if parsed is None:
            return
        env = parsed
        e, ts = env.event, env.ts
        if isinstance(e, ev.JobCreated):
            self.created_ts = ts
            self.total_steps = e.steps
            self.nodes_needed = e.nodes
            self._nodes_changed(ts)
        elif isinstance(e, ev.SupervisorStarted) and e.resumed and self.last_ts is not None:
            self.gaps.append((self.last_ts, ts))
        elif isinstance(e, ev.Transition):
            self._on_transition(ts, e.to.value, e.cause.value if e.cause else None)
        elif isinstance(e, ev.GenerationLaunched):
            gen = self._gen(e.generation)
            gen.launched, gen.launch_resume = True, e.resume_step
            if not self.windows or self.windows[-1].end is not None:
                self.windows.append(_Window(ts))  # a journal without the LAUNCHING move
            self.windows[-1].gen = gen.number
            gen.window_start = self.windows[-1].start
        elif isinstance(e, ev.WorkerNote) and e.kind == "resumed" and e.generation is not None:
            gen = self._gen(e.generation)
            gen.resumed_step = e.step or 0
            gen.load_s = e.load_s or 0.0
        elif isinstance(e, ev.RankExited) and (e.exit_code or e.signal) \
                and self._window_open_for(e.generation):
            # Exits after the stop decision are our own SIGTERMs, not the failure.
            self._on_failing_exit(e.generation, e.exit_ts if e.exit_ts is not None else ts)
        elif isinstance(e, ev.RanksExited) and self._window_open_for(e.generation):
            for x in e.exits:  # a node's exits journaled together: the same rule per rank
                if x.exit_code or x.signal:
                    self._on_failing_exit(e.generation, x.exit_ts if x.exit_ts is not None
                                          else ts)
        elif isinstance(e, ev.Failure) and e.generation is not None:
            self._gen(e.generation).failure_ckpt = e.newest_checkpoint_step or 0
        elif isinstance(e, ev.CheckpointCommitted):
            self.newest_ckpt = e.step
        elif isinstance(e, ev.NodeRegistered):
            # As the node registry does: a lost or exited agent that comes back is usable
            # again; an excluded node stays out.
            if self.node_state.get(e.node_id) in (None, "lost", "exited"):
                self.node_state[e.node_id] = "registered"
            self._nodes_changed(ts)
        elif isinstance(e, ev.NodeStateChanged):
            self.node_state[e.node_id] = e.state.value
            self._nodes_changed(ts)
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)

    def _on_transition(self, ts: float, to: str, cause: str | None) -> None:
        if to == "PENDING" and self.end_ts is not None:
            # A stopped job continued (up --resume): the time it stood stopped is nobody's
            # cluster time, booked to no category and left out of the total.
            self.paused.append((self.end_ts, ts))
            self.end_ts = None
        self.transitions.append((ts, to, cause))
        open_window = self.windows[-1] if self.windows and self.windows[-1].end is None \
            else None
        if to == "LAUNCHING" and open_window is None:
            self.windows.append(_Window(ts))
        elif to not in _WINDOW_STATES and open_window is not None:
            open_window.end, open_window.close_state = ts, to
            open_window.close_cause = cause
        if to in _TERMINAL:
            self.end_ts = ts

    def _on_failing_exit(self, generation: int, exit_ts: float) -> None:
        gen = self._gen(generation)
        gen.exit_ts = exit_ts if gen.exit_ts is None else min(gen.exit_ts, exit_ts)

    def _window_open_for(self, generation: Any) -> bool:
        w = self.windows[-1] if self.windows else None
        return w is not None and w.end is None and generation is not None \
            and w.gen == int(generation)

    def _nodes_changed(self, ts: float) -> None:
        short = sum(s in _USABLE for s in self.node_state.values()) < self.nodes_needed
        is_open = bool(self.short) and self.short[-1][1] is None
        if short and not is_open:
            self.short.append([ts, None])
        elif not short and is_open:
            self.short[-1][1] = ts

    def add_record(self, rec: dict[str, Any]) -> None:
        """One of rank 0's step records (``generation``, ``step``, ``ts``, ...)."""
        try:
            gen = self._gen(int(rec["generation"]))
            step, ts = int(rec["step"]), float(rec["ts"])
        except (KeyError, TypeError, ValueError):
            return
        gen.add(step, ts, _num(rec.get("data_s")), _num(rec.get("ckpt_block_s")),
                _num(rec.get("step_time")))

    def _gen(self, number: int) -> _Gen:
        gen = self.gens.get(number)
        if gen is None:
            gen = self.gens[number] = _Gen(number)
        return gen

    # -- the books at one instant ---------------------------------------------------------
    def snapshot(self, now: float) -> Ledger:
        """The books at ``now`` (ignored once the job reached a terminal state)."""
        seconds = dict.fromkeys(CATEGORIES, 0.0)
        if self.created_ts is None:
            return Ledger(seconds, 0.0, 0.0)
        end = self.end_ts if self.end_ts is not None else max(now, self.created_ts)
        book = _Booker(seconds, self.gaps)
        self._book_states(book, end)
        resume_points = self._resume_points()
        for w in self.windows:
            self._book_window(book, w, min(w.end if w.end is not None else end, end),
                              resume_points)
        total = end - self.created_ts - sum(b - a for a, b in self.paused if b <= end)
        goodput = seconds["productive"] / total if total > 0 else 0.0
        return Ledger(seconds, total, goodput)

    def _book_states(self, book: _Booker, end: float) -> None:
        start, state, cause = self.created_ts, "PENDING", None
        assert start is not None
        for ts, to, to_cause in [*self.transitions, (end, "", None)]:
            ts = min(ts, end)
            if ts > start:
                if state == "PENDING":
                    book.add("provisioning", start, ts)
                elif state == "HEALTH_CHECK":
                    for lo, hi, short in _pieces(start, ts, self.short, end):
                        book.add("provisioning" if short else "health_check", lo, hi)
                elif state == "STOPPING" and cause == "operator":
                    book.add("other", start, ts)
                elif state in ("STOPPING", "RECOVERING"):
                    book.add("recovery", start, ts)
            if ts >= end:
                break
            start, state, cause = ts, to, to_cause

    def _resume_points(self) -> dict[tuple[int, int], float]:
        """P for every run, keyed by (generation, run index); rule 4."""
        order = sorted(self.gens)
        entries: list[tuple[tuple[int, int] | None, int | None]] = []
        for number in order:
            gen = self.gens[number]
            entries.append((None, gen.resume_estimate()))
            for r, start in enumerate(gen.run_starts):
                if r > 0:
                    entries.append((None, int(gen.step[start]) - 1))
                entries.append(((number, r), None))
        points: dict[tuple[int, int], float] = {}
        later = float("inf")
        last_run = True
        for key, estimate in reversed(entries):
            if key is None:
                if estimate is not None:
                    later = min(later, estimate)
                    last_run = False
                continue
            points[key] = self._terminal_point(key[0]) if last_run else later
        return points

    def _terminal_point(self, number: int) -> float:
        window = next((w for w in self.windows if w.gen == number), None)
        if window is None or window.end is None or window.close_state == "COMPLETED":
            return float("inf")
        failure = self.gens[number].failure_ckpt
        return float(failure if failure is not None else self.newest_ckpt)

    def _book_window(self, book: _Booker, w: _Window, we: float,
                     points: dict[tuple[int, int], float]) -> None:
        ws = w.start
        if we <= ws:
            return
        gen = self.gens.get(w.gen) if w.gen is not None else None
        k = bisect.bisect_right(gen.ts, we) if gen is not None else 0
        if gen is None or k == 0:  # no step yet: startup until a failure, if one ended it
            last = we
            if _failed(w):
                last = _clip(gen.exit_ts if gen and gen.exit_ts is not None else ws, ws, we)
            self._book_startup(book, gen, ws, last)
            book.add("failure_detection", last, we)
            return
        self._book_startup(book, gen, ws, gen.ts[0])
        self._book_steps(book, gen, k, points)
        self._book_tail(book, w, gen, gen.ts[k - 1], int(gen.step[k - 1]), we)

    @staticmethod
    def _book_startup(book: _Booker, gen: _Gen | None, a: float, b: float) -> None:
        span = max(b - a, 0.0)
        restore = min(gen.load_s, span) if gen is not None else 0.0
        book.add_seconds("checkpoint_restore", restore)
        book.add_seconds("startup", span - restore)

    def _book_steps(self, book: _Booker, gen: _Gen, k: int,
                    points: dict[tuple[int, int], float]) -> None:
        tot, ck, dl = gen.s_tot[k - 1], gen.s_ck[k - 1], gen.s_dl[k - 1]
        w_tot = w_ck = w_dl = 0.0
        bounds = [*gen.run_starts, len(gen.ts)]
        for r in range(len(gen.run_starts)):
            s, e = bounds[r], min(bounds[r + 1], k)
            p = points.get((gen.number, r), float("inf"))
            if s >= e or p == float("inf"):
                continue
            j = max(bisect.bisect_right(gen.step, p, s, e), 1)
            if j < e:
                w_tot += gen.s_tot[e - 1] - gen.s_tot[j - 1]
                w_ck += gen.s_ck[e - 1] - gen.s_ck[j - 1]
                w_dl += gen.s_dl[e - 1] - gen.s_dl[j - 1]
        book.add_seconds("wasted_progress", w_tot)
        book.add_seconds("checkpoint_save", ck - w_ck)
        book.add_seconds("data_loading", dl - w_dl)
        book.add_seconds("productive", (tot - w_tot) - (ck - w_ck) - (dl - w_dl))

    def _book_tail(self, book: _Booker, w: _Window, gen: _Gen, last: float, last_step: int,
                   we: float) -> None:
        finished = self.total_steps and last_step >= self.total_steps
        if w.end is not None and not _failed(w) or finished:
            book.add("other", last, we)
        elif w.end is None:  # live: the step in flight, provisionally (rule 5)
            expected = gen.max_interval or gen.first_step_time
            cut = min(last + expected, we)
            book.add("productive", last, cut)
            book.add("failure_detection", cut, we)
        else:
            crash = _clip(gen.exit_ts if gen.exit_ts is not None else last, last, we)
            book.add("wasted_progress", last, crash)
            book.add("failure_detection", crash, we)


class _Booker:
    """Adds seconds to categories, turning watched-only time inside supervisor gaps into
    ``other`` (rule 6)."""

    def __init__(self, seconds: dict[str, float], gaps: list[tuple[float, float]]) -> None:
        self.seconds = seconds
        self.gaps = gaps

    def add(self, category: str, a: float, b: float) -> None:
        """Book the span ``[a, b)``."""
        if b <= a:
            return
        if category in _WATCHED and self.gaps:
            unwatched = _overlap(a, b, self.gaps, b)
            self.seconds["other"] += unwatched
            self.seconds[category] += (b - a) - unwatched
        else:
            self.seconds[category] += b - a

    def add_seconds(self, category: str, amount: float) -> None:
        """Book an amount measured by the workers (evidence: never re-booked by gaps)."""
        self.seconds[category] += max(amount, 0.0)


def _pieces(a: float, b: float, intervals: Iterable[Any],
            open_end: float) -> list[tuple[float, float, bool]]:
    """``[a, b)`` cut at the edges of ``intervals``: (lo, hi, inside) pieces in order."""
    cuts = {a, b}
    spans = [(lo, open_end if hi is None else hi) for lo, hi in intervals]
    for lo, hi in spans:
        cuts.update(x for x in (lo, hi) if a < x < b)
    edges = sorted(cuts)
    return [(lo, hi, any(s <= lo and hi <= e for s, e in spans))
            for lo, hi in zip(edges, edges[1:], strict=False) if hi > lo]


def _overlap(a: float, b: float, intervals: Iterable[Any], open_end: float) -> float:
    """Seconds of ``[a, b)`` inside the union of ``intervals`` (end None = still open)."""
    return sum(hi - lo for lo, hi, inside in _pieces(a, b, intervals, open_end) if inside)


def _failed(w: _Window) -> bool:
    """The window was closed by a failure (not completion, not the operator)."""
    return w.end is not None and w.close_state != "COMPLETED" and w.close_cause != "operator"


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return f if f == f else 0.0


def compute_books(events: Iterable[Envelope | dict[str, Any]],
                  records: Iterable[dict[str, Any]], now: float) -> Ledger:
    """The books of a journal and its step records at ``now`` (one pass over each). Raw
    dicts (tests, tools) are parsed first; one that does not parse is skipped."""
    books = Books()
    for e in events:
        books.apply(e)
    for rec in records:
        books.add_record(rec)
    return books.snapshot(now)
