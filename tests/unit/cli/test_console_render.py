"""The console's reading of a run directory: tailing torn and hostile lines, the progress
figures, and the human lines (a stability warning says what it means and what to do)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cli.console import (
    STABILITY_ADVICE,
    JobFollower,
    Progress,
    describe,
    fmt_duration,
    progress_line,
)

FUZZ_CASES = 400


def append(path: Path, text: str | bytes) -> None:
    with open(path, "ab") as f:
        f.write(text if isinstance(text, bytes) else text.encode())


@settings(max_examples=FUZZ_CASES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.one_of(
    st.binary(max_size=200),
    st.builds(lambda d: (json.dumps(d) + "\n").encode(),
              st.dictionaries(st.sampled_from(["kind", "step", "ts", "to", "tokens", "loss"]),
                              st.one_of(st.integers(), st.floats(allow_nan=False),
                                        st.text(max_size=20), st.none()), max_size=5))),
    max_size=20))
def test_follower_never_raises_and_returns_only_whole_objects(tmp_path: Path,
                                                               chunks: list[bytes]) -> None:
    root = tmp_path / "run"
    root.mkdir(exist_ok=True)
    for name in ("events.jsonl", "steps.jsonl"):
        (root / name).unlink(missing_ok=True)
    follower = JobFollower(root)
    seen = []
    for chunk in chunks:
        append(root / "events.jsonl", chunk)
        append(root / "steps.jsonl", chunk)
        seen += follower.poll()
        line = progress_line(follower.progress, now=0.0)
        assert "\n" not in line
    assert all(isinstance(e, dict) for e in seen)
    for e in seen:  # every event describes without raising
        describe(e)
        describe(e, verbose=True)


def test_progress_figures_from_journal_and_step_records(tmp_path: Path) -> None:
    journal, steps = tmp_path / "events.jsonl", tmp_path / "steps.jsonl"
    events = [{"kind": "job_created", "job": "j", "steps": 100, "ts": 0.0},
              {"kind": "transition", "from": "LAUNCHING", "to": "RUNNING", "ts": 1.0},
              {"kind": "generation_launched", "generation": 1, "ts": 1.0},
              {"kind": "checkpoint_committed", "step": 10, "ts": 20.0}]
    append(journal, "".join(json.dumps(e) + "\n" for e in events))
    # 2 steps a second, 1000 tokens a step.
    append(steps, "".join(json.dumps({"step": s, "ts": 10.0 + s / 2, "tokens": 1000 * s,
                                      "loss": 3.0 - s / 100}) + "\n" for s in range(1, 21)))
    follower = JobFollower(tmp_path)
    follower.poll()
    p = follower.progress
    assert (p.job, p.state, p.step, p.total_steps) == ("j", "RUNNING", 20, 100)
    assert p.steps_per_s == 2.0 and p.tokens_per_s == 2000.0
    assert p.eta_s == 40.0  # 80 steps left at 2 a second
    assert p.last_checkpoint_step == 10
    line = progress_line(p, now=32.0)
    assert "step 20/100 (20%)" in line and "loss 2.8000" in line and "2.0k tok/s" in line
    assert "ETA 40s" in line and "ckpt 10 (12s ago)" in line
    # A restart goes back to step 11: the rate is measured afresh, the step follows.
    # The old generation's rate is not the new one's: none until two records of its own.
    append(journal, json.dumps({"kind": "generation_launched", "generation": 2,
                                "after_cause": "worker_exit", "resume_step": 10,
                                "ts": 40.0}) + "\n")
    append(steps, json.dumps({"step": 11, "ts": 50.0, "tokens": 11000, "loss": 2.9}) + "\n")
    follower.poll()
    assert (p.step, p.generation, p.restarts, p.steps_per_s) == (11, 2, 1, None)
    assert "gen 2" in progress_line(p, now=50.0)


def test_human_lines_for_what_an_operator_must_see() -> None:
    level, text = describe({"kind": "transition", "from": "RUNNING", "to": "FAILED",
                            "cause": "worker_exit", "reason": "restart budget spent"})
    assert level == "error" and text == ("job RUNNING -> FAILED (worker_exit): restart budget "
                                         "spent")
    level, text = describe({"kind": "failure", "generation": 1, "cause": "hang", "rank": 1,
                            "node_id": "local-1", "message": "no progress for 12 s"})
    assert level == "error" and "rank 1 on local-1" in text and "no progress" in text
    level, text = describe({"kind": "generation_launched", "generation": 3, "resume_step": 40,
                            "after_cause": "hang"})
    assert (level, text) == ("warning", "restart: generation 3 launched from checkpoint 40 "
                                        "after hang")
    assert describe({"kind": "heartbeat"}) is None
    assert describe({"kind": "checkpoint_committed", "step": 5}) is None
    assert describe({"kind": "checkpoint_committed", "step": 5}, verbose=True) is not None


def test_every_stability_warning_says_what_it_means_and_what_to_do() -> None:
    for kind, (meaning, todo) in STABILITY_ADVICE.items():
        level, text = describe({"kind": "stability", "event": kind, "step": 7, "g": 9.5,
                                "r": 1.0, "action": "record"})
        assert level == "warning"
        assert f"{kind} at step 7" in text and "g 9.5" in text
        assert meaning in text and f"What to do: {todo}" in text
    assert describe({"kind": "stability", "event": "grad_spike_end", "step": 8}) is None


def test_durations() -> None:
    assert [fmt_duration(s) for s in (None, 0.4, 59, 185, 7620)] == \
        ["-", "0s", "59s", "3m05s", "2h07m"]
    assert "ETA -" in progress_line(Progress(state="STOPPED", total_steps=10), now=0.0)


def test_a_long_checkpoint_error_is_one_short_line() -> None:
    long = "RuntimeError: " + "x" * 400 + "\nsecond line"
    level, text = describe({"kind": "checkpoint_failed", "step": 300, "reason": long})
    assert level == "warning" and "\n" not in text and len(text) < 200 and text.endswith("...")
