"""Rank 0's step records: one type from the heartbeat to ``steps.jsonl`` and back.

A step record is what the worker SDK's ``step_done(step, **metrics)`` reports for rank 0
(``progress`` for every rank is the beat's, not the records'). It travels in heartbeats, is
appended to ``steps.jsonl`` with its generation, and feeds the progress tracker, the metrics,
the stability detectors and the books; the same model checks it at admission and when
``steps.jsonl`` is read back, so no reader downstream meets a value it did not expect:

- ``step``, ``batch``: integers in ``[0, 2**53]``; ``tokens`` in ``[0, 2**62]``;
- ``loss``, ``grad_norm``, ``param_norm``: floats, NaN and infinities included (a non-finite
  loss is exactly what the detectors look for);
- ``lr`` and every other float: finite, within ``+-1e12``; seconds (``step_time``,
  ``data_s``, ``ckpt_block_s``, ``mem_block_s``) in ``[0, 1e7]``; ``ts`` a wall time;
- a script's own metrics: at most ``MAX_KEYS`` keys in all, named like identifiers, each a
  finite float, an integer within ``+-2**53``, a bool, null or a string of <= 256 characters.

Which records the supervisor accepts (from whom, for which generation, how many) is the
admission's rule (``supervisor.gateway.admission``, ``supervisor.recordgate``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NotRequired

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    with_config,
)
from typing_extensions import TypedDict

from orchestrator.contracts import readback

# A heartbeat carries at most this many records; an agent with more pending sends them over
# several beats (``orchestrator.agent``).
MAX_RECORDS_PER_BEAT = 1000
MAX_KEYS = 64
MAX_STEP = 1 << 53
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")

Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Generation = Annotated[int, Field(ge=0, le=1 << 31)]
Tokens = Annotated[int, Field(ge=0, le=1 << 62)]
# Wall-clock seconds since the epoch: finite, and not past the year 2500.
Timestamp = Annotated[float, Field(ge=0, le=1.7e10, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)]
Finite = Annotated[float, Field(ge=-1e12, le=1e12, allow_inf_nan=False)]
Measured = Annotated[float, Field(allow_inf_nan=True)]  # what the detectors judge
SafeInt = Annotated[int, Field(ge=-MAX_STEP, le=MAX_STEP)]
ShortText = Annotated[str, StringConstraints(max_length=256)]
Extra = Finite | SafeInt | bool | None | ShortText


@with_config(ConfigDict(strict=True))
class StepRecord(TypedDict, extra_items=Extra):  # type: ignore[call-arg]
    """One of rank 0's step records (a plain dict after parsing; see the module)."""

    step: Step
    ts: NotRequired[Timestamp]
    loss: NotRequired[Measured | None]
    grad_norm: NotRequired[Measured | None]
    param_norm: NotRequired[Measured | None]
    lr: NotRequired[Finite | None]
    tokens: NotRequired[Tokens | None]
    batch: NotRequired[Step | None]
    step_time: NotRequired[Seconds | None]
    data_s: NotRequired[Seconds | None]
    ckpt_block_s: NotRequired[Seconds | None]
    mem_block_s: NotRequired[Seconds | None]
    skipped: NotRequired[bool]


def _keys_ok(rec: StepRecord) -> StepRecord:
    if len(rec) > MAX_KEYS:
        raise ValueError(f"{len(rec)} fields (at most {MAX_KEYS})")
    for key in rec:
        if not _KEY.match(key):
            raise ValueError(f"field name {key[:80]!r} is not an identifier of <= 64 "
                             "characters")
    return rec


_RECORD: TypeAdapter[StepRecord] = TypeAdapter(
    Annotated[StepRecord, AfterValidator(_keys_ok)])
_KNOWN = frozenset(StepRecord.__required_keys__ | StepRecord.__optional_keys__)
# A heartbeat's list of them (the protocol's field type).
Records = Annotated[list[Annotated[StepRecord, AfterValidator(_keys_ok)]],
                    Field(max_length=MAX_RECORDS_PER_BEAT)]


def parse_record(raw: Any) -> StepRecord:
    """``raw`` as a ``StepRecord``; ValidationError says why not."""
    return _RECORD.validate_python(raw)


def clean_record(raw: Any) -> StepRecord | None:
    """The record a worker sent, as a ``StepRecord``: a script's own metric that does not
    fit is left out (a NaN accuracy, a list); None when the record itself does not fit (no
    whole step, a string loss, too many fields)."""
    if not isinstance(raw, dict):
        return None
    extras = [k for k in raw if k not in _KNOWN and isinstance(k, str) and _KEY.match(k)]
    data = {k: raw[k] for k in raw if k in _KNOWN}
    data.update((k, raw[k]) for k in extras[:MAX_KEYS - len(data)])
    try:
        return parse_record(data)
    except ValidationError as exc:
        bad = {err["loc"][0] for err in exc.errors(include_url=False) if err["loc"]}
        if not bad or bad & _KNOWN:
            return None
        try:
            return parse_record({k: v for k, v in data.items() if k not in bad})
        except ValidationError:
            return None


def keep_valid_records(records: list[Any]) -> tuple[list[StepRecord], int]:
    """The step records a heartbeat may carry, and how many were dropped: one bad record (a
    string loss) must not make the whole beat unsendable."""
    kept = [rec for raw in records if (rec := clean_record(raw)) is not None]
    return kept, len(records) - len(kept)


# -- steps.jsonl ---------------------------------------------------------------------------
def encode_stored(rec: StepRecord, generation: int) -> str:
    """The ``steps.jsonl`` line of ``rec`` (a NaN loss is written as the ``NaN`` token)."""
    return json.dumps({**rec, "generation": generation}) + "\n"


def parse_stored(raw: dict[str, Any]) -> tuple[int, StepRecord] | None:
    """(generation, record) of a ``steps.jsonl`` object, or None when it is not one."""
    data = dict(raw)
    generation = data.pop("generation", 0)
    if isinstance(generation, bool) or not isinstance(generation, int) \
            or not 0 <= generation <= 1 << 31:
        return None
    try:
        return generation, parse_record(data)
    except ValidationError:
        return None


def parse_stored_line(line: bytes) -> tuple[int, StepRecord] | None:
    """A ``steps.jsonl`` line as (generation, record), or None (torn, garbled, not a
    record, past the reader's bounds)."""
    try:
        raw = readback.loads_object(line, readback.STEPS)
    except readback.Unreadable:
        return None
    return parse_stored(raw)


def read_steps(path: str | Path, offset: int = 0,
               skipped: readback.SkipReport | None = None, *, tail: bool = True,
               ) -> Iterator[tuple[int, StepRecord, int]]:
    """``(generation, record, end offset)`` for each record of a ``steps.jsonl`` from byte
    ``offset``; lines that are not records are counted in ``skipped`` and passed over. With
    ``tail`` (the default), a last line without its newline is still being written: it
    ends the iteration."""
    for raw, end, number in readback.iter_lines(path, readback.STEPS, skipped, offset,
                                                tail=tail):
        parsed = parse_stored(raw)
        if parsed is None:
            if skipped is not None:
                skipped.add(number, "not a step record")
            continue
        yield parsed[0], parsed[1], end
