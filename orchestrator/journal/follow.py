"""The one follower of a growing JSONL file (the journal, ``steps.jsonl``).

Its readers (the supervisor's books, the operator's console) each keep a
:class:`JsonlFollower` and ask it for what was appended since their last call:

- only complete lines: a last line without its newline is still being written and is read
  again, whole, at the next call (a writer that rewrites its torn tail is followed too);
- a file that does not exist yet reads as empty; one that shrank (replaced, truncated) is
  read again from its start;
- a line longer than the file's bounds (``contracts.readback``) is dropped without being
  held past that size, and counted in ``skipped`` with every other line no bounded reader
  takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.contracts import readback


class JsonlFollower:
    """The complete lines appended to ``path`` since the last call."""

    def __init__(self, path: Path, bounds: readback.Bounds = readback.JOURNAL) -> None:
        self.path = Path(path)
        self.bounds = bounds
        self.offset = 0  # the end of the last complete line read (or skipped)
        self.skipped = 0
        self._skipping = False  # inside a line already past the bounds, until its newline

    def read_raw(self) -> list[bytes]:
        """The new complete lines, not parsed (a reader with its own parser: the books).
        A line still being written is read again, whole, at the next call."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:
            self.offset, self._skipping = 0, False
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        if self._skipping:
            newline = data.find(b"\n")
            if newline < 0:
                self.offset += len(data)
                return []
            self.offset += newline + 1
            data = data[newline + 1:]
            self._skipping = False
        end = data.rfind(b"\n") + 1
        self.offset += end
        if len(data) - end > self.bounds.max_bytes:  # a torn tail already past the bounds
            self.offset += len(data) - end
            self._skipping = True
            self.skipped += 1
        return data[:end].split(b"\n")[:-1] if end else []

    def parse(self, raw: bytes) -> dict[str, Any] | None:
        """One line's JSON object within the bounds; None (counted unless blank) if not."""
        obj = parse_line(raw, self.bounds)
        if obj is None and raw.strip():
            self.skipped += 1
        return obj

    def read(self) -> list[dict[str, Any]]:
        """The new complete lines' JSON objects (lines that are not one are skipped)."""
        return [obj for raw in self.read_raw() if (obj := self.parse(raw)) is not None]


def parse_line(raw: bytes, bounds: readback.Bounds = readback.JOURNAL) -> dict[str, Any] | None:
    """One JSON object from a line, or None (blank, torn, past the bounds, not a dict)."""
    if not raw.strip():
        return None
    try:
        return readback.loads_object(raw, bounds)
    except readback.Unreadable:
        return None
