"""How the job recovers from a failed generation: in place, or every rank restarted.

In-job recovery keeps the surviving ranks' processes (their imports, device contexts,
compiled graphs and page-locked memory): the next generation has the same members and
placement, the failed ranks are replaced (in a warm standby where the node keeps one), the
survivors roll back in place to the newest state every rank holds, and nothing waits for a
health check or a backoff. It is the path whenever every condition below holds; otherwise
the job restarts every rank from the best tier, as before. The failure's journal entry
names the path and, for a restart, the first condition that did not hold, so an operator
sees why a failure cost a full restart.

The decision is a pure function of the config, the journal's view, the failure and what
the ranks last said; it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.config import Config
from orchestrator.contracts.state import Cause, NodeState
from orchestrator.journal.view import JobView
from orchestrator.supervisor.generation.hangs import silent_after_s
from orchestrator.supervisor.generation.progress import GenerationProgress
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.placement import Placement

IN_JOB = "in_job"
RESTART = "restart"


@dataclass(frozen=True)
class InPlace:
    """Carried from STOPPING through RECOVERING to LAUNCHING: relaunch with the last
    placement, the survivors rejoining in place and ``replace`` started anew."""

    placement: Placement
    replace: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Path:
    """The recovery path of one failure, and why (for a restart: what ruled in-job out)."""

    kind: str  # IN_JOB | RESTART
    reason: str
    replace: list[int] = field(default_factory=list)

    @property
    def in_job(self) -> bool:
        return self.kind == IN_JOB


def failed_ranks(cause: Cause, detail: dict[str, Any], exits: dict[int, dict[str, Any]],
                 beat_s: float = 0.5, world_size: int | None = None) -> list[int]:
    """The ranks a recovery must replace: those that exited with a failure, or, for a hang,
    those that stopped beating (a blocked peer that still beats is a survivor)."""
    if cause is Cause.WORKER_EXIT:
        return sorted(r for r, e in exits.items() if e.get("exit_code") != 0 or e.get("signal"))
    if cause is Cause.HANG:
        suspects = detail.get("suspects") or []
        silent = sorted({s["rank"] for s in suspects if s.get("silent")})
        return silent or _stopped_beating(suspects, beat_s, world_size)
    return []


def _stopped_beating(suspects: list[dict[str, Any]], beat_s: float,
                     world_size: int | None) -> list[int]:
    """With a short training timeout the hang is judged before a stopped rank's silence
    reaches the silent threshold: the ranks that missed two beats while a peer's beats go
    on (that peer is blocked in a collective with them, its host is not late). The peer
    beating may be a suspect too, or not one at all: with steps of milliseconds the stopped
    rank is judged at the training timeout's floor, before its blocked peer is (a rank that
    stopped beating at the suspects' step or below is always named with them, so a rank
    left out still beats)."""
    ages = [(s["rank"], s.get("beat_age_s")) for s in suspects]
    fresh = [r for r, a in ages if a is not None and a <= 1.5 * beat_s]
    stale = sorted({r for r, a in ages if a is not None and a > 2 * beat_s})
    others_beat = world_size is not None and len({r for r, _ in ages}) < world_size
    # A one-rank job has no peer to tell a stopped rank from a late host; its rank's beats
    # stopped with its progress, and either way the rank is the one to replace (a failed
    # takeover falls back to a restart).
    return stale if (fresh or others_beat or world_size == 1) and stale else []


def choose_path(cfg: Config, view: JobView, cause: Cause, failure: dict[str, Any],
                replace: list[int], progress: GenerationProgress | None,
                nodes: NodeRegistry) -> Path:
    """In-job when every condition holds, else a restart with the first one that did not."""

    def restart(reason: str) -> Path:
        return Path(RESTART, reason)

    if not cfg.restart.in_job:
        return restart("restart.in_job is off")
    if cause not in (Cause.WORKER_EXIT, Cause.HANG):
        return restart(f"a {cause.value} failure restarts every rank")
    if cfg.job.master_port is not None:
        return restart("job.master_port is fixed, and the in-place generation needs a "
                       "rendezvous port of its own (use job.master_port_range)")
    if not replace:
        return restart("no rank to replace was named (every rank is stuck, or the failure "
                       "has no rank)")
    launch = view.launches[-1] if view.launches else None
    if launch is None or failure.get("generation") != launch.get("generation"):
        return restart("the failed generation is not the last one launched")
    if launch.get("in_place") and launch["generation"] not in view.first_steps:
        return restart(f"the in-job recovery into generation {launch['generation']} failed "
                       "before its first step")
    world = launch.get("world_size") or 0
    # Every rank of a multi-rank job failing is a job-wide failure (a bad batch, the same
    # bug everywhere): a full restart. A one-rank job's death is the one death the in-place
    # path is for: its standby takes over and restores from the memory tier the agent kept.
    if len(replace) >= world and world != 1:
        return restart("every rank failed")
    if progress is None or progress.generation != launch["generation"]:
        return restart("no progress of the failed generation is known")
    # The survivors must be able to rejoin; a one-rank job's rank must have said it could
    # (a script without the worker SDK's path restarts as before).
    unable = [r for r in range(world) if (r not in replace or world == 1) and
              not (progress.ranks.get(r) is not None and progress.ranks[r].recoverable)]
    if unable:
        return restart(f"rank(s) {unable[:8]} cannot rejoin in place (not using our trainer "
                       "or the worker SDK's in-job recovery, or not beating)")
    members: dict[str, int] = launch.get("nodes") or {}
    for node_id in members:
        node = nodes.nodes.get(node_id)
        if node is None or node.state is not NodeState.ACTIVE:
            state = node.state.value if node is not None else "gone"
            return restart(f"node {node_id} of the generation is {state}")
        # An agent that died with its ranks is not lost yet when its ranks' peers report;
        # its silence already says no replacement will start there.
        if nodes.judged_silence(node) > silent_after_s(cfg.timeouts.heartbeat_interval_s):
            return restart(f"node {node_id} of the generation is "
                           f"{nodes.silence_reason(node)}")
    if world == 1:
        return Path(IN_JOB, "the job's only rank replaced in place (no process to roll "
                            "back)", replace)
    return Path(IN_JOB, f"rank(s) {replace} replaced in place; the other "
                        f"{world - len(replace)} roll back in their processes", replace)


def placement_of(view: JobView) -> Placement:
    """The last launch's placement, which an in-job recovery keeps."""
    launch = view.launches[-1]
    return Placement(dict(launch.get("nodes") or {}), list(launch.get("spares") or []))
