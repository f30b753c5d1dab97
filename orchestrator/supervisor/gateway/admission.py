"""What a node may say: a pure check of one parsed message against the node's place in the job.

The API server authenticates the node (``orchestrator.contracts.auth``), parses the message
(``contracts.protocol``), then asks here whether this node may send it. A node speaks for
itself and for the ranks of its slice of the current generation (the newest launched) only:

- every message names the authenticated node (``node_id``); a result of a health check too;
- ranks it reports (heartbeats, starts, exits, worker events) lie inside the job's world; for
  the current generation, inside the node's own slice of it (``Slice``, from the journal's
  ``generation_launched``, so it holds across a supervisor restart and for spares, whose
  slice is empty); a generation not launched yet is refused (no exit can be sent ahead for
  a generation to come);
- generations are fenced: a rank start, a worker event or a step record for any generation
  but the current one is refused. The exceptions are late reports of an older generation,
  which intake folds nowhere into the current one: an exit of one of the node's ranks of
  that generation or the node's stop confirmation (the stop of that generation asks for
  them), a worker event of one of the node's ranks of that generation (journaled as that
  generation's), and step records from the node that held rank 0 in it (a beat sent before
  the node heard of the newer launch; an in-place recovery keeps rank 0 beating through it);
- step records are rank 0's (``orchestrator.contracts.steprecord``): only the node holding rank 0 of
  the current generation sends them; and the events that speak for the checkpoints and the
  restore (``worker_events.RANK0_NAMES``) are rank 0's too;
- a calibration value (``step_interval_max``) stays under ``limits.max_step_interval_s``;
- a registration does not move a live node to another address, nor add a node past
  ``limits.max_nodes``.

Every function returns None (accept) or a ``Refusal`` (HTTP status and reason). Nothing here
reads the supervisor; the server passes in what it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchestrator.contracts.protocol import (
    EventBatch,
    HealthReport,
    Heartbeat,
    RankExit,
    RanksStarted,
    RanksStopped,
    RegisterRequest,
    WorkerEvent,
)
from orchestrator.contracts.worker_events import RANK0_NAMES

# The rank whose step records travel (the worker SDK's default).
RECORDS_RANK = 0


@dataclass(frozen=True)
class Limits:
    world_size: int
    max_step_interval_s: float
    max_nodes: int


@dataclass(frozen=True)
class Refusal:
    status: int  # 403: not this node's to say; 409: conflicts with what is live
    reason: str


@dataclass(frozen=True)
class Slice:
    """A node's ranks ``[lo, hi)`` in the newest launched generation (empty if not in it)."""

    generation: int
    lo: int = 0
    hi: int = 0


# The node's slice in an older generation (None: it was not in it, or no such launch).
PastSlice = Callable[[int], "Slice | None"]


def _no_past(generation: int) -> Slice | None:
    return None


@dataclass(frozen=True)
class KnownNode:
    """What the server knows of a registered node (from intake's registry)."""

    host: str
    addr: str
    live: bool  # registered, active or spare, and heard from within node_lost_s


def _forged(reason: str) -> Refusal:
    return Refusal(403, reason)


def check_node_id(principal: str, claimed: str) -> Refusal | None:
    if claimed != principal:
        return _forged(f"node {principal} sent a message as node {claimed!r}")
    return None


def check_register(principal: str, req: RegisterRequest, known: KnownNode | None,
                   node_count: int, current: Slice | None, limits: Limits) -> Refusal | None:
    refusal = check_node_id(principal, req.node_id)
    if refusal is not None:
        return refusal
    if known is None and node_count >= limits.max_nodes:
        return Refusal(403, f"{node_count} nodes are registered; api.max_nodes is "
                            f"{limits.max_nodes}")
    if known is not None and known.live and (req.addr, req.host) != (known.addr, known.host):
        return Refusal(409, f"node {principal} is live at {known.addr} ({known.host}); it "
                            "may register another address once it is lost")
    return _ranks(principal, req.generation, req.ranks, current, limits)


def check_heartbeat(principal: str, hb: Heartbeat, current: Slice | None,
                    limits: Limits, past: PastSlice = _no_past) -> Refusal | None:
    refusal = check_node_id(principal, hb.node_id)
    if refusal is not None:
        return refusal
    if hb.records:
        refusal = _records(principal, hb.generation, current, past)
        if refusal is not None:
            return refusal
    return _ranks(principal, hb.generation, hb.ranks, current, limits)


