"""The one JSONL follower (``orchestrator.journal.follow``) that the books and the console
share: complete lines once each, a torn tail waiting, garbage and overlong lines skipped and
counted, a replaced file read from its start, and any way of cutting appends read the same."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.contracts import readback
from orchestrator.journal.follow import JsonlFollower

FUZZ_CASES = 300


def append(path: Path, data: str | bytes) -> None:
    with open(path, "ab") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def test_each_complete_line_once_a_torn_tail_waits_and_garbage_is_counted(
        tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    follow = JsonlFollower(path)
    assert follow.read() == []  # not there yet
    append(path, '{"kind": "a"}\n{"kind": "b"')
    assert follow.read() == [{"kind": "a"}]
    append(path, '}\nnot json\n[1, 2]\n{"x": NaN}\n\n{"kind": "c"}\n')
    assert follow.read() == [{"kind": "b"}, {"kind": "c"}]
    assert follow.skipped == 3  # the text, the list and the NaN; blank lines are not counted
    assert follow.read() == []
    path.write_text('{"kind": "new"}\n')  # replaced by a shorter file: read from the start
    assert follow.read() == [{"kind": "new"}]


def test_raw_lines_are_left_to_the_readers_parser(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    follow = JsonlFollower(path, readback.STEPS)
    append(path, b'{"step": 1}\n{"step": 2, "loss": NaN}\n{"step"')
    assert follow.read_raw() == [b'{"step": 1}', b'{"step": 2, "loss": NaN}']
    # The step records' bounds allow NaN (a diverged loss is a fact to report).
    record = follow.parse(b'{"step": 2, "loss": NaN}')
    assert record is not None and record["step"] == 2 and math.isnan(record["loss"])
    assert follow.skipped == 0


def test_a_line_past_the_bounds_is_dropped_not_held(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    follow = JsonlFollower(path, readback.STEPS)
    huge = b'{"pad": "' + b"x" * (readback.STEPS.max_bytes + 10)
    append(path, huge)  # no newline yet, already past the bound
    assert follow.read() == []
    assert follow.skipped == 1 and follow.offset == path.stat().st_size  # not held
    append(path, b'"}\n{"step": 3}\n')  # the rest of the overlong line, then a good one
    assert follow.read() == [{"step": 3}]
    assert follow.skipped == 1  # the overlong line's tail is passed over with it


@settings(max_examples=FUZZ_CASES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(objs=st.lists(st.dictionaries(st.sampled_from(["kind", "step", "ts", "loss"]),
                                     st.one_of(st.integers(-2**53, 2**53), st.text(max_size=8), st.none()),
                                     max_size=4), max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=10))
def test_any_way_of_cutting_the_appends_reads_the_same_objects(
        tmp_path: Path, objs: list[dict], cuts: list[int]) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.unlink(missing_ok=True)
    data = "".join(json.dumps(o) + "\n" for o in objs).encode()
    follow = JsonlFollower(path)
    seen: list[dict] = []
    start = 0
    for cut in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
        append(path, data[start:cut])
        start = max(start, cut)
        seen.extend(follow.read())
    assert seen == objs
    assert follow.skipped == 0


def test_a_torn_tail_rewritten_by_its_writer_is_read_once_whole(tmp_path: Path) -> None:
    """A writer that cuts its torn last line and writes it again (the books' test journal)
    is followed: the complete lines before it are not read twice."""
    path = tmp_path / "events.jsonl"
    follow = JsonlFollower(path)
    append(path, '{"seq": 1}\n{"seq": 2, "ts": 1')
    assert follow.read() == [{"seq": 1}]
    path.write_text('{"seq": 1}\n')  # the torn line cut off
    append(path, '{"seq": 2}\n{"seq": 3}\n')
    assert follow.read() == [{"seq": 2}, {"seq": 3}]
    assert follow.skipped == 0
