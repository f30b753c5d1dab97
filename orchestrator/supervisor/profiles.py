"""Profiling on demand, the supervisor's side: the operator's request becomes node orders.

``POST /v1/profile`` (``orchestrator profile``) asks ranks of the running generation for a
``torch.profiler`` trace of their next N steps. The supervisor picks the first step,
``start_step``, ahead of the newest step any rank reported by as many steps as the order
needs to reach every rank: the long-poll hands it to the agents at once, each agent writes it
on its ranks' sockets, and a rank reads it at its next heartbeat, so two heartbeat intervals
and a margin (``lead_seconds``) cover it at the fastest recent step time. Every rank then
starts at the same step with no collective of ours, so a user's script (through the SDK or
the preload hook) and any parallelism (FSDP2 subgroups included) profile alike.

The request is journaled (``profile_requested``) before any order goes out; each rank's
trace arrives as ``profile_written`` (or ``profile_failed``), which ``status`` lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from orchestrator.contracts import events as ev
from orchestrator.contracts.protocol import ProfileOrder, ProfileRequest
from orchestrator.contracts.state import JobState

# Beyond the heartbeat intervals: the long-poll's round trip and a busy host's delays.
_LEAD_SLACK_S = 2.0
# Orders kept per node assignment (older ones are done; agents skip ids they have seen).
_KEPT_ORDERS = 8


@dataclass
class ProfileRefused(Exception):
    """A request that cannot be carried out: ``status`` is the HTTP status to answer."""

    status: int
    message: str

    def __str__(self) -> str:
        return self.message


def lead_seconds(heartbeat_interval_s: float) -> float:
    """How long an order may take to reach every rank (see the module docstring)."""
    return 2 * heartbeat_interval_s + _LEAD_SLACK_S


def choose_start(newest_step: int, step_time_s: float | None, lead_s: float) -> int:
    """The first step to profile: past the newest step by the steps ``lead_s`` can hold at
    ``step_time_s`` (at least 2, so a rank mid-step when the order lands still starts on
    time)."""
    if step_time_s is None or not math.isfinite(step_time_s) or step_time_s <= 0:
        ahead = 2
    else:
        ahead = max(2, min(1 << 20, math.ceil(lead_s / step_time_s)))
    return newest_step + ahead + 1


class ProfileDesk:
    """Turns requests into journaled orders. ``nodes`` is the ``NodeRegistry``, ``intake``
    gives the generation and its progress."""

    def __init__(self, ctx: Any, nodes: Any, intake: Any) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.intake = intake

    async def order(self, req: ProfileRequest) -> ev.ProfileRequested:
        view = self.ctx.view
        if view.state is not JobState.RUNNING or self.intake.generation is None:
            raise ProfileRefused(409, f"no running job to profile: the job is "
                                      f"{view.state.value}")
        world = self.ctx.cfg.cluster.world_size
        unknown = sorted({r for r in (req.ranks or []) if r >= world})
        if unknown:
            raise ProfileRefused(400, f"unknown rank{'s' if len(unknown) > 1 else ''} "
                                      f"{', '.join(map(str, unknown[:10]))}: the job has ranks "
                                      f"0..{world - 1}")
        ranks = sorted(set(req.ranks)) if req.ranks else list(range(world))
        busy = [p for p in view.profiles.values() if _pending(p, self.intake.generation)]
        if busy:
            raise ProfileRefused(409, f"profile {busy[0]['id']} (steps from "
                                      f"{busy[0]['start_step']}) is still being written; "
                                      f"wait for it (orchestrator profile --wait)")
        steps = [s for s in self.intake.progress.rank_steps().values() if s is not None]
        if not steps:
            raise ProfileRefused(409, "no rank has finished a step yet: ask again once "
                                      "training runs")
        generation = self.intake.generation
        by_node = self._ranks_by_node(ranks)
        start = choose_start(max(steps), self._fastest_step_time(),
                             lead_seconds(self.ctx.cfg.timeouts.heartbeat_interval_s))
        pid = max(view.profiles, default=0) + 1
        event = ev.ProfileRequested(
            id=pid, generation=generation, start_step=start, steps=req.steps, ranks=ranks,
            dir=str(self.ctx.rundir.root / "profiles" / str(start)))
        self.ctx.record(event, durable=True)
        for node_id, node_ranks in by_node.items():
            order = ProfileOrder(id=pid, generation=generation, start_step=start,
                                 steps=req.steps, ranks=node_ranks)
            node = self.nodes.nodes[node_id]
            kept = [*node.assignment.profiles, order][-_KEPT_ORDERS:]
            await self.nodes.assign(node_id, profiles=[o.model_dump() for o in kept])
        self.ctx.log.info("profile requested", id=pid, start_step=start, steps=req.steps,
                          ranks=len(ranks), nodes=len(by_node))
        return event

    def _ranks_by_node(self, ranks: list[int]) -> dict[str, list[int]]:
        ppn = self.ctx.cfg.cluster.procs_per_node
        owner = {n.node_rank: n.node_id for n in self.nodes.active() if n.node_rank is not None}
        out: dict[str, list[int]] = {}
        for rank in ranks:
            node_id = owner.get(rank // ppn)
            if node_id is None:
                raise ProfileRefused(409, f"rank {rank} has no node right now (a restart "
                                          f"under way?)")
            out.setdefault(node_id, []).append(rank)
        return out

    def _fastest_step_time(self) -> float | None:
        """The smallest recent step time any rank reported (the most steps an order's
        journey can take)."""
        times = [info.step_time for node in self.nodes.active() for info in node.ranks.values()
                 if info.step_time]
        return min(times) if times else None


def _pending(profile: dict[str, Any], generation: int) -> bool:
    """A profile of the running generation some of whose ranks have neither written nor
    failed yet (a restart abandons the profiles of the generation before)."""
    done = set(profile["written"]) | set(profile["failed"])
    return profile["generation"] == generation and not set(profile["ranks"]) <= done
