"""`up`'s log routing per --log-format and --quiet/--verbose: the run dir's JSON log always,
JSON lines on stdout for json, and on a terminal only the errors the journal does not tell."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.cli.live import LogFormat, Verbosity, setup_logging
from orchestrator.logs import get_logger


@pytest.fixture(autouse=True)
def _restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def emit_three() -> None:
    log = get_logger("t")
    log.info("job state", to_state="RUNNING")
    log.error("generation failed", cause="hang")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("api handler failed", token="s3cret")


def test_json_format_writes_json_lines_to_stdout_and_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    setup_logging(tmp_path / "supervisor.log", LogFormat.JSON, Verbosity.NORMAL, Console())
    emit_three()
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in out] == ["job state", "generation failed", "api handler failed"]
    assert out[2]["token"] == "***"  # the file's formatter, redaction included
    file_lines = (tmp_path / "supervisor.log").read_text().splitlines()
    assert [json.loads(line)["event"] for line in file_lines] == [e["event"] for e in out]


def test_json_quiet_keeps_warnings_and_errors(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    setup_logging(tmp_path / "supervisor.log", LogFormat.JSON, Verbosity.QUIET, Console())
    emit_three()
    events = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines()]
    assert events == ["generation failed", "api handler failed"]


@pytest.mark.parametrize(("verbosity", "shown"), [
    (Verbosity.NORMAL, ["api handler failed"]),
    (Verbosity.VERBOSE, ["job state", "generation failed", "api handler failed"])])
def test_terminal_shows_only_what_the_journal_lines_do_not(tmp_path: Path, verbosity: Verbosity,
                                                           shown: list[str]) -> None:
    buf = io.StringIO()
    setup_logging(tmp_path / "supervisor.log", LogFormat.RICH, verbosity,
                  Console(file=buf, width=200))
    emit_three()
    text = buf.getvalue()
    for event in ("job state", "generation failed", "api handler failed"):
        assert (f"] {event} " in text) == (event in shown), (event, text)
    assert "RuntimeError: boom" in text  # the exception is told, as a plain traceback
    assert "s3cret" not in text and "locals" not in text
    assert len((tmp_path / "supervisor.log").read_text().splitlines()) == 3
