"""`orchestrator data prepare` keeps every byte of the files it is given unless a cap is asked
for, says what a cap left out, and names `--max-bytes` when nothing fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MB = 1_000_000


def _prepare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "orchestrator", "data", "prepare", *args],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)


def _text(path: Path, size: int, letter: str) -> Path:
    path.write_text((letter * 99 + "\n") * (size // 100))
    return path


def test_two_files_past_the_stdlib_cap_are_both_kept(tmp_path: Path) -> None:
    a, b = _text(tmp_path / "a.txt", 5 * MB, "a"), _text(tmp_path / "b.txt", 5 * MB, "b")
    done = _prepare(tmp_path, "--out", str(tmp_path / "ds"), "--source", str(a),
                    "--source", str(b))
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert index["documents"] == 2 and index["truncated"] is False
    assert index["source_bytes"] == a.stat().st_size + b.stat().st_size
    assert "left out" not in done.stdout + done.stderr


def test_a_cap_that_drops_data_says_what_it_dropped(tmp_path: Path) -> None:
    a, b = _text(tmp_path / "a.txt", 5 * MB, "a"), _text(tmp_path / "b.txt", 5 * MB, "b")
    done = _prepare(tmp_path, "--out", str(tmp_path / "ds"), "--source", str(a),
                    "--source", str(b), "--max-bytes", str(6 * MB))
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    assert index["documents"] == 1 and index["truncated"] is True
    assert index["left_out_bytes"] == b.stat().st_size and index["left_out_files"] == 1
    said = " ".join(done.stderr.split())
    assert f"left out {b.stat().st_size:,} bytes" in said and "--max-bytes" in said, said


def test_one_document_over_the_cap_names_the_option(tmp_path: Path) -> None:
    big = _text(tmp_path / "big.txt", 10 * MB, "x")
    failed = _prepare(tmp_path, "--out", str(tmp_path / "ds"), "--source", str(big),
                      "--max-bytes", str(8 * 2**20))
    assert failed.returncode == 1
    said = " ".join(failed.stderr.split())
    assert "no documents fit" in said and "--max-bytes" in said, said
    assert f"{big.stat().st_size:,} bytes" in said and "big.txt" in said
    assert not (tmp_path / "ds").exists()
    kept = _prepare(tmp_path, "--out", str(tmp_path / "ds"), "--source", str(big))
    assert kept.returncode == 0, kept.stderr  # no cap asked for: the file is kept whole
