"""A hang's stack files, looked for in a thread: each look names only files newly written."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.supervisor.generation.parts import written_since


def test_only_non_empty_files_not_seen_before_are_new(tmp_path: Path) -> None:
    (tmp_path / "gen0001-rank00000.txt").write_text("Thread 0x1 (most recent call first)")
    (tmp_path / "gen0001-rank00001.txt").write_text("")  # being written: not yet
    (tmp_path / "gen0001-rank00002.txt").write_text("stack")
    assert written_since(str(tmp_path), frozenset()) == {"gen0001-rank00000.txt",
                                                         "gen0001-rank00002.txt"}
    assert written_since(str(tmp_path), frozenset({"gen0001-rank00000.txt"})) == {
        "gen0001-rank00002.txt"}
    (tmp_path / "gen0001-rank00001.txt").write_text("done now")
    assert written_since(str(tmp_path), frozenset({"gen0001-rank00000.txt",
                                                   "gen0001-rank00002.txt"})) == {
        "gen0001-rank00001.txt"}


def test_a_missing_folder_has_no_files(tmp_path: Path) -> None:
    assert written_since(str(tmp_path / "stacks"), frozenset()) == set()


def test_a_file_removed_between_listing_and_stat_is_skipped(tmp_path: Path,
                                                            monkeypatch) -> None:
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.txt").write_text("x")
    real_stat = os.stat

    def flaky_stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith("a.txt"):
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", flaky_stat)
    assert written_since(str(tmp_path), frozenset()) == {"b.txt"}
