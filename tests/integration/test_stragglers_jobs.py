"""Stragglers in real jobs: chaos slows every step of one rank (``chaos.slow_ranks``), and
the supervisor names that rank's node from the figures the ranks' heartbeats carry, with
DDP and with FSDP2 (whose subgroups our detection never touches: it adds no collective);
with ``action: exclude`` and a spare, the named node is taken out at the next restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jobs import journal, status, up, write_config

pytestmark = pytest.mark.slow

# Checked every half second, named after 3 s slow: a test-sized window.
DETECT = {"window_s": 3.0, "check_every_s": 0.5, "margin": 0.2, "min_excess_s": 0.01}
SLOW_S = 0.15  # added to every step of the slow rank


def _node_of_rank(launch: dict[str, Any], rank: int) -> str:
    return next(node for node, node_rank in launch["nodes"].items() if node_rank == rank)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_slow_ranks_node_is_named(tmp_path: Path, dataset_dir: Path,
                                      strategy: str) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       trainer={"steps": 120, "parallelism": {"strategy": strategy}},
                       checkpoint={"interval_steps": 1000},
                       stragglers=DETECT, chaos={"slow_ranks": {1: SLOW_S}})
    result = up(cfg, tmp_path / "run", timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(tmp_path / "run")
    [launch] = [e for e in events if e["kind"] == "generation_launched"]
    named = [e for e in events if e["kind"] == "straggler" and e["action"] == "named"]
    assert named, "no straggler named"
    slow_node = _node_of_rank(launch, 1)
    # Only the slow rank's node, only for the slow rank: rank 0's node is never named.
    assert {(e["node_id"], tuple(e["ranks"])) for e in named} == {(slow_node, (1,))}
    first = named[0]
    assert first["excess_s"] > DETECT["margin"] * first["peer_step_time_s"]
    assert first["step_time_s"] > first["peer_step_time_s"]
    st = status(tmp_path / "run")
    assert [s["node_id"] for s in st["stragglers"]["named"]] == [slow_node]
    assert "straggler named" in (tmp_path / "run" / "supervisor.log").read_text()


def test_exclude_replaces_the_straggler_with_the_spare_at_the_restart(
        tmp_path: Path, dataset_dir: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, cluster={"spares": 1},
                       trainer={"steps": 140}, checkpoint={"interval_steps": 20},
                       stragglers={**DETECT, "action": "exclude"},
                       chaos={"slow_ranks": {1: SLOW_S}, "kill": [{"step": 100, "rank": 0}]})
    result = up(cfg, tmp_path / "run", timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    events = journal(tmp_path / "run")
    launches = [e for e in events if e["kind"] == "generation_launched"]
    assert len(launches) == 2
    slow_node = _node_of_rank(launches[0], 1)
    # The spare: the launch waits for the job's nodes only, so under load the third node
    # may register after generation 1 launched (a spare of the next placement then).
    spare = next(n for n in launches[1]["nodes"] if n not in launches[0]["nodes"])
    assert launches[0]["spares"] in ([], [spare])

    def first(pred: Any) -> int:
        return next(i for i, e in enumerate(events) if pred(e))

    # Named during generation 1, then its failure, then excluded before generation 2.
    named = first(lambda e: e["kind"] == "straggler" and e["action"] == "named"
                  and e["node_id"] == slow_node)
    failed = first(lambda e: e["kind"] == "failure")
    excluded = first(lambda e: e["kind"] == "straggler" and e["action"] == "excluded")
    relaunched = first(lambda e: e["kind"] == "generation_launched" and e["generation"] == 2)
    assert named < failed < excluded < relaunched
    assert first(lambda e: e["kind"] == "node_registered" and e["node_id"] == spare) < excluded
    assert events[excluded]["node_id"] == slow_node
    moved = [e for e in events if e["kind"] == "node_state" and e["node_id"] == slow_node]
    assert moved[-1]["state"] == "excluded" and moved[-1]["reason"].startswith("straggler")
    assert slow_node not in launches[1]["nodes"]
    assert launches[1]["nodes"][spare] == 1  # the spare took the straggler's node rank
    assert status(tmp_path / "run")["state"] == "COMPLETED"
