"""The supervisor's side of the books: follow the run directory's files, export the ledger.

The books (``orchestrator.journal.books``) are rebuilt from the journal and ``steps.jsonl``, never
from the supervisor's memory, so a restarted supervisor gets the same books as the one that
died. ``BookKeeper`` follows both files from where it last stopped reading (each line is read
once), so a refresh costs only the new lines plus a snapshot.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from orchestrator.contracts import readback
from orchestrator.journal.books import Books, Ledger
from orchestrator.journal.follow import JsonlFollower
from orchestrator.clock import Clock
from orchestrator.contracts.events import Envelope, parse_event
from orchestrator.logs import get_logger
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.steprecord import StepRecord, parse_stored_line
from orchestrator.supervisor.metrics import SupervisorMetrics

# How often the live books are refreshed: well under the usual 15 s scrape interval, and a
# snapshot costs microseconds, so freshness is nearly free.
REFRESH_S = 2.0
# Lines folded between two turns of the loop by the periodic refresh.
FOLD_CHUNK = 200


class BookKeeper:
    """Follows the journal and the step records into ``Books``; pushes ledgers to metrics."""

    def __init__(self, run: RunDir, metrics: SupervisorMetrics, clock: Clock) -> None:
        """Read everything written so far, and replay it into ``metrics`` too.

        A restarted supervisor's counters then carry on from the values the dead one
        exported (Prometheus sees no reset, so ``increase()`` does not count the past twice)
        and its gauges and histograms come back before the first scrape. Later lines are
        not replayed: the supervisor feeds the metrics as it writes and receives them.
        """
        self.books = Books()
        self.metrics = metrics
        self.clock = clock
        self._journal = JsonlFollower(run.journal)
        self._steps = JsonlFollower(run.steps, readback.STEPS)
        # Lines read but not yet folded (``refresh_in_chunks`` folds them a chunk at a time).
        self._backlog: deque[tuple[str, bytes]] = deque()
        # Books as of the journal's last event, not now: the time since is a supervisor gap
        # that only the coming supervisor_started event (and the records the agents kept)
        # can book; guessing it now could push a counter past what it will be.
        self.ledger = self.refresh(on_event=metrics.on_event, on_record=metrics.on_record,
                                   at_last_event=True)

    def refresh(self, on_event: Callable[[Envelope], None] | None = None,
                on_record: Callable[[StepRecord], None] | None = None,
                at_last_event: bool = False) -> Ledger:
        """Fold the new lines (journal first: a generation's launch precedes its records),
        snapshot at now, and bring the metrics' counters up to the books."""
        self._read()
        self._fold(len(self._backlog), on_event, on_record)
        return self._snapshot(at_last_event)

    async def refresh_in_chunks(self, chunk: int = FOLD_CHUNK) -> Ledger:
        """``refresh`` for the periodic task: the new lines are folded ``chunk`` at a time,
        letting the loop serve what waits in between. A stop of 2,048 nodes appends
        ~4,000 lines and a launch one of ~2 MB; parsed in one go (typed, as every journal
        read), they held the loop 0.1-0.3 s with every heartbeat waiting. A ``refresh``
        that runs meanwhile (a status request) folds what is left first: lines are folded
        once, in order, by whichever gets there."""
        self._read()
        while self._backlog:
            self._fold(chunk, None, None)
            if self._backlog:
                await asyncio.sleep(0)
        return self._snapshot(False)

    def _read(self) -> None:
        self._backlog.extend(("journal", raw) for raw in self._journal.read_raw())
        self._backlog.extend(("steps", raw) for raw in self._steps.read_raw())

    def _fold(self, count: int, on_event: Callable[[Envelope], None] | None,
              on_record: Callable[[StepRecord], None] | None) -> None:
        backlog = self._backlog
        for _ in range(min(count, len(backlog))):
            source, line = backlog.popleft()
            if source == "steps":
                stored = parse_stored_line(line)
                if stored is None:
                    continue
                generation, rec = stored
                self.books.add_record({**rec, "generation": generation})
                if on_record is not None:
                    on_record(rec)
                continue
            raw = self._journal.parse(line)
            if raw is None:
                continue
            event, _ = parse_event(raw)
            if event is None:  # the journal's readers report such lines; books skip them
                continue
            self.books.apply(event)
            if on_event is not None:
                on_event(event)

    def _snapshot(self, at_last_event: bool) -> Ledger:
        now = self.clock.time()
        if at_last_event and self.books.last_ts is not None:
            now = min(now, self.books.last_ts)
        self.ledger = self.books.snapshot(now)
        windows = self.books.windows
        live = bool(windows) and windows[-1].end is None
        self.metrics.set_books(self.ledger.seconds, self.ledger.goodput,
                               hold=("failure_detection",) if live else ())
        return self.ledger

    async def run(self, every_s: float = REFRESH_S) -> None:
        """Refresh every ``every_s`` until cancelled."""
        log = get_logger("orchestrator.journal.books")
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.refresh_in_chunks()
            except Exception:  # a bug in the books must not stop the job; say it each time
                log.exception("refreshing the books failed")
