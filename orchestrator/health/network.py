"""The network test's schedule and verdicts (pure functions; the ranks are ``netcheck``).

Pairwise exchanges run around a ring of nodes: node i exchanges with node i+1, every node in
at most one pair per round, so a ring of any size takes two or three rounds and its links
are measured without contending with each other. A node's NIC (or cable, or switch port)
going slow shows in both its links; a link is slow below ``link_relative`` x the fastest link
(or below the absolute ``link_gbps`` floor). Attribution:

- a node with two or more partners whose every link is slow is *named* (it fails);
- a slow link that no named node explains fails both its ends only when it is below the
  absolute floor (with two nodes there is only one link, so the slow end cannot be told
  apart; one link slow only relative to the others is noted, not failed, since one noisy
  measurement must not take two nodes out).

The all-reduce's bus bandwidth (``2 (n-1)/n x size / time``, as nccl-tests reports it) fails
every participant when it is below its floor and no named node explains it.

A partitioned network (``reach``: some pairs cannot connect at all) has no bandwidth figures:
an unreachable link counts as slow and below any floor, so a node that reaches none of its
peers is named, and a single cut link fails both its ends; the all-reduce is not judged.
"""

from __future__ import annotations

from typing import Any

from orchestrator.health.base import Outcome, failed, passed
from orchestrator.health.config import HealthFloors


def ring_links(n: int) -> list[tuple[int, int]]:
    """Node index pairs (i, i+1 mod n); two nodes share a single link."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The ring's links in rounds where no node is in two pairs at once."""
    links = ring_links(n)
    if len(links) <= 1:
        return [links] if links else []
    last = [links[-1]] if n % 2 else []  # an odd ring closes with a third round
    body = links[:-1] if n % 2 else links
    rounds = [[lk for i, lk in enumerate(body) if i % 2 == 0],
              [lk for i, lk in enumerate(body) if i % 2 == 1], last]
    return [r for r in rounds if r]


def judge_network(nodes: list[str], measured: dict[str, Any] | None,
                  floors: HealthFloors) -> dict[str, dict[str, Outcome]]:
    """``{node_id: {"network.allreduce": Outcome, "network.pairwise": Outcome}}``.

    ``measured`` is a netcheck report: ``allreduce_gbps`` and ``links`` (``a``, ``b``,
    ``gbps``), or None when the test produced nothing (every node fails both checks).
    """
    if not measured:
        return {n: {"network.allreduce": failed("the network test produced no measurement"),
                    "network.pairwise": failed("the network test produced no measurement")}
                for n in nodes}
    links = [lk for lk in measured.get("links", []) if lk["a"] in nodes and lk["b"] in nodes]
    best = max((lk["gbps"] for lk in links if lk.get("gbps") is not None), default=0.0)

    def cut(lk: dict[str, Any]) -> bool:
        return lk.get("reachable") is False

    def slow(lk: dict[str, Any]) -> bool:
        if cut(lk) or lk.get("gbps") is None:
            return cut(lk)
        return (floors.link_gbps is not None and lk["gbps"] < floors.link_gbps) or \
            lk["gbps"] < floors.link_relative * best

    def below_floor(lk: dict[str, Any]) -> bool:
        return cut(lk) or (floors.link_gbps is not None and lk.get("gbps") is not None
                           and lk["gbps"] < floors.link_gbps)

    mine = {n: [lk for lk in links if n in (lk["a"], lk["b"])] for n in nodes}
    named = {n for n, ls in mine.items()
             if len({_peer(lk, n) for lk in ls}) >= 2 and all(slow(lk) for lk in ls)}
    out: dict[str, dict[str, Outcome]] = {}
    for n in nodes:
        desc = ", ".join(f"to {_peer(lk, n)} {_speed(lk)}" for lk in mine[n])
        details = {"links": {_peer(lk, n): None if lk.get("gbps") is None else
                             round(lk["gbps"], 3) for lk in mine[n]},
                   "best_link_gbps": round(best, 3)}
        if any(cut(lk) for lk in mine[n]):
            details["unreachable"] = sorted(_peer(lk, n) for lk in mine[n] if cut(lk))
        unexplained = [lk for lk in mine[n] if below_floor(lk) and not
                       ({lk["a"], lk["b"]} & named)]
        if n in named:
            pair = failed(f"every link of this node is slow ({desc}; the fastest link is "
                          f"{best:.2f} GB/s)", **details)
        elif unexplained:
            peers = ", ".join(_peer(lk, n) for lk in unexplained)
            floor = "unreachable" if all(cut(lk) for lk in unexplained) else \
                f"below the {floors.link_gbps:g} GB/s floor"
            pair = failed(f"link to {peers} {floor} ({desc}); no single node explains it, so "
                          "both ends fail", **details)
        elif not mine[n]:
            pair = passed("no pairwise link measured (one node)", **details)
        else:
            notes = [lk for lk in mine[n] if slow(lk)]
            pair = passed(desc + (f" (slow link to {', '.join(_peer(lk, n) for lk in notes)}"
                                  " explained by another node or noted only)" if notes else ""),
                          **details)
        out[n] = {"network.allreduce": _allreduce(measured, floors, named),
                  "network.pairwise": pair}
    return out


def _allreduce(measured: dict[str, Any], floors: HealthFloors, named: set[str]) -> Outcome:
    gbps = measured.get("allreduce_gbps")
    world = measured.get("world_size")
    if measured.get("partitioned"):
        return passed("not run: some nodes cannot reach each other (network.pairwise names "
                      "them)", world_size=world)
    if gbps is None:
        return passed(f"no all-reduce: a world of {world} rank(s)", world_size=world)
    details = {"busbw_gbps": round(gbps, 3), "world_size": world}
    text = f"bus bandwidth {gbps:.2f} GB/s over {world} ranks"
    floor = floors.allreduce_gbps
    if floor is not None and gbps < floor:
        if named:
            return passed(f"{text}, below the {floor:g} GB/s floor, explained by slow node(s) "
                          f"{', '.join(sorted(named))}", **details)
        return failed(f"{text}, floor {floor:g} GB/s", **details)
    return passed(text, **details)


def _speed(link: dict[str, Any]) -> str:
    if link.get("reachable") is False:
        return f"unreachable ({link.get('error') or 'no connection'})"[:200]
    return "not measured" if link.get("gbps") is None else f"{link['gbps']:.2f} GB/s"


def _peer(link: dict[str, Any], node: str) -> str:
    return link["b"] if link["a"] == node else link["a"]
