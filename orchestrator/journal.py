"""The events journal: an append-only, fsync'd JSONL file, the job's source of truth.

Every state transition, failure, launch, checkpoint commit and node change is one line.
The supervisor rebuilds its state from it after a restart; ``status`` and the goodput books
read it while the job runs and after it ends. A torn last line (the writer killed mid-write)
is skipped by the reader, never fatal.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

JOURNAL_NAME = "events.jsonl"


class Journal:
    """Appends events; each ``append`` is durable (fsync) before it returns.

    ``clock`` returns wall-clock seconds (passed in so tests can control time).
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = sum(1 for _ in read_events(self.path)) if self.path.exists() else 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._repair_torn_tail()

    def _repair_torn_tail(self) -> None:
        # A writer killed mid-line leaves no trailing newline; start our first event on a
        # fresh line so it is not glued onto the torn fragment.
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one event ``{"seq", "ts", "kind", **fields}`` and fsync it; return it."""
        with self._lock:
            self._seq += 1
            event = {"seq": self._seq, "ts": fields.pop("ts", None) or self._clock(),
                     "kind": kind, **fields}
            line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
            os.write(self._fd, line.encode())
            os.fsync(self._fd)
            return event

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every complete event of a journal, in order; torn or garbled lines are skipped."""
    p = Path(path)
    if not p.exists():
        return
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and "kind" in event:
                yield event
