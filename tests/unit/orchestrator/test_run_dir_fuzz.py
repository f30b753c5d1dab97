"""``status``, a supervisor's start and ``up --resume`` work on any run directory a crash or an
attacker left: ``events.jsonl``, ``steps.jsonl``, ``stability.json`` and
``supervisor.json`` truncated, garbled, 100,000 levels deep, holding 5,000-digit integers,
bytes that are not UTF-8, NaN where JSON has none, unknown kinds, values of the wrong type.
Before, a hand-edited journal (2 of 14) or one step record crashed every later start.

``RUN_DIR_FUZZ_EXAMPLES`` damaged run directories per run (100 by default), each read by
``status`` (table and JSON) and by a supervisor's start (the journal's fold, the books'
replay, the stability lineage, the pending rollback); a few of them by ``status`` and
``up --resume`` as processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from orchestrator.cli import views
from orchestrator.config.loader import read_yaml, validate_data
from orchestrator.contracts.rundir import RunDir
from orchestrator.supervisor.core import Supervisor

EXAMPLES = int(os.environ.get("RUN_DIR_FUZZ_EXAMPLES", "100"))
OLD = Path(__file__).resolve().parents[2] / "data" / "run-v0.1"
FILES = ("events.jsonl", "steps.jsonl", "stability.json", "supervisor.json")

_LINES = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"seq": ' + b"9" * 5000 + b', "ts": 1.0, "kind": "progress", "generation": 1, "step": 1}',
    b'{"seq": 5, "ts": 1.0, "kind": "progress", "generation": 1, "step": ' + b"9" * 4000 + b"}",
    b'{"step": 12, "tokens": "12", "step_time": "x", "generation": 1}',
    b'{"step": 13, "loss": NaN, "batch": 9007199254740992, "generation": 2}',
    b'{"seq": 7, "ts": 1e400, "kind": "transition", "from": "RUNNING", "to": "FAILED"}',
    b'{"seq": 8, "ts": 1.0, "kind": "no_such_kind"}',
    b'{"seq": 9, "ts": 1.0, "kind": "stability", "event": "nonfinite", "rule": "loss.nonfinite",'
    b' "action": "rollback", "step": 30, "generation": 2, "onset_step": 30,'
    b' "onset_batch": 9007199254740992}',
    b'{"seq": 10, "ts": 1.0, "kind": "failure", "generation": 2, "cause": "worker_exit",'
    b' "message": "\x1b[2J[blink]x[/blink]", "rank": 0}',
    b"\xff\xfe\x00\x80 not utf-8",
    b'{"seq": 11, "ts": 1.0, "kind": "generation_launched", "generation": "two"}',
    b"x" * 70_000,
    b"",
]


def _template(tmp: Path) -> Path:
    """An old run (40 steps, a kill at 20, one recovery) with its step records."""
    run = tmp / "template"
    run.mkdir()
    for name in ("events.jsonl", "config.yaml"):
        (run / name).write_text((OLD / name).read_text().replace("RUN_DIR", str(run)))
    with open(run / "steps.jsonl", "w") as f:
        for gen, steps in ((1, range(1, 21)), (2, range(11, 41))):
            for s in steps:
                f.write(json.dumps({"step": s, "loss": 3.0 - s / 40, "grad_norm": 1.0,
                                    "tokens": s * 256, "ts": 1.7e9 + s, "batch": s,
                                    "generation": gen}) + "\n")
    (run / "stability.json").write_text(json.dumps({"version": 1, "steps_offset": 0,
                                                    "lineage": {}}))
    (run / "supervisor.json").write_text(json.dumps({"pid": 1, "port": 1, "url": "x"}))
    return run


def _damage(run: Path, seed: int, ops: int) -> None:
    rng = random.Random(seed)
    for _ in range(ops):
        path = run / rng.choice(FILES)
        data = path.read_bytes()
        lines = data.split(b"\n")
        op = rng.randrange(4)
        if op == 0:  # torn: cut anywhere
            data = data[:rng.randrange(len(data) + 1)]
        elif op == 1:  # a line inserted
            lines.insert(rng.randrange(len(lines) + 1), rng.choice(_LINES))
            data = b"\n".join(lines)
        elif op == 2:  # a line's bytes replaced by random ones
            i = rng.randrange(len(lines))
            lines[i] = rng.randbytes(rng.randrange(1, 80))
            data = b"\n".join(lines)
        else:  # a number in a line made huge, negative or a string
            i = rng.randrange(len(lines))
            swap = rng.choice([b"9" * 30, b"-1", b'"7"', b"1e308", b"[]", b"null"])
            lines[i] = lines[i].replace(b"1", swap, 1)
            data = b"\n".join(lines)
        path.write_bytes(data)


def _read_everything(run: Path) -> None:
    """What ``status`` and a supervisor's start read; raises nothing."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert views.show_status(run, json_out=True) == 0
    json.loads(out.getvalue())
    assert views.show_status(run, json_out=False) == 0
    cfg = validate_data(read_yaml(run / "config.yaml"), "config.yaml")
    sup = Supervisor(cfg, RunDir.open(run), registry=CollectorRegistry())
    try:
        sup.books.refresh()
    finally:
        sup.journal.close()


def test_status_and_a_supervisor_start_read_any_damaged_run_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(views, "out", views.Console(file=io.StringIO()))
    template = _template(tmp_path)
    tried = {"n": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 1 << 32), ops=st.integers(1, 4))
    def one(seed: int, ops: int) -> None:
        tried["n"] += 1
        run = tmp_path / "run"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(template, run)
        _damage(run, seed, ops)
        _read_everything(run)

    one()
    assert tried["n"] >= EXAMPLES


def test_status_and_up_resume_as_processes_on_a_damaged_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(_template(tmp_path), run)
    with open(run / "events.jsonl", "ab") as f:
        f.write(b"\n" + b"\n".join(_LINES) + b"\n")
    with open(run / "steps.jsonl", "ab") as f:
        f.write(b"\n".join(_LINES) + b"\n")
    for cmd in (["status", str(run)], ["status", str(run), "--json"],
                ["up", "--resume", str(run)]):
        out = subprocess.run([sys.executable, "-m", "orchestrator", *cmd],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-2000:])
        assert "Traceback" not in out.stdout + out.stderr
        assert "\x1b" not in out.stdout
