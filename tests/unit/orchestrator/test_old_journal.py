"""A journal written by the version before typed events (0.1, commit 03888e0: a 40-step job,
a kill at step 20, one recovery) is read whole by this one: the fold, status and a resumed
supervisor's view agree with what that run did."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from orchestrator.journal.store import SkipReport, read_journal
from orchestrator.journal.view import JobView
from orchestrator.contracts.state import JobState

OLD = Path(__file__).resolve().parents[2] / "data" / "run-v0.1"


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("events.jsonl", "config.yaml"):
        text = (OLD / name).read_text().replace("RUN_DIR", str(run))
        (run / name).write_text(text)
    return run


def test_every_line_of_an_old_journal_parses_and_folds(tmp_path: Path) -> None:
    skipped = SkipReport()
    events = list(read_journal(OLD / "events.jsonl", skipped))
    assert skipped.lines == 0 and len(events) == 117
    view = JobView.from_events(events)
    assert view.state is JobState.COMPLETED and view.generation == 2
    assert [f["cause"] for f in view.failures] == ["worker_exit"]
    assert view.newest_checkpoint_step == 40
    assert len(view.chaos_fired) == 1


def test_status_and_resume_work_on_an_old_run_dir(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    st = json.loads(out.stdout)
    assert st["state"] == "COMPLETED" and [f["cause"] for f in st["failures"]] == ["worker_exit"]
    # A finished job: --resume reports it; the old lines stay as they were, and what this
    # version appended reads back with them.
    before = (run / "events.jsonl").read_bytes()
    res = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--resume", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    after = (run / "events.jsonl").read_bytes()
    assert after.startswith(before)
    skipped = SkipReport()
    view = JobView.from_events(read_journal(run / "events.jsonl", skipped))
    assert skipped.lines == 0 and view.state is JobState.COMPLETED
    shutil.rmtree(run)
