"""The network test on a partitioned network: the reachability probe between real sockets
through a real TCPStore (one rank never reaches the rendezvous), the merged table, and the
judge naming the node that reaches none of its peers (a single cut link fails both ends)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.health.config import HealthFloors
from orchestrator.health.network import judge_network, ring_links
from orchestrator.health.reach import merge, probe
from servers import free_port

NODES = ["n-0", "n-1", "n-2", "n-3"]


def partitioned(*reachable: bool) -> dict:
    return {"world_size": len(NODES), "allreduce_gbps": None, "partitioned": True,
            "links": [{"a": NODES[a], "b": NODES[b], "gbps": None, "reachable": ok,
                       "error": None if ok else "TimeoutError: timed out"}
                      for (a, b), ok in zip(ring_links(len(NODES)), reachable, strict=True)]}


def failing(out: dict) -> list[str]:
    return sorted(n for n, v in out.items() if not v["network.pairwise"].ok)


def test_the_node_that_reaches_none_of_its_peers_is_named() -> None:
    # ring 0-1, 1-2, 2-3, 3-0: n-1 reaches neither n-0 nor n-2.
    out = judge_network(NODES, partitioned(False, False, True, True), HealthFloors())
    assert failing(out) == ["n-1"]
    msg = out["n-1"]["network.pairwise"].message
    assert "every link of this node is slow" in msg and "unreachable" in msg
    assert out["n-1"]["network.pairwise"].details["unreachable"] == ["n-0", "n-2"]
    assert all(v["network.allreduce"].ok for v in out.values())  # not judged: no figure
    assert "not run" in out["n-0"]["network.allreduce"].message


def test_one_cut_link_fails_both_its_ends() -> None:
    out = judge_network(NODES, partitioned(True, True, False, True), HealthFloors())
    assert failing(out) == ["n-2", "n-3"]
    assert "unreachable" in out["n-2"]["network.pairwise"].message


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=4, max_size=4))
def test_only_nodes_with_a_cut_link_ever_fail(reachable: list[bool]) -> None:
    out = judge_network(NODES, partitioned(*reachable), HealthFloors())
    cut = {n for (a, b), ok in zip(ring_links(4), reachable, strict=True) if not ok
           for n in (NODES[a], NODES[b])}
    assert set(failing(out)) <= cut
    assert bool(failing(out)) == bool(cut)


def test_merge_takes_any_failed_probe_and_a_silent_pair_as_unreachable() -> None:
    published = {0: [{"a": 0, "b": 1, "rank": 0, "error": None},
                     {"a": 3, "b": 0, "rank": 0, "error": "refused"}],
                 1: [{"a": 0, "b": 1, "rank": 1, "error": None},
                     {"a": 1, "b": 2, "rank": 1, "error": None}]}
    table = merge(published, NODES, 1, 4)
    by = {(lk["a"], lk["b"]): lk["reachable"] for lk in table["links"]}
    assert by == {("n-0", "n-1"): True, ("n-1", "n-2"): True, ("n-2", "n-3"): False,
                  ("n-3", "n-0"): False}
    assert table["missing"] == [2, 3]


def test_a_rank_that_never_reaches_the_rendezvous_cuts_its_links() -> None:
    import torch.distributed as dist

    port = free_port()
    # Four nodes, "c" cut off: "b" waits for it first (ring order) and must still see "d",
    # which arrived meanwhile, once its wait for "c" has used the arrival window up.
    nodes = ["a", "b", "c", "d"]
    spec = {"nodes": nodes, "addrs": ["127.0.0.1"] * 4, "ppn": 1}
    results: dict[int, dict] = {}

    def rank(r: int) -> None:
        if r == 1:
            time.sleep(1.5)  # a slower start, within the arrival window: not cut off
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=r == 0,
                              timeout=timedelta(seconds=20), wait_for_workers=False)
        results[r] = probe(store, spec, r, 4, 0, arrival_s=3.0, connect_s=1.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1, 3)]  # 2 is cut off
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results[0] == results[1] == results[3]
    by = {(lk["a"], lk["b"]): lk["reachable"] for lk in results[0]["links"]}
    assert by == {("a", "b"): True, ("b", "c"): False, ("c", "d"): False, ("d", "a"): True}
    assert results[0]["missing"] == [2]
    out = judge_network(nodes, {"world_size": 4, "partitioned": True, "links": [
        {**lk, "gbps": None} for lk in results[0]["links"]]}, HealthFloors())
    assert failing(out) == ["c"]
