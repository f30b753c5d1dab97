"""Run the detectors over recorded steps: the engine behind ``orchestrator stability replay``.

Replaying a run's step records with another config answers "what would these thresholds have
done on that run" before anyone changes a live job.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from stability.config import StabilityConfig
from stability.events import Event
from stability.monitor import StabilityMonitor
from stability.records import StepRecord


def replay(
    records: Iterable[dict[str, Any] | StepRecord], config: StabilityConfig
) -> Iterator[Event]:
    """The events a fresh ``StabilityMonitor(config)`` emits over ``records``, in order."""
    monitor = StabilityMonitor(config)
    for record in records:
        rec = record if isinstance(record, StepRecord) else StepRecord.from_dict(record)
        yield from monitor.update(rec)


def read_jsonl(path_or_lines: str | os.PathLike[str] | Iterable[str]) -> Iterator[StepRecord]:
    """Step records from a JSONL file (a ``str`` or path-like is a path) or from lines.

    Blank lines are skipped. A line that is not JSON, not an object, or not a valid record raises
    ValueError naming its 1-based line number (and the file, when reading one).
    """
    if isinstance(path_or_lines, str | os.PathLike):
        path = os.fspath(path_or_lines)
        with open(path, encoding="utf-8") as lines:
            yield from _parse(lines, f"{path}:")
    else:
        yield from _parse(path_or_lines, "")


def _parse(lines: Iterable[str], where: str) -> Iterator[StepRecord]:
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}line {lineno}: invalid JSON: {exc.msg}") from None
        except (ValueError, RecursionError) as exc:  # 5,000 digits; 100,000 nested [
            raise ValueError(f"{where}line {lineno}: invalid JSON: {str(exc)[:100]}") from None
        try:
            record = StepRecord.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{where}line {lineno}: {exc}") from None
        yield record
