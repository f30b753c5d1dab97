"""Stragglers: a rank, and so its node, persistently slower than its peers.

Every rank's worker SDK summarizes its recent steps in its heartbeat: the mean of each
step's own time (the ``step_time`` a script reports with its step, else the interval between
its step reports; our trainer's runs from the batch to the update, without the wait for its
peers at the loop's end) and the mean data wait (the ``data_s`` of its step records) over
its last steps (``RankInfo.step_time``, ``RankInfo.data_wait``). The agent relays them in the
heartbeat it sends anyway; :meth:`StragglerDetector.update` keeps the newest pair per rank (a
dict store, the only per-heartbeat cost), and every ``check_every_s``
:meth:`StragglerDetector.evaluate` compares each rank with the median of the *other* ranks:

    excess = max(step_time - peers' step time, data_wait - peers' data wait)
    slow   = excess > margin x peers' step time  and  excess >= min_excess_s

A rank slowed outside the collectives (its input pipeline, its host, work after the update)
shows in its own step time or data wait while its peers wait for it elsewhere. Slowness
inside a step's collectives (a throttled accelerator in the middle of backward) makes every
rank's step equally long: no rank stands out and none is named (the job's step-time
histogram shows the slowdown; a profile places it).
A node is slow when one of its ranks is; it is *named* once it has been slow at every
check for ``window_s`` and *cleared* once it has been within the margin for ``window_s``.
A rank whose figures stopped arriving (more than a window old) is left out.

The detector is pure (time is passed in); :class:`StragglerWatch` journals what it finds
(``straggler`` events), keeps the metrics, logs, and, with ``action: exclude``, takes a named
node out at the next restart when a spare can take its place.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from orchestrator.contracts import events as ev
from orchestrator.config.schema import StragglerConfig
from orchestrator.contracts.state import NodeState


@dataclass
class _Sample:
    node_id: str
    step_time: float
    data_wait: float | None
    at: float  # monotonic time it arrived


@dataclass(frozen=True)
class Finding:
    """A node's standing at one check: its slowest rank against its peers."""

    node_id: str
    ranks: tuple[int, ...]  # its ranks found slow
    excess_s: float
    step_time_s: float
    data_wait_s: float | None
    peer_step_time_s: float
    peer_data_wait_s: float | None


@dataclass(frozen=True)
class Change:
    action: str  # "named" | "cleared"
    finding: Finding


@dataclass
class _NodeTrack:
    slow_since: float | None = None
    ok_since: float | None = None
    named: Finding | None = None


