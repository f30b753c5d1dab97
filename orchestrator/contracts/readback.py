"""Reading back what we wrote: one bounded JSON reader for every file a job reads again.

The journal (``events.jsonl``), rank 0's step records (``steps.jsonl``), checkpoint and
memory-tier manifests, the stability cache and ``supervisor.json`` are written by us, but read
back from a disk that a crash may have torn and anyone who can write the run directory or the
checkpoint store may have edited. Every such read goes through here, with bounds on what a
value may be:

- a document's size in bytes (a JSONL file: each line's);
- the nesting depth (Python's parser recurses: 100,000 nested ``[`` raised RecursionError in a
  reader that only caught ``JSONDecodeError``);
- the digits of an integer (Python refuses to convert past 4,300 digits with a ValueError, and
  a 4,000-digit one that converts breaks every bound downstream);
- non-finite numbers (``NaN``, ``Infinity``, ``1e999``), refused unless the file's format
  allows them (``steps.jsonl`` carries a NaN loss as the ``NaN`` token);
- valid UTF-8.

What breaks a bound raises ``Unreadable`` (a ValueError naming the problem), never anything
else; the JSONL reader skips such a line and counts it in a ``SkipReport``, which the caller
reports once. A reader that knows the type of what it read parses it into that type next.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Unreadable(ValueError):
    """A document or line that is not one we could have written (the message says why)."""


@dataclass(frozen=True)
class Bounds:
    """What a document of one kind may be."""

    max_bytes: int
    max_depth: int = 32
    # Our largest integers are counts below 2**62 (19 digits).
    max_int_digits: int = 24
    allow_nan: bool = False


# A journal line holds one event; the largest (a launch record of 2,048 nodes) is ~2 MB.
JOURNAL = Bounds(max_bytes=16 * 2**20, max_depth=16)
# A step record: a few dozen scalars.
STEPS = Bounds(max_bytes=64 * 2**10, max_depth=4, allow_nan=True)
# A checkpoint manifest: a file entry per DCP file (thousands at scale).
MANIFEST = Bounds(max_bytes=256 * 2**20, max_depth=16)
# A memory-tier manifest: a segment per tensor.
MEMORY_MANIFEST = Bounds(max_bytes=16 * 2**20, max_depth=8)
# Small state files of the run directory (the stability cache, supervisor.json).
SMALL = Bounds(max_bytes=16 * 2**20, max_depth=32)


@dataclass
class SkipReport:
    """What a reader passed over: how many lines and the first few reasons."""

    lines: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, where: int, why: str) -> None:
        self.lines += 1
        if len(self.reasons) < 20:
            self.reasons.append(f"line {where}: {why}")


def _int_parser(bounds: Bounds) -> Any:
    limit = bounds.max_int_digits

    def parse_int(text: str) -> int:
        if len(text.lstrip("-")) > limit:
            raise Unreadable(f"an integer of {len(text.lstrip('-'))} digits (at most {limit})")
        return int(text)
    return parse_int


def _float_parser(bounds: Bounds) -> Any:
    def parse_float(text: str) -> float:
        value = float(text)
        if not bounds.allow_nan and not math.isfinite(value):
            raise Unreadable(f"a number out of range: {text[:40]}")
        return value
    return parse_float


def _constant_parser(bounds: Bounds) -> Any:
    def parse_constant(name: str) -> float:
        if not bounds.allow_nan:
            raise Unreadable(f"non-standard JSON constant {name}")
        return float(name)  # NaN, Infinity, -Infinity
    return parse_constant


def _check_depth(value: Any, limit: int) -> None:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            if depth > limit:
                raise Unreadable(f"nested deeper than {limit} levels")
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            if depth > limit:
                raise Unreadable(f"nested deeper than {limit} levels")
            stack.extend((x, depth + 1) for x in v)


def loads(data: bytes | str, bounds: Bounds) -> Any:
    """The JSON value of ``data`` within ``bounds``; ``Unreadable`` says why not."""
    if len(data) > bounds.max_bytes:
        raise Unreadable(f"{len(data)} bytes (at most {bounds.max_bytes})")
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Unreadable(f"not UTF-8 (byte {exc.start})") from None
    else:
        text = data
    try:
        value = json.loads(text, parse_int=_int_parser(bounds),
                           parse_float=_float_parser(bounds),
                           parse_constant=_constant_parser(bounds))
    except Unreadable:
        raise
    except RecursionError:
        raise Unreadable(f"nested deeper than {bounds.max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError included
        raise Unreadable(f"not JSON: {str(exc)[:120]}") from None
    _check_depth(value, bounds.max_depth)
    return value


def loads_object(data: bytes | str, bounds: Bounds) -> dict[str, Any]:
    """``loads`` of a document that must be a JSON object."""
    value = loads(data, bounds)
    if not isinstance(value, dict):
        raise Unreadable(f"a JSON {type(value).__name__}, not an object")
    return value


def read_object(path: str | Path, bounds: Bounds) -> dict[str, Any]:
    """The JSON object in the file at ``path``; ``Unreadable`` (or OSError) says why not.
    Reads at most one byte past the bound."""
    with open(path, "rb") as f:
        data = f.read(bounds.max_bytes + 1)
    return loads_object(data, bounds)


_CHUNK = 1 << 16


def iter_lines(path: str | Path, bounds: Bounds, skipped: SkipReport | None = None,
               offset: int = 0, *, tail: bool = False,
               ) -> Iterator[tuple[dict[str, Any], int, int]]:
    """``(object, end offset, line number)`` for each line of a JSONL file from byte ``offset``.

    A line that is not a JSON object within ``bounds`` is counted in ``skipped`` (with its
    number, counted from ``offset``) and passed over; a line longer than the bound is
    skipped without being held in memory. ``tail``: a last line without its newline is one
    still being written: it ends the iteration unread (the next read starts at it).
    """
    p = Path(path)
    try:
        f = open(p, "rb")
    except (FileNotFoundError, NotADirectoryError):
        return
    with f:
        f.seek(offset)
        pos, number = offset, 0
        while True:
            line = f.readline(bounds.max_bytes + 1)
            if not line:
                return
            number += 1
            if len(line) > bounds.max_bytes and not line.endswith(b"\n"):
                pos += len(line) + _skip_rest(f)
                if skipped is not None:
                    skipped.add(number, f"a line longer than {bounds.max_bytes} bytes")
                continue
            if tail and not line.endswith(b"\n"):
                return
            pos += len(line)
            text = line.strip()
            if not text:
                continue
            try:
                obj = loads_object(text, bounds)
            except Unreadable as exc:
                if skipped is not None:
                    skipped.add(number, str(exc))
                continue
            yield obj, pos, number


def _skip_rest(f: Any) -> int:
    """Read past the rest of an over-long line; the bytes skipped."""
    n = 0
    while True:
        chunk = f.readline(_CHUNK)
        n += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return n
