"""The straggler detector on the fake clock: who is named, when, and when cleared; the watch's
journal events, metrics and status; exclusion at a restart; and its inputs fuzzed."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeLog, make_context
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from orchestrator.config import Config
from orchestrator.config.schema import StragglerConfig
from orchestrator.journal.store import read_events
from orchestrator.contracts.protocol import RankInfo, RegisterRequest
from orchestrator.contracts.state import NodeState
from orchestrator.journal.status import build_status
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.generation.stragglers import (
    StragglerDetector,
    StragglerWatch,
    median_without,
)

CFG = StragglerConfig(margin=0.2, min_excess_s=0.01, window_s=30.0, check_every_s=5.0)


def feed(d: StragglerDetector, now: float, figures: dict[int, tuple[float, float | None]],
         ppn: int = 1) -> None:
    for rank, (step, wait) in figures.items():
        d.update(rank, f"n{rank // ppn}", step, wait, now)


def test_median_without_is_the_median_of_the_others() -> None:
    values = [0.1, 0.2, 0.2, 0.5, 3.0]
    for i, v in enumerate(values):
        others = values[:i] + values[i + 1:]
        assert median_without(values, v) == statistics.median(others)


def test_a_slow_data_rank_is_named_after_a_window_of_checks_and_not_before() -> None:
    d = StragglerDetector(CFG)
    t = 0.0
    named_at = None
    while t <= 60.0:
        # Synchronous training: every rank's step takes 1.0 s; rank 2 waits 0.4 s for data.
        feed(d, t, {0: (1.0, 0.01), 1: (1.0, 0.02), 2: (1.0, 0.4), 3: (1.0, 0.01)}, ppn=2)
        changes = d.evaluate(t)
        if changes:
            assert named_at is None
            named_at = t
            assert [c.action for c in changes] == ["named"]
            f = changes[0].finding
            assert f.node_id == "n1" and f.ranks == (2,)
            assert f.excess_s == pytest.approx(0.4 - 0.01)  # the median of 0.01, 0.02, 0.01
            assert f.peer_step_time_s == 1.0
        t += 5.0
    assert named_at == 30.0  # slow at 0, 5, ..., 30: a full window
    assert set(d.named) == {"n1"}


def test_a_rank_slow_at_one_check_is_not_named_and_the_window_restarts() -> None:
    d = StragglerDetector(CFG)
    slow = {0: (1.0, 0.0), 1: (1.6, 0.0), 2: (1.0, 0.0)}
    even = {0: (1.0, 0.0), 1: (1.0, 0.0), 2: (1.0, 0.0)}
    for t in (0.0, 5.0, 10.0, 15.0, 20.0, 25.0):
        feed(d, t, slow)
        assert d.evaluate(t) == []
    feed(d, 29.0, even)  # caught up once, just before the window closed
    assert d.evaluate(29.0) == []
    for t in (30.0, 35.0, 55.0):
        feed(d, t, slow)
        assert d.evaluate(t) == []
    feed(d, 59.0, slow)
    assert d.evaluate(59.0) == []  # 29 s since it turned slow again at 30
    feed(d, 60.0, slow)
    assert [c.action for c in d.evaluate(60.0)] == ["named"]


def test_within_the_margin_or_under_the_floor_is_not_slow() -> None:
    d = StragglerDetector(CFG)
    # 19 % slower: inside the 20 % margin.
    feed(d, 0.0, {0: (1.0, None), 1: (1.19, None), 2: (1.0, None)})
    assert d.findings(0.0) == {}
    # Tiny steps: 50 % slower, but 5 ms is under min_excess_s.
    d.reset()
    feed(d, 0.0, {0: (0.01, None), 1: (0.015, None), 2: (0.01, None)})
    assert d.findings(0.0) == {}
    d.reset()
    feed(d, 0.0, {0: (1.0, None), 1: (1.21, None), 2: (1.0, None)})
    assert set(d.findings(0.0)) == {"n1"}


def test_a_named_node_is_cleared_after_a_window_back_within_the_margin() -> None:
    d = StragglerDetector(CFG)
    for t in range(0, 35, 5):
        feed(d, float(t), {0: (1.0, 0.0), 1: (1.0, 0.5)})
        d.evaluate(float(t))
    assert set(d.named) == {"n1"}
    cleared = []
    for t in range(35, 80, 5):
        feed(d, float(t), {0: (1.0, 0.0), 1: (1.0, 0.0)})
        cleared += [(t, c.action) for c in d.evaluate(float(t))]
    assert cleared == [(65, "cleared")]
    assert d.named == {}


def test_stale_figures_and_a_lone_rank_name_nobody() -> None:
    d = StragglerDetector(CFG)
    feed(d, 0.0, {0: (1.0, 0.0), 1: (5.0, 0.0)})
    assert set(d.findings(0.0)) == {"n1"}
    assert d.findings(31.0) == {}  # both older than the window: nobody to compare
    feed(d, 40.0, {0: (1.0, 0.0)})
    assert d.findings(40.0) == {}  # one rank has no peers


def test_a_node_lists_every_slow_rank_and_reports_its_worst() -> None:
    d = StragglerDetector(CFG)
    feed(d, 0.0, {0: (1.0, 0.0), 1: (1.0, 0.0), 2: (1.0, 0.3), 3: (1.0, 0.6)}, ppn=2)
    f = d.findings(0.0)["n1"]
    assert f.ranks == (2, 3) and f.data_wait_s == 0.6


# -- the watch: journal, metrics, status, exclusion ----------------------------------------
class Watch:
    def __init__(self, root: Path, action: str = "record", spares: int = 0) -> None:
        self.cfg = Config.model_validate({
            "job": {"name": "t"}, "cluster": {"nodes": 2, "procs_per_node": 2,
                                              "spares": spares},
            "stragglers": {"window_s": 10.0, "check_every_s": 2.0, "action": action}})
        self.clock = FakeClock()
        self.log = FakeLog()
        self.ctx = make_context(root, self.cfg, self.clock, self.log)
        self.watch = StragglerWatch(self.ctx)
        self.nodes = NodeRegistry(self.clock, self.ctx.record)
        for i in range(2 + spares):
            node, _ = self.nodes.register(RegisterRequest(
                node_id=f"n{i}", host="h", addr="127.0.0.1", procs=2, agent_pid=100 + i))
            if i < 2:
                self.nodes.move(node, NodeState.ACTIVE, node_rank=i)
            else:
                self.nodes.move(node, NodeState.SPARE)

    def beat(self, waits: dict[int, float]) -> None:
        for node in ("n0", "n1"):
            base = 0 if node == "n0" else 2
            self.watch.on_ranks(node, [RankInfo(rank=r, local_rank=r - base, step_time=0.5,
                                                data_wait=waits.get(r, 0.01))
                                       for r in (base, base + 1)])

    def run(self, seconds: float, waits: dict[int, float]) -> None:
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.beat(waits)
            self.watch.tick(1)
            self.clock.advance(0.5)

    def events(self, kind: str) -> list[dict[str, Any]]:
        self.ctx.recorder.journal.flush()
        return [e for e in read_events(self.ctx.rundir.journal) if e["kind"] == kind]


def test_the_watch_journals_logs_and_exports_a_straggler_then_its_recovery(
        tmp_path: Path) -> None:
    w = Watch(tmp_path)
    w.run(14.0, {3: 0.3})
    named = w.events("straggler")
    assert [(e["action"], e["node_id"], e["ranks"]) for e in named] == [("named", "n1", [3])]
    assert named[0]["data_wait_s"] == 0.3 and named[0]["peer_data_wait_s"] == 0.01
    text = generate_latest(w.ctx.metrics.registry).decode()
    assert 'orchestrator_straggler_nodes{job="t"} 1.0' in text
    assert 'orchestrator_straggler_ranks{job="t"} 1.0' in text
    assert 'orchestrator_straggler_excess_seconds{job="t"} 0.29' in text
    assert 'orchestrator_straggler_events_total{action="named",job="t"} 1.0' in text
    status = build_status(w.ctx.view, w.ctx.rundir)
    assert [s["node_id"] for s in status["stragglers"]["named"]] == ["n1"]
    assert any(msg == "straggler named" for _, msg, _ in w.log.lines)
    w.run(14.0, {})
    assert [e["action"] for e in w.events("straggler")] == ["named", "cleared"]
    assert 'orchestrator_straggler_nodes{job="t"} 0.0' in generate_latest(
        w.ctx.metrics.registry).decode()
    assert build_status(w.ctx.view, w.ctx.rundir)["stragglers"]["named"] == []


def test_nothing_is_checked_before_check_every_s_nor_when_disabled(tmp_path: Path) -> None:
    w = Watch(tmp_path)
    w.watch.tick(1)  # starts the generation's first interval
    w.beat({3: 5.0})
    w.clock.advance(1.9)
    assert w.watch.tick(1) == [] and w.watch.detector.tracks == {}
    w.clock.advance(0.1)
    w.watch.tick(1)
    assert set(w.watch.detector.tracks) == {"n1"}  # the check ran: slow, not yet named
    off = Watch(tmp_path / "off")
    off.cfg.stragglers.enabled = False
    off.run(30.0, {3: 5.0})
    assert off.events("straggler") == [] and off.watch.detector.samples == {}


def test_exclude_takes_a_named_node_out_at_the_restart_when_a_spare_exists(
        tmp_path: Path) -> None:
    w = Watch(tmp_path, action="exclude", spares=1)
    w.run(14.0, {2: 0.4})
    assert w.watch.exclude_at_restart(w.nodes) == ["n1"]
    assert w.nodes.nodes["n1"].state is NodeState.EXCLUDED
    moved = [e for e in w.events("node_state") if e["node_id"] == "n1"][-1]
    assert moved["state"] == "excluded" and moved["reason"].startswith("straggler")
    assert [e["action"] for e in w.events("straggler")] == ["named", "excluded"]


def test_exclude_keeps_the_node_without_a_spare_and_record_never_excludes(
        tmp_path: Path) -> None:
    w = Watch(tmp_path / "a", action="exclude", spares=0)
    w.run(14.0, {2: 0.4})
    assert w.watch.exclude_at_restart(w.nodes) == []
    assert w.nodes.nodes["n1"].state is NodeState.ACTIVE
    assert any(msg.startswith("straggler kept") for _, msg, _ in w.log.lines)
    r = Watch(tmp_path / "b", action="record", spares=1)
    r.run(14.0, {2: 0.4})
    assert r.watch.exclude_at_restart(r.nodes) == []
    assert r.nodes.nodes["n1"].state is NodeState.ACTIVE


def test_a_restarted_supervisor_clears_what_its_predecessor_named(tmp_path: Path) -> None:
    w = Watch(tmp_path)
    w.run(14.0, {3: 0.3})
    assert [e["action"] for e in w.events("straggler")] == ["named"]
    w.ctx.recorder.journal.flush()
    again = Watch(tmp_path)  # the same run directory: the view is folded from the journal
    assert set(again.ctx.view.stragglers) == {"n1"}
    again.run(14.0, {})
    assert [e["action"] for e in again.events("straggler")] == ["named", "cleared"]
    assert again.ctx.view.stragglers == {}


def test_a_new_generation_forgets_the_last_ones_figures(tmp_path: Path) -> None:
    w = Watch(tmp_path)
    w.run(8.0, {3: 0.3})
    assert w.watch.detector.samples
    w.watch.tick(2)
    assert w.watch.detector.samples == {} and w.watch.detector.tracks == {}


# -- inputs fuzzed ----------------------------------------------------------------------------
CASES = 300
seconds = st.floats(min_value=0.0, max_value=7 * 86400.0, allow_nan=False)
figures = st.dictionaries(
    st.integers(min_value=0, max_value=63),
    st.tuples(seconds, st.none() | seconds, st.integers(min_value=0, max_value=7)),
    max_size=64)


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds=st.lists(figures, min_size=1, max_size=12),
       gaps=st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=12, max_size=12))
def test_any_figures_give_sane_findings(rounds: list[dict[int, Any]], gaps: list[float]) -> None:
    """Whatever ranks report (zero, huge, missing data waits, ranks moving between nodes),
    evaluation never raises; every named node was slow at this check; a finding's excess is
    above the margin and the floor; a node is named at most once until cleared."""
    d = StragglerDetector(CFG)
    now = 0.0
    named: set[str] = set()
    for rnd, gap in zip(rounds, gaps, strict=False):
        for rank, (step, wait, node) in rnd.items():
            d.update(rank, f"n{node}", step, wait, now)
        found = d.findings(now)
        for f in found.values():
            assert math.isfinite(f.excess_s)
            assert f.excess_s > CFG.margin * f.peer_step_time_s
            assert f.excess_s >= CFG.min_excess_s and f.ranks
        for change in d.evaluate(now):
            node = change.finding.node_id
            if change.action == "named":
                assert node not in named and node in found
                named.add(node)
            else:
                assert node in named and node not in found
                named.remove(node)
        assert set(d.named) == named
        now += gap


def test_a_node_registered_after_the_launch_can_take_the_stragglers_place(
        tmp_path: Path) -> None:
    """A spare's agent that registered after the first launch (a loaded host: 0.2 s late in
    a CI run) is REGISTERED, not yet SPARE, at the restart: it still lets the straggler go,
    and the health round before the next launch makes it the spare that takes the rank."""
    w = Watch(tmp_path, action="exclude", spares=0)
    w.run(14.0, {2: 0.4})
    assert w.watch.exclude_at_restart(w.nodes) == []  # nobody to take the rank yet
    late, _ = w.nodes.register(RegisterRequest(node_id="n2", host="h", addr="127.0.0.1",
                                                procs=2, agent_pid=102))
    assert late.state is NodeState.REGISTERED
    assert w.watch.exclude_at_restart(w.nodes) == ["n1"]
    assert w.nodes.nodes["n1"].state is NodeState.EXCLUDED