def median_without(sorted_values: Sequence[float], value: float) -> float:
    """The median of ``sorted_values`` with one occurrence of ``value`` taken out (it must be
    there, and there must be at least two values): O(log n), no copy."""
    n = len(sorted_values) - 1
    i = bisect.bisect_left(sorted_values, value)

    def at(k: int) -> float:  # the k-th value of the list without index i
        return sorted_values[k] if k < i else sorted_values[k + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


class StragglerDetector:
    """The comparison and its persistence (pure: time is an argument)."""

    def __init__(self, cfg: StragglerConfig) -> None:
        self.cfg = cfg
        self.samples: dict[int, _Sample] = {}
        self.tracks: dict[str, _NodeTrack] = {}

    def update(self, rank: int, node_id: str, step_time: float | None,
               data_wait: float | None, now: float) -> None:
        """The newest summary of ``rank`` (on ``node_id``); None step time: no steps yet."""
        if step_time is not None:
            self.samples[rank] = _Sample(node_id, step_time, data_wait, now)

    def reset(self) -> None:
        """A new generation: nobody's figures carry over, nobody stays named."""
        self.samples.clear()
        self.tracks.clear()

    def findings(self, now: float) -> dict[str, Finding]:
        """Nodes with a rank slow right now (one check, no persistence)."""
        fresh = {r: s for r, s in self.samples.items() if now - s.at <= self.cfg.window_s}
        if len(fresh) < 2:
            return {}
        steps = sorted(s.step_time for s in fresh.values())
        waits = sorted(s.data_wait for s in fresh.values() if s.data_wait is not None)
        worst: dict[str, tuple[float, Finding]] = {}
        slow_by_node: dict[str, list[int]] = {}
        for rank, s in fresh.items():
            peer_step = median_without(steps, s.step_time)
            peer_wait = median_without(waits, s.data_wait) \
                if s.data_wait is not None and len(waits) >= 2 else None
            excess = s.step_time - peer_step
            if peer_wait is not None and s.data_wait is not None:
                excess = max(excess, s.data_wait - peer_wait)
            if excess <= self.cfg.margin * peer_step or excess < self.cfg.min_excess_s:
                continue
            slow_by_node.setdefault(s.node_id, []).append(rank)
            if s.node_id not in worst or excess > worst[s.node_id][0]:
                worst[s.node_id] = (excess, Finding(s.node_id, (), excess, s.step_time,
                                                    s.data_wait, peer_step, peer_wait))
        return {node: replace(f, ranks=tuple(sorted(slow_by_node[node])))
                for node, (_, f) in worst.items()}

    def evaluate(self, now: float) -> list[Change]:
        """One check: the nodes named or cleared by it."""
        slow = self.findings(now)
        changes: list[Change] = []
        for node_id in slow.keys() | self.tracks.keys():
            track = self.tracks.setdefault(node_id, _NodeTrack())
            finding = slow.get(node_id)
            if finding is not None:
                track.ok_since = None
                if track.slow_since is None:
                    track.slow_since = now
                if track.named is None and now - track.slow_since >= self.cfg.window_s:
                    track.named = finding
                    changes.append(Change("named", finding))
                elif track.named is not None:
                    track.named = finding  # the newest figures of a node still named
            else:
                track.slow_since = None
                if track.named is None:
                    del self.tracks[node_id]
                    continue
                if track.ok_since is None:
                    track.ok_since = now
                if now - track.ok_since >= self.cfg.window_s:
                    changes.append(Change("cleared", track.named))
                    del self.tracks[node_id]
        return changes

    @property
    def named(self) -> dict[str, Finding]:
        return {n: t.named for n, t in self.tracks.items() if t.named is not None}


class StragglerWatch:
    """The detector in the supervisor: fed by heartbeats, checked on the observe loop's tick,
    journaled. ``ctx`` is the supervisor's ``JobContext``."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.cfg: StragglerConfig = ctx.cfg.stragglers
        self.detector = StragglerDetector(self.cfg)
        self._next_check: float | None = None
        self._generation: int | None = None

    def on_ranks(self, node_id: str, infos: Sequence[Any]) -> None:
        """A heartbeat's ranks (``RankInfo``): keep their newest summaries."""
        if not self.cfg.enabled:
            return
        now = self.ctx.clock.monotonic()
        for info in infos:
            if info.step_time is not None:
                self.detector.update(info.rank, node_id, info.step_time, info.data_wait, now)

    def tick(self, generation: int) -> list[Change]:
        """Check when due; journal what changed."""
        if not self.cfg.enabled:
            return []
        now = self.ctx.clock.monotonic()
        if generation != self._generation:
            self._generation = generation
            self.detector.reset()
            self._adopt_named(generation)
            self._next_check = now + self.cfg.check_every_s
            return []
        if self._next_check is None or now < self._next_check:
            return []
        self._next_check = now + self.cfg.check_every_s
        changes = self.detector.evaluate(now)
        for change in changes:
            f = change.finding
            self.ctx.record(ev.Straggler(
                action=change.action, node_id=f.node_id, generation=generation,
                ranks=list(f.ranks), excess_s=_r(f.excess_s), step_time_s=_r(f.step_time_s),
                data_wait_s=_r(f.data_wait_s), peer_step_time_s=_r(f.peer_step_time_s),
                peer_data_wait_s=_r(f.peer_data_wait_s), window_s=self.cfg.window_s))
            log = self.ctx.log.warning if change.action == "named" else self.ctx.log.info
            log(f"straggler {change.action}", node=f.node_id, ranks=list(f.ranks),
                excess_s=_r(f.excess_s), step_time_s=_r(f.step_time_s),
                data_wait_s=_r(f.data_wait_s), peer_step_time_s=_r(f.peer_step_time_s),
                peer_data_wait_s=_r(f.peer_data_wait_s))
        return changes

    def _adopt_named(self, generation: int) -> None:
        """Nodes the journal names for this generation (a restarted supervisor's
        predecessor named them): still named here, so they can be cleared."""
        for node_id, e in self.ctx.view.stragglers.items():
            if e.get("generation") == generation:
                self.detector.tracks[node_id] = _NodeTrack(named=Finding(
                    node_id, tuple(e.get("ranks") or ()), e.get("excess_s") or 0.0,
                    e.get("step_time_s") or 0.0, e.get("data_wait_s"),
                    e.get("peer_step_time_s") or 0.0, e.get("peer_data_wait_s")))

    def exclude_at_restart(self, nodes: Any) -> list[str]:
        """With ``action: exclude``: move each named node still ACTIVE to EXCLUDED while a
        spare, or a node registered since the last launch, can take its rank (one each). ``nodes`` is the ``NodeRegistry``; the
        named nodes are the journal's (so a restarted supervisor excludes them too)."""
        if self.cfg.action != "exclude":
            return []
        # A node that registered after the last launch is not a spare yet: the health round
        # before the next launch makes it one, as it does a spare of the last launch.
        spares = len(nodes.with_state(NodeState.SPARE)) + \
            len(nodes.with_state(NodeState.REGISTERED))
        excluded: list[str] = []
        for node_id, named in sorted(self.ctx.view.stragglers.items()):
            node = nodes.nodes.get(node_id)
            if node is None or node.state is not NodeState.ACTIVE:
                continue
            if spares <= len(excluded):
                self.ctx.log.warning("straggler kept: no spare to take its place",
                                     node=node_id)
                continue
            reason = (f"straggler: {named.get('excess_s')} s a step slower than its peers "
                      f"for {named.get('window_s')} s")
            nodes.move(node, NodeState.EXCLUDED, reason=reason, node_rank=None)
            self.ctx.record(ev.Straggler(action="excluded", node_id=node_id,
                                         generation=named.get("generation"),
                                         ranks=named.get("ranks", []), reason=reason))
            self.ctx.log.warning("straggler excluded at restart", node=node_id)
            excluded.append(node_id)
        return excluded


def _r(value: float | None) -> float | None:
    return None if value is None else round(max(0.0, value), 6)


__all__ = ["Change", "Finding", "StragglerDetector", "StragglerWatch", "median_without"]
