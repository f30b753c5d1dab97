"""``orchestrator logs``: [rankN]: prefixes, following one file across generations and new
ranks' files, --since by generation header, and a reader that goes away (| head)."""

from __future__ import annotations

import io
from datetime import datetime
from pathlib import Path

import pytest

from orchestrator.cli.ranklogs import LogFollower, parse_since, show_logs

T0 = datetime(2026, 11, 22, 18, 0, 0)


def header(gen: int, rank: int, when: str) -> str:
    return f"==== generation {gen} rank {rank} started 2026-11-22 {when} ====\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)


def test_follow_prints_new_lines_across_generations_until_the_job_ends(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    write(logs / "rank-00000.log", header(1, 0, "18:00:00") + "step 1\n")
    out = io.StringIO()
    polls = iter(range(100))

    def job_ended() -> bool:
        n = next(polls)
        if n == 1:  # the job writes on while we follow: a restart, and a new rank's file
            write(logs / "rank-00000.log", "step 2\n" + header(2, 0, "18:01:00") + "step 2 ")
            write(logs / "rank-00001.log", header(2, 1, "18:01:00") + "hello from 1\n")
        if n == 2:
            write(logs / "rank-00000.log", "again\n")
        return n >= 3

    code = show_logs(logs, None, None, True, job_ended, out=out, sleep=lambda s: None)
    assert code == 0
    assert out.getvalue().splitlines() == [
        "[rank0]: " + header(1, 0, "18:00:00").strip(), "[rank0]: step 1",
        "[rank0]: step 2", "[rank0]: " + header(2, 0, "18:01:00").strip(),
        "[rank1]: " + header(2, 1, "18:01:00").strip(), "[rank1]: hello from 1",
        "[rank0]: step 2 again"]


def test_one_rank_and_since_keeps_the_generations_started_since(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    write(logs / "rank-00000.log", header(1, 0, "17:00:00") + "old\n"
          + header(2, 0, "18:30:00") + "new\n")
    write(logs / "rank-00001.log", "other rank\n")
    follower = LogFollower(logs, [0], since=parse_since("45m", T0.replace(hour=19)))
    assert list(follower.poll(final=True)) == [
        "[rank0]: " + header(2, 0, "18:30:00").strip(), "[rank0]: new"]


def test_a_named_rank_whose_file_comes_later_is_picked_up(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    follower = LogFollower(logs, [3])
    assert list(follower.poll()) == []
    write(logs / "rank-00003.log", "late\n")
    assert list(follower.poll()) == ["[rank3]: late"]


def test_since_parsing() -> None:
    assert parse_since("90s", T0) == T0.replace(minute=0, second=0).replace(hour=17,
                                                                           minute=58, second=30)
    assert parse_since("2h", T0).hour == 16
    assert parse_since("2026-11-22 17:05", T0) == datetime(2026, 11, 22, 17, 5)
    with pytest.raises(ValueError, match="duration"):
        parse_since("yesterday", T0)


def test_a_reader_that_goes_away_ends_quietly(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    write(logs / "rank-00000.log", "a\nb\n")

    class Closed(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError

    assert show_logs(logs, [0], None, False, lambda: True, out=Closed()) == 0
