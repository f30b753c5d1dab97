"""The one bounded reader of files read back (``readback``), the step record's type
(``steprecord``) and the supervisor's record gate (``recordgate``): what each takes, what
each refuses, and that nothing but ``Unreadable`` (or None) comes out of any bytes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts import readback
from orchestrator.contracts.steprecord import clean_record, parse_stored_line, read_steps
from orchestrator.supervisor.recordgate import RecordGate


@pytest.mark.parametrize(("data", "why"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (b'{"a": ' + b"9" * 5000 + b"}", "5000 digits"),
    (b'{"a": NaN}', "non-standard JSON constant NaN"),
    (b'{"a": 1e999}', "out of range"),
    (b'{"a": "\xff"}', "not UTF-8"),
    (b'{"a": ' + b"[" * 20 + b"1" + b"]" * 20 + b"}", "nested deeper"),
    (b"x" * (17 * 2**20), "bytes (at most"),
    (b"{", "not JSON"),
])
def test_what_the_journal_reader_refuses(data: bytes, why: str) -> None:
    with pytest.raises(readback.Unreadable, match=why.replace("(", r"\(")):
        readback.loads(data, readback.JOURNAL)


def test_steps_take_a_nan_loss_and_nothing_else_unbounded() -> None:
    assert math.isnan(readback.loads(b'{"loss": NaN}', readback.STEPS)["loss"])
    assert parse_stored_line(b'{"step": 3, "loss": NaN, "generation": 2}')[0] == 2
    for line in (b'{"step": 3, "tokens": "12"}', b'{"step": "3"}',
                 b'{"step": 3, "lr": NaN}', b'{"step": 3, "generation": -1}',
                 b'{"step": 3, "batch": 9007199254740993}', b"[1]"):
        assert parse_stored_line(line) is None, line


def test_a_jsonl_file_skips_what_it_cannot_take_and_stops_at_a_torn_tail(
        tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\n' + b"x" * (70 * 2**10) + b"\n"
                     + b'{"step": 2, "tokens": "x"}\n{"step": 3}\n{"step": 4, "lo')
    skipped = readback.SkipReport()
    got = [(r["step"], end) for _, r, end in read_steps(path, skipped=skipped)]
    assert [s for s, _ in got] == [1, 3] and skipped.lines == 2
    assert got[-1][1] == path.stat().st_size - len(b'{"step": 4, "lo')
    assert [r["step"] for _, r, _ in read_steps(path, tail=False)] == [1, 3]


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.binary(max_size=300))
def test_any_bytes_parse_or_are_unreadable(data: bytes) -> None:
    for bounds in (readback.JOURNAL, readback.STEPS, readback.MANIFEST):
        try:
            readback.loads(data, bounds)
        except readback.Unreadable:
            pass
    parse_stored_line(data)


def test_an_agent_keeps_a_record_and_drops_a_metric_that_does_not_fit() -> None:
    assert clean_record({"step": 3, "loss": 1.0, "acc": math.nan, "x y": 1, "l": [1]}) == \
        {"step": 3, "loss": 1.0}
    assert clean_record({"step": 3, "loss": "1.0"}) is None
    assert clean_record({"step": True}) is None
    many = {"step": 1, **{f"m{i}": i for i in range(200)}}
    assert len(clean_record(many)) == 64


def test_the_gate_takes_each_step_once_at_a_bounded_rate() -> None:
    now = [0.0]
    gate = RecordGate(per_s=10, monotonic=lambda: now[0])  # a burst of 50
    taken = gate.take(1, [{"step": s} for s in range(1, 81)])
    assert len(taken.records) == 50 and taken.over_rate == 30 and taken.repeated == 0
    again = gate.take(1, [{"step": s} for s in range(40, 53)])  # a resent beat, then new
    assert again.repeated == 11 and [r["step"] for r in again.records] == []
    now[0] = 1.0  # ten more a second
    later = gate.take(1, [{"step": s} for s in range(51, 70)])
    assert [r["step"] for r in later.records] == list(range(51, 61))
    now[0] = 2.0
    fresh = gate.take(2, [{"step": 1}])  # a new generation starts its own count
    assert [r["step"] for r in fresh.records] == [1]
