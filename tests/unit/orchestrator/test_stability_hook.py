"""The supervisor's stability hook over scripted heartbeat records: journal, metrics, the
divergence outcome, the rollback it carries out, and its state across a supervisor restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeLog, begin_generation, make_context, make_intake
from prometheus_client import CollectorRegistry

from orchestrator.config import Config
from orchestrator.contracts.events import GenerationLaunched
from orchestrator.journal.store import read_events
from orchestrator.journal.view import JobView
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.state import Cause
from orchestrator.journal.status import build_status
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.stability import CACHE_NAME, StabilityHook
from trainer.checkpoint import layout

STABILITY = {"warmup_steps": 5, "grad_spike": {"window": 5, "mode": "relative",
                                               "rel_margin": 4.0, "action": "rollback"},
             "rollback": {"skip_batches": 5, "max_rollbacks": 1, "window_steps": 100}}


class FakeSupervisor:
    """What the hook and the intake take (a job context), with a real journal and metrics."""

    def __init__(self, root: Path, **sections: Any) -> None:
        self.cfg = Config.model_validate({"job": {"name": "t"},
                                          "checkpoint": {"interval_steps": 10, "keep_last": 3},
                                          "stability": STABILITY, **sections})
        self.rundir = RunDir(root)
        self.clock = FakeClock()
        self.registry = CollectorRegistry()
        self.log = FakeLog()
        self.ctx = make_context(root, self.cfg, self.clock, self.log, self.registry)
        self.journal = self.ctx.recorder.journal
        self.checkpoint_root = self.ctx.checkpoint_root
        self.stability = StabilityHook(self.ctx)

    @property
    def view(self) -> JobView:
        return self.ctx.view

    def record(self, event: Any) -> Any:
        return self.ctx.record(event, durable=True)

    def beat(self, generation: int, records: list[dict[str, Any]]) -> None:
        """What ProgressTracker then the hook do with one heartbeat's records."""
        with open(self.rundir.steps, "a") as f:
            for rec in records:
                f.write(json.dumps({"generation": generation, **rec}) + "\n")
        self.stability.on_records(generation, records)
        self.journal.flush()  # the tests read the file back

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"job": "t", **labels})


def records(first: int, last: int, spikes: dict[int, float] | None = None,
            shift: int = 0) -> list[dict[str, Any]]:
    out = []
    for s in range(first, last + 1):
        r = {"step": s, "loss": 2.0, "grad_norm": (spikes or {}).get(s, 1.0 + 0.01 * (s % 3)),
             "batch": s - 1 + shift, "lr": 1e-3}
        if s % 10 == 0:
            r["ckpt_block_s"] = 0.01
        out.append(r)
    return out


def make_checkpoints(root: str, committed: list[int], debris: list[int]) -> Path:
    job = Path(root) / "t"
    for step in committed + debris:
        d = job / layout.step_dir_name(step)
        d.mkdir(parents=True)
        (d / "data.distcp").write_bytes(b"x")
        if step in committed:
            (d / layout.MANIFEST).write_text("{}")
    return job


@pytest.fixture
def sup(tmp_path: Path) -> FakeSupervisor:
    return FakeSupervisor(tmp_path)


def test_a_rollback_rule_is_journaled_counted_logged_and_pending(sup: FakeSupervisor) -> None:
    sup.beat(1, records(1, 24))
    assert sup.stability.divergence(1) is None
    sup.beat(1, records(25, 27, {25: 900.0}))
    fired = [e for e in read_events(sup.rundir.journal) if e["kind"] == "stability"]
    spike = next(e for e in fired if e["event"] == "grad_spike")
    assert (spike["step"], spike["batch"], spike["action"]) == (25, 24, "rollback")
    assert spike["grad_norm"] == 900.0 and spike["threshold"] < 10
    assert sup.metric("orchestrator_grad_norm_spikes_total") == 1
    assert sup.metric("orchestrator_stability_events_total", kind="grad_spike") == 1
    assert sup.metric("orchestrator_grad_norm_running_mean") == pytest.approx(1.01, abs=0.02)
    assert any(msg == "stability rule fired" and kw["kind"] == "grad_spike"
               for _, msg, kw in sup.log.lines)
    detail = sup.stability.divergence(1)
    assert detail is not None and detail["onset_step"] == 25 and "[24, 29)" in detail["message"]
    assert sup.stability.divergence(2) is None  # only the generation that diverged
    assert sup.view.stability_counts["grad_spike"] == 1


