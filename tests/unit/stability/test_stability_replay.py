"""Replaying recorded steps gives what the live monitor gave."""

from __future__ import annotations

import json
import math

import pytest
from _stability_streams import noise, steady_grads

from stability import StabilityConfig, StabilityMonitor, StepRecord, read_jsonl, replay
from stability.config import GradSpikeConfig


def live_records() -> list[StepRecord]:
    grads = steady_grads(120, s40=2.0, s60=1.7, s61=1.7, s62=1.7, s63=1.7, s64=1.7, s65=1.7)
    recs = []
    for i, g in enumerate(grads):
        loss = math.nan if i == 90 else 2.0 + noise(i, 0.01)
        param = 1600.0 + i if i != 100 else 5000.0
        recs.append(StepRecord(i, loss, g, param_norm=param, lr=3e-4, tokens=4096, step_time=0.1))
    return recs


def write_jsonl(path, recs: list[StepRecord]) -> None:
    lines = []
    for rec in recs:
        # Records as the worker journals them: other metrics alongside, blank lines between.
        lines.append(json.dumps({**rec.to_dict(), "mfu": 0.41, "host": "n1"}, allow_nan=False))
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def test_replay_of_a_jsonl_file_matches_the_live_monitor(tmp_path):
    config = StabilityConfig(grad_spike=GradSpikeConfig(mode="absolute", margin=0.2))
    recs = live_records()
    monitor = StabilityMonitor(config)
    live = [e.to_dict() for rec in recs for e in monitor.update(rec)]
    path = tmp_path / "records.jsonl"
    write_jsonl(path, recs)

    replayed = [e.to_dict() for e in replay(read_jsonl(path), config)]
    assert replayed == live
    assert {e["kind"] for e in live} >= {"grad_spike", "persistent_spike", "nonfinite"}
    assert {e["kind"] for e in live} >= {"param_norm_jump", "grad_spike_end"}
    # The same through str paths, dicts and plain lines.
    dicts = [json.loads(line) for line in path.read_text().splitlines() if line]
    assert [e.to_dict() for e in replay(dicts, config)] == live
    lines = path.read_text().splitlines()
    assert [e.to_dict() for e in replay(read_jsonl(lines), config)] == live
    assert [e.to_dict() for e in replay(read_jsonl(str(path)), config)] == live


def test_read_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": \n')
    reader = read_jsonl(path)
    assert next(reader) == StepRecord(1, 2.0)
    with pytest.raises(ValueError, match=r"bad\.jsonl:line 3: invalid JSON"):
        next(reader)


@pytest.mark.parametrize(
    ("line", "match"),
    [("[1, 2]", "line 2: a step record must be a JSON object"), ('{"loss": 1}', "line 2: .*step")],
)
def test_read_jsonl_rejects_lines_that_are_not_records(line, match):
    with pytest.raises(ValueError, match=match):
        list(read_jsonl(['{"step": 1, "loss": 2.0}', line]))