def _records(principal: str, generation: int | None, current: Slice | None,
             past: PastSlice) -> Refusal | None:
    if current is not None and generation is not None and generation < current.generation:
        # Late: sent before the node heard of the newer launch (see the module's docstring).
        then = past(generation)
        if then is not None and then.lo <= RECORDS_RANK < then.hi:
            return None
    if current is None or generation != current.generation:
        return _forged(f"node {principal}: step records of generation {generation}; the "
                       f"current generation is {None if current is None else current.generation}")
    if not current.lo <= RECORDS_RANK < current.hi:
        mine = f"{current.lo}..{current.hi - 1}" if current.hi > current.lo else "none"
        return _forged(f"node {principal}: step records are rank {RECORDS_RANK}'s; its ranks "
                       f"in generation {current.generation} are {mine}")
    return None


def check_events(principal: str, batch: EventBatch, current: Slice | None,
                 limits: Limits, past: PastSlice = _no_past) -> Refusal | None:
    refusal = check_node_id(principal, batch.node_id)
    if refusal is not None:
        return refusal
    for i, ev in enumerate(batch.events):
        if isinstance(ev, HealthReport):
            others = {r.get("node_id") for r in ev.results} - {principal}
            if others:
                return _forged(f"node {principal} reported health results of another node "
                               f"(event {i})")
            continue
        what = f"event {i} ({ev.type})"
        if isinstance(ev, RankExit | WorkerEvent):
            ranks: Iterable[int] = (ev.rank,)
        elif isinstance(ev, RanksStarted):
            ranks = (r.rank for r in ev.ranks)
        else:  # RanksStopped: names no rank, but a generation
            ranks = ()
        if isinstance(ev, WorkerEvent) and ev.name in RANK0_NAMES and ev.rank != 0:
            return _forged(f"node {principal}: {what} {ev.name!r} is rank 0's to send, not "
                           f"rank {ev.rank}'s")
        if current is not None and ev.generation < current.generation:
            refusal = _late(principal, ev, past(ev.generation), current, limits, what)
        else:
            refusal = _rank_numbers(principal, ev.generation, ranks, current, limits, what)
        if refusal is not None:
            return refusal
    return None


def _late(principal: str, ev: RankExit | RanksStarted | RanksStopped | WorkerEvent,
          then: Slice | None, current: Slice, limits: Limits, what: str) -> Refusal | None:
    """An event of an older generation: only an exit of the node's own rank in it, or its
    stop confirmation, both reports the stop of that generation asked for, or a worker
    event of the node's own rank in it (sent before the rank heard of the newer launch: a
    survivor of an in-place recovery, a rank's last words before it died)."""
    fenced = _forged(f"node {principal}: {what} for generation {ev.generation}, not the "
                     f"current generation {current.generation}")
    if then is None or not isinstance(ev, RankExit | RanksStopped | WorkerEvent):
        return fenced
    if isinstance(ev, RankExit | WorkerEvent):
        return _rank_numbers(principal, ev.generation, (ev.rank,), then, limits, what)
    return None if then.hi > then.lo else fenced


def _ranks(principal: str, generation: int | None, infos: Iterable, current: Slice | None,
           limits: Limits) -> Refusal | None:
    infos = list(infos)
    for info in infos:
        if info.step_interval_max is not None and \
                info.step_interval_max > limits.max_step_interval_s:
            return Refusal(403, f"rank {info.rank} reports a step interval of "
                                f"{info.step_interval_max:g} s; api.max_step_interval_s is "
                                f"{limits.max_step_interval_s:g}")
    ranks = [i.rank for i in infos]
    if generation is None:
        if ranks:
            return _forged(f"node {principal}: reports ranks {ranks[:3]} of no generation")
        return None
    return _rank_numbers(principal, generation, ranks, current, limits, what="ranks")


def _rank_numbers(principal: str, generation: int, ranks: Iterable[int],
                  current: Slice | None, limits: Limits, what: str) -> Refusal | None:
    ranks = list(ranks)
    outside = [r for r in ranks if r >= limits.world_size]
    if outside:
        return _forged(f"node {principal}: {what} names rank {outside[0]}, outside the "
                       f"world of {limits.world_size}")
    if current is None or generation > current.generation:
        newest = "none" if current is None else str(current.generation)
        return _forged(f"node {principal}: {what} for generation {generation}, which was "
                       f"never launched (newest: {newest})")
    if generation == current.generation:
        foreign = [r for r in ranks if not current.lo <= r < current.hi]
        if foreign:
            mine = f"{current.lo}..{current.hi - 1}" if current.hi > current.lo else "none"
            return _forged(f"node {principal}: {what} names rank {foreign[0]}; its ranks in "
                           f"generation {generation} are {mine}")
    return None  # an older generation's straggler: intake ignores what it no longer needs