def test_judge_turns_a_pending_rollback_into_a_divergence_outcome(sup: FakeSupervisor) -> None:
    intake = make_intake(sup.ctx, NodeRegistry(sup.clock), sup.stability)
    gen = begin_generation(intake, 1, 1)
    assert gen.judge([]) is None
    sup.beat(1, records(1, 24) + records(25, 25, {25: 900.0}))
    outcome = gen.judge([])
    assert outcome is not None and outcome.cause is Cause.DIVERGENCE
    assert outcome.detail["step"] == 25


def test_roll_back_discards_the_abandoned_lineage_and_journals_the_window(
        sup: FakeSupervisor) -> None:
    job = make_checkpoints(sup.checkpoint_root, committed=[10, 20, 30], debris=[40])
    sup.beat(1, records(1, 24) + records(25, 33, {25: 900.0}))
    assert sup.stability.refusal(sup.view, 1) is None
    event = sup.stability.roll_back(sup.view, {"generation": 1, "last_step": 33})
    assert event is not None
    assert sorted(p.name for p in job.iterdir()) == ["step-00000010", "step-00000020"]
    assert event["restore_step"] == 20 and event["restore_max_step"] == 24
    assert event["discarded_checkpoints"] == [30, 40]
    assert event["skip_window"] == [24, 29] and event["wasted_steps"] == 13
    assert sup.stability.resume_limit() == 24
    assert sup.view.skip_windows == [[24, 29]] and sup.view.lr_scale == 1.0
    assert 30 in sup.view.pruned_steps
    assert sup.metric("orchestrator_rollbacks_total") == 1
    assert sup.stability.roll_back(sup.view, {"generation": 1}) is None  # carried out once


def test_a_second_rollback_within_the_window_is_refused(sup: FakeSupervisor) -> None:
    make_checkpoints(sup.checkpoint_root, committed=[10, 20], debris=[])
    sup.beat(1, records(1, 24) + records(25, 26, {25: 900.0}))
    sup.stability.roll_back(sup.view, {"generation": 1, "last_step": 26})
    sup.journal.flush()
    sup.beat(2, records(21, 24) + records(25, 27, {27: 900.0}, shift=5))
    assert sup.stability.divergence(2)["onset_step"] == 27
    reason = sup.stability.refusal(sup.view, 2)
    assert reason is not None and "rollback budget spent" in reason
    assert sup.stability.refusal(sup.view, 1) is None  # not the generation that failed


def test_a_late_plan_of_a_handled_generation_is_not_carried_out(sup: FakeSupervisor) -> None:
    sup.beat(1, records(1, 24) + records(25, 25, {25: 900.0}))
    assert sup.stability.roll_back(sup.view, {"generation": 2, "last_step": 30}) is None
    sup.journal.flush()
    assert sup.stability.resume_limit() is None
    assert not [e for e in read_events(sup.rundir.journal) if e["kind"] == "rollback"]


def test_a_skipped_update_is_journaled(tmp_path: Path) -> None:
    sup = FakeSupervisor(tmp_path, stability={**STABILITY, "grad_spike": {
        "window": 5, "mode": "relative", "rel_margin": 4.0, "action": "skip_step"}})
    sup.beat(1, records(1, 24) + [{**records(25, 25, {25: 900.0})[0], "skipped": True}])
    skipped = [e for e in read_events(sup.rundir.journal)
               if e["kind"] == "stability" and e["event"] == "update_skipped"]
    assert [(e["step"], e["batch"], e["grad_norm"]) for e in skipped] == [(25, 24, 900.0)]
    assert sup.stability.divergence(1) is None
    assert sup.metric("orchestrator_stability_events_total", kind="update_skipped") == 1


def test_a_restarted_supervisor_rebuilds_the_same_state(tmp_path: Path) -> None:
    first = FakeSupervisor(tmp_path)
    first.beat(1, records(1, 24))
    first.beat(1, records(25, 27, {25: 900.0}))  # an event: the cache is written
    first.beat(1, records(28, 31))  # no event, clock still: only steps.jsonl has these
    expected = first.stability.lineage.state_dict()
    cached = json.loads((tmp_path / CACHE_NAME).read_text())
    assert cached["lineage"]["last_step"] == 27
    first.journal.close()

    again = FakeSupervisor(tmp_path)  # cache + the tail of steps.jsonl
    assert again.stability.lineage.state_dict() == expected
    again.journal.close()
    (tmp_path / CACHE_NAME).unlink()
    replayed = FakeSupervisor(tmp_path)  # no cache: the whole of steps.jsonl
    assert replayed.stability.lineage.state_dict() == expected
    (tmp_path / CACHE_NAME).write_text('{"version": 1, "steps_offset": 99999999}')
    stale = FakeSupervisor(tmp_path)  # a cache past the file's end is not trusted
    assert stale.stability.lineage.state_dict() == expected


