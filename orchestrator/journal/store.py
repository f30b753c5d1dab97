"""The events journal: an append-only, fsync'd JSONL file, the job's source of truth.

Every state transition, failure, launch, checkpoint commit and node change is one typed
event (``contracts.events``). The supervisor rebuilds its state from it after a restart;
``status`` and the goodput books read it while the job runs and after it ends.

Writing is a group commit: ``append`` numbers and stamps the event, hands the line to one
writer thread and returns at once; the writer writes every line queued since its last
round in one ``write`` and one ``fsync``. A caller whose next step needs the event on disk
(a state transition, an acknowledgement an agent acts on) calls ``flush`` or awaits
``durable``. At 2,048 nodes a launch journals ~18k per-rank events: one fsync each on the
event loop was 41-81 % of the supervisor's CPU; batched, they cost one fsync per round.

Reading never fails: a torn last line (the writer killed mid-write) and any line no event
model accepts (garbled, or written by a version with another schema) are skipped and
reported once per reader with the reasons.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orchestrator.contracts import readback
from orchestrator.contracts.events import Envelope, Event, parse_event, to_line_dict
from orchestrator.contracts.readback import SkipReport

JOURNAL_NAME = "events.jsonl"


class JournalClosed(RuntimeError):
    """An append after ``close``: a bug in the caller's shutdown order."""


class Journal:
    """Appends typed events; durability by group commit (see the module docstring).

    ``clock`` returns wall-clock seconds (passed in so tests can control time).
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.Condition()
        self._seq = _last_seq(self.path)
        self._durable = self._seq
        self._queue: list[tuple[int, bytes]] = []
        self._closed = False
        self._error: BaseException | None = None
        self.batches = 0  # fsync rounds (the scale bench reads it)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._repair_torn_tail()
        self._writer = threading.Thread(target=self._write_loop, name="journal-writer",
                                        daemon=True)
        self._writer.start()

    def _repair_torn_tail(self) -> None:
        # A writer killed mid-line leaves no trailing newline; start our first event on a
        # fresh line so it is not glued onto the torn fragment.
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    # -- writing ---------------------------------------------------------------------------
    def append(self, event: Event, *, durable: bool = False) -> Envelope:
        """Number, stamp and queue ``event``; with ``durable``, return once it is on disk."""
        with self._lock:
            if self._closed:
                raise JournalClosed(f"journal {self.path} is closed")
            self._raise_writer_error()
            self._seq += 1
            seq, ts = self._seq, float(self._clock())
            line = json.dumps(to_line_dict(seq, ts, event), separators=(",", ":"),
                              allow_nan=False) + "\n"
            self._queue.append((seq, line.encode()))
            self._lock.notify_all()
        if durable:
            self.flush(seq)
        return Envelope(seq=seq, ts=ts, event=event)

    def flush(self, seq: int | None = None) -> None:
        """Block until event ``seq`` (default: every event appended so far) is on disk."""
        with self._lock:
            target = self._seq if seq is None else seq
            while self._durable < target and self._error is None:
                self._lock.wait()
            self._raise_writer_error()

    async def durable(self, seq: int | None = None) -> None:
        """``flush`` for the event loop: waits in a thread, never blocks the loop."""
        with self._lock:
            if self._durable >= (self._seq if seq is None else seq):
                return
        await asyncio.to_thread(self.flush, seq)

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise OSError(f"journal {self.path} cannot be written: {self._error}") \
                from self._error

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue and self._closed:
                    return
                batch, self._queue = self._queue, []
            try:
                os.write(self._fd, b"".join(line for _, line in batch))
                os.fsync(self._fd)
            except OSError as exc:  # disk full, I/O error: every waiter hears of it
                with self._lock:
                    self._error = exc
                    self._lock.notify_all()
                return
            with self._lock:
                self._durable = batch[-1][0]
                self.batches += 1
                self._lock.notify_all()

    def close(self) -> None:
        """Write what is queued, then close. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._writer.join()
        os.close(self._fd)
        self._fd = -1

    @property
    def seq(self) -> int:
        return self._seq

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_journal(path: str | Path, skipped: SkipReport | None = None) -> Iterator[Envelope]:
    """Every event of a journal as its type, in order; lines that do not parse (torn,
    garbled, past the reader's bounds, of no event model) are counted in ``skipped`` (when
    given) and passed over, never fatal."""
    for raw, _, number in readback.iter_lines(path, readback.JOURNAL, skipped):
        envelope, why = parse_event(raw)
        if envelope is None:
            if skipped is not None:
                skipped.add(number, why or "?")
            continue
        yield envelope


def read_events(path: str | Path, skipped: SkipReport | None = None) -> Iterator[dict[str, Any]]:
    """Every event of a journal as the JSON object of its validated type (for tools and
    tests that look at lines; folds use ``read_journal``)."""
    for env in read_journal(path, skipped):
        yield to_line_dict(env.seq, env.ts, env.event)


def _last_seq(path: Path) -> int:
    """The highest ``seq`` written so far (0 for a new journal); unreadable lines are
    passed over."""
    last = 0
    for raw, _, _ in readback.iter_lines(path, readback.JOURNAL):
        seq = raw.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool) and seq > last:
            last = seq
    return last
