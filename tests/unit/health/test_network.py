"""The network test's ring schedule, bandwidth arithmetic and attribution of a slow node."""

from __future__ import annotations

import pytest

from orchestrator.health.config import HealthFloors
from orchestrator.health.netcheck import summarize
from orchestrator.health.network import judge_network, ring_links, ring_rounds

NODES = ["n-0", "n-1", "n-2", "n-3"]


@pytest.mark.parametrize("n", range(1, 10))
def test_ring_rounds_cover_each_link_once_without_overlap(n: int) -> None:
    rounds = ring_rounds(n)
    flat = [lk for r in rounds for lk in r]
    assert sorted(flat) == sorted(ring_links(n))
    assert len(rounds) <= 3
    for r in rounds:
        ends = [x for lk in r for x in lk]
        assert len(ends) == len(set(ends))
    if n >= 3:  # every node has two distinct partners
        assert all(len({b if a == i else a for a, b in flat if i in (a, b)}) == 2
                   for i in range(n))


def links(*gbps: float, nodes: list[str] = NODES) -> dict:
    """A netcheck table for the ring over ``nodes`` with these link bandwidths."""
    n = len(nodes)
    return {"world_size": len(nodes), "allreduce_gbps": 1.0,
            "links": [{"a": nodes[a], "b": nodes[b], "gbps": g}
                      for (a, b), g in zip(ring_links(n), gbps, strict=True)]}


def test_a_node_whose_every_link_is_slow_is_named() -> None:
    # ring n-0 - n-1 - n-2 - n-3 - n-0; n-2 is slow: links 1-2 and 2-3.
    out = judge_network(NODES, links(10.0, 1.0, 1.2, 9.5), HealthFloors())
    assert [n for n, v in out.items() if not v["network.pairwise"].ok] == ["n-2"]
    msg = out["n-2"]["network.pairwise"].message
    assert msg.startswith("every link of this node is slow (to n-1 1.00 GB/s, to n-3 1.20 GB/s")
    assert "explained by another node" in out["n-1"]["network.pairwise"].message
    assert out["n-0"]["network.pairwise"].details["links"] == {"n-1": 10.0, "n-3": 9.5}


def test_one_noisy_link_takes_no_node_out() -> None:
    out = judge_network(NODES, links(10.0, 4.0, 9.0, 9.5), HealthFloors())
    assert all(v["network.pairwise"].ok for v in out.values())


def test_a_link_below_the_absolute_floor_fails_both_ends() -> None:
    out = judge_network(NODES, links(10.0, 4.0, 9.0, 9.5), HealthFloors(link_gbps=5.0))
    assert sorted(n for n, v in out.items() if not v["network.pairwise"].ok) == ["n-1", "n-2"]
    assert "no single node explains it" in out["n-1"]["network.pairwise"].message


def test_two_nodes_share_one_link() -> None:
    two = ["a-0", "a-1"]
    fine = judge_network(two, links(3.0, nodes=two), HealthFloors())
    assert all(v["network.pairwise"].ok for v in fine.values())
    slow = judge_network(two, links(0.1, nodes=two), HealthFloors(link_gbps=1.0))
    assert all(not v["network.pairwise"].ok for v in slow.values())


def test_allreduce_floor_and_its_explanation() -> None:
    m = links(10.0, 1.0, 1.2, 9.5)
    m["allreduce_gbps"] = 0.5
    floors = HealthFloors(allreduce_gbps=2.0)
    explained = judge_network(NODES, m, floors)
    assert all(v["network.allreduce"].ok for v in explained.values())
    assert "explained by slow node(s) n-2" in explained["n-0"]["network.allreduce"].message
    m = links(10.0, 9.0, 9.2, 9.5)
    m["allreduce_gbps"] = 0.5
    cluster_wide = judge_network(NODES, m, floors)
    assert all(not v["network.allreduce"].ok for v in cluster_wide.values())
    assert cluster_wide["n-3"]["network.allreduce"].message == (
        "bus bandwidth 0.50 GB/s over 4 ranks, floor 2 GB/s")


def test_no_measurement_fails_everyone() -> None:
    out = judge_network(NODES, None, HealthFloors())
    assert all(not c.ok for v in out.values() for c in v.values())


def test_bandwidth_arithmetic_takes_the_slowest_rank_of_a_pair() -> None:
    spec = {"allreduce_mib": 64, "pairwise_mib": 16}
    # 2 nodes x 2 ranks; the pair's slowest rank took 0.01 s for 16 MiB each way.
    table = [{"rank": r, "allreduce_s": 0.1 if r else 0.08,
              "pairs": [{"a": 0, "b": 1, "s": 0.01 if r == 3 else 0.008}]} for r in range(4)]
    out = summarize(table, ["x-0", "x-1"], 2, {**spec, "backend": "gloo"})
    assert out["links"] == [{"a": "x-0", "b": "x-1", "gbps": pytest.approx(2 * 16 * 2**20 / 0.01
                                                                           / 1e9)}]
    assert out["allreduce_gbps"] == pytest.approx(64 * 2**20 * 2 * 3 / 4 / 0.1 / 1e9)