def test_status_reports_the_stability_picture(sup: FakeSupervisor) -> None:
    sup.rundir.config.write_text(json.dumps(sup.cfg.model_dump(mode="json")))
    make_checkpoints(sup.checkpoint_root, committed=[10, 20], debris=[])
    sup.beat(1, records(1, 24) + records(25, 26, {25: 900.0}))
    sup.stability.roll_back(sup.view, {"generation": 1, "last_step": 26})
    sup.journal.flush()
    sup.beat(2, records(21, 24) + records(25, 30, shift=5))
    st = build_status(JobView.from_events(read_events(sup.rundir.journal)), sup.rundir)
    stab = st["stability"]
    assert stab["step"] == 30 and stab["last_grad_norm"] == pytest.approx(1.0)
    assert stab["running_mean"] == pytest.approx(1.01, abs=0.02)
    assert stab["spikes_total"] == 0  # the lineage rolled back past the spike
    assert stab["events"]["grad_spike"] == 1
    assert [(r["event"], r["onset_step"], r["restore_step"], r["skip_window"])
            for r in stab["rollbacks"]] == [("grad_spike", 25, 20, [24, 29])]
    assert stab["skip_windows"] == [[24, 29]]


def test_a_step_committed_again_after_a_rollback_counts_as_committed() -> None:
    view = JobView.from_events([
        {"kind": "checkpoint_committed", "step": 30, "path": "a"},
        {"kind": "checkpoint_pruned", "steps": [30], "reason": "rollback"},
    ])
    assert view.newest_checkpoint_step is None
    view.apply({"kind": "checkpoint_committed", "step": 30, "path": "b"})
    assert view.newest_checkpoint_step == 30


def test_a_supervisor_restarted_mid_divergence_still_rolls_back(tmp_path: Path) -> None:
    first = FakeSupervisor(tmp_path)
    first.record(GenerationLaunched(generation=1, world_size=1))
    first.beat(1, records(1, 24) + records(25, 27, {25: 900.0}))
    plan = first.stability.pending
    first.journal.close()
    again = FakeSupervisor(tmp_path)  # died before the rollback was carried out
    assert again.stability.pending == plan
    assert again.stability.divergence(1)["onset_step"] == 25
    again.stability.roll_back(again.view, {"generation": 1, "last_step": 27})
    again.journal.close()
    after = FakeSupervisor(tmp_path)  # the rollback is in the journal: nothing pending
    assert after.stability.pending is None


def test_records_after_a_pending_rollback_fire_nothing_more(sup: FakeSupervisor) -> None:
    # The ranks train on for a heartbeat or two after the rollback is decided: a second
    # spike in that abandoned stretch is neither journaled nor a second plan.
    sup.beat(1, records(1, 24) + records(25, 26, {25: 900.0}))
    plan = sup.stability.pending
    assert plan is not None
    sup.beat(1, records(27, 31) + records(32, 32, {32: 5000.0}))
    spikes = [e for e in read_events(sup.rundir.journal)
              if e["kind"] == "stability" and e["event"] == "grad_spike"]
    assert [e["step"] for e in spikes] == [25]
    # 26 (the rest of the beat that decided it) and 27..32
    assert sup.stability.pending == plan and sup.stability.abandoned_records == 7


def test_records_of_a_rolled_back_generation_arriving_late_fire_nothing(
        tmp_path: Path) -> None:
    # An agent relays what its ranks sent before the stop with its next beat: CI saw that
    # beat land in RECOVERING, after the rollback was carried out and nothing was pending.
    sup = FakeSupervisor(tmp_path)
    make_checkpoints(sup.checkpoint_root, committed=[10, 20], debris=[])
    sup.beat(1, records(1, 24) + records(25, 26, {25: 900.0}))
    sup.stability.roll_back(sup.view, {"generation": 1, "last_step": 26})
    assert sup.stability.pending is None
    sup.beat(1, records(27, 31) + records(32, 32, {32: 5000.0}))
    sup.journal.flush()
    spikes = [e for e in read_events(sup.rundir.journal)
              if e["kind"] == "stability" and e["event"] == "grad_spike"]
    assert [(e["generation"], e["step"]) for e in spikes] == [(1, 25)]
    assert sup.stability.pending is None and sup.stability.abandoned_records == 7
    sup.journal.close()
    # A supervisor restarted from that journal knows generation 1 was rolled back.
    again = FakeSupervisor(tmp_path)
    assert again.stability.rolled_back == 1
    again.beat(1, records(33, 33, {33: 9000.0}))
    assert again.stability.pending is None and again.stability.abandoned_records == 1
    again.beat(2, records(21, 24) + records(25, 27, {27: 900.0}, shift=5))
    assert again.stability.divergence(2)["onset_step"] == 27
