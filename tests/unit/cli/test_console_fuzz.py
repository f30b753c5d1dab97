"""Bad input at the console's boundaries never raises: rank log bytes, --since text, and a
supervisor.json / pid file of any content."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli.liveness import check
from orchestrator.cli.ranklogs import LogFollower, parse_since
from orchestrator.contracts.rundir import RunDir

CASES = 200
_SETTINGS = settings(max_examples=CASES, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4), max_leaves=12)


@_SETTINGS
@given(chunks=st.lists(st.binary(max_size=300), max_size=12))
def test_rank_logs_of_any_bytes_come_out_as_prefixed_lines(tmp_path: Path,
                                                           chunks: list[bytes]) -> None:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    path = logs / "rank-00002.log"
    path.write_bytes(b"")
    follower = LogFollower(logs, None, since=datetime(2026, 1, 1))
    written = b""
    for chunk in chunks:
        with open(path, "ab") as f:
            f.write(chunk)
        written += chunk
        for line in follower.poll():
            assert line.startswith("[rank2]: ") and "\n" not in line
    list(follower.poll(final=True))
    assert follower.streams[2].offset == len(written)


@_SETTINGS
@given(text=st.text(max_size=40))
def test_since_is_parsed_or_refused_with_what_is_accepted(text: str) -> None:
    try:
        parse_since(text, datetime(2026, 11, 22, 18, 0))
    except ValueError as exc:
        assert "duration" in str(exc) or "--since" in str(exc)
    except OverflowError:
        pass  # "9999999d": a date before year 1 is refused by datetime itself


@_SETTINGS
@given(info=json_values, pid_text=st.text(max_size=20))
def test_liveness_reads_any_supervisor_json_and_pid_file(tmp_path: Path, info: object,
                                                         pid_text: str) -> None:
    run = RunDir(tmp_path)
    run.supervisor_info.write_text(json.dumps(info))
    run.pid_file.write_text(pid_text)
    alive = check(run)
    # (Whether something answers at a made-up port is not asserted: another test's live
    # supervisor could hold it.)
    assert isinstance(alive.api_ok, bool) and isinstance(alive.describe(), str)
    assert alive.pid is None or (isinstance(alive.pid, int) and 0 < alive.pid < 2**22)
