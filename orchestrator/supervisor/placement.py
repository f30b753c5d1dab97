"""Which nodes hold the job's node ranks, and which wait as spares (a pure function)."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.contracts.state import NodeState
from orchestrator.supervisor.nodes import NodeRecord


@dataclass(frozen=True)
class Placement:
    active: dict[str, int]  # node_id -> node rank
    spares: list[str] = field(default_factory=list)
    missing: int = 0  # node ranks nobody could take

    @property
    def complete(self) -> bool:
        return self.missing == 0


def place(nodes: list[NodeRecord], needed: int, procs_per_node: int) -> Placement:
    """Keep node ranks where they are; fill vacated ranks from spares, then new nodes.

    Keeping ranks stable means a restart after a rank crash reuses every node as it was;
    only a node that is lost or excluded hands its rank to a spare. The world size never
    changes: a job short of nodes waits or fails rather than shrinking.
    """
    usable = [n for n in nodes if n.usable and n.procs >= procs_per_node]
    usable.sort(key=lambda n: id_key(n.node_id))
    active: dict[str, int] = {}
    taken: set[int] = set()
    for n in usable:
        if n.node_rank is not None and n.node_rank < needed and n.node_rank not in taken \
                and n.state is NodeState.ACTIVE:
            active[n.node_id] = n.node_rank
            taken.add(n.node_rank)
    free_ranks = [r for r in range(needed) if r not in taken]
    # Spares first: they were held back for exactly this.
    candidates = [n for n in usable if n.node_id not in active]
    candidates.sort(key=lambda n: (n.state is not NodeState.SPARE, id_key(n.node_id)))
    for rank, node in zip(free_ranks, candidates, strict=False):
        active[node.node_id] = rank
    spares = [n.node_id for n in usable if n.node_id not in active]
    return Placement(active, spares, max(0, needed - len(active)))


def id_key(node_id: str) -> tuple:
    """The order nodes are placed, checked and reported in: "local-10" sorts after
    "local-9" (the numeric tail compared as a number)."""
    head, _, tail = node_id.rpartition("-")
    return (head, int(tail), "") if tail.isdigit() else (node_id, -1, node_id)
