"""The job state machine and the closed set of failure causes.

Lifecycle of one job::

    PENDING -> HEALTH_CHECK -> LAUNCHING -> RUNNING -> COMPLETED
                    ^                          |
                    |                          v cause
                RECOVERING <------------- STOPPING
                    | budget spent, or no committed progress after N restarts
                    v
                  FAILED

An in-job recovery (one rank died or hung; the others stay alive and the failed rank is
replaced in place) goes RECOVERING -> LAUNCHING: the placement is the last one, so there is
no health check, and the next generation's ranks are the survivors plus the replacement.

plus STOPPED, reached from any live state when the operator stops the job: an operator's
stop is not a failure and must not page anybody as one (DESIGN's diagram has no such state;
booking a requested stop as FAILED would be a lie in every dashboard). A STOPPED job is
terminal until the operator continues it (``up --resume``): STOPPED -> PENDING starts a new
segment of the same job, from its newest checkpoint, with the books continuing.

Every move goes through ``transition()``, which rejects illegal moves.
"""

from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    """States of a job (see the module docstring for the lifecycle)."""

    PENDING = "PENDING"
    HEALTH_CHECK = "HEALTH_CHECK"
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    RECOVERING = "RECOVERING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.STOPPED})

_LIVE = (JobState.PENDING, JobState.HEALTH_CHECK, JobState.LAUNCHING, JobState.RUNNING,
         JobState.STOPPING, JobState.RECOVERING)

ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.HEALTH_CHECK, JobState.FAILED, JobState.STOPPED}),
    JobState.HEALTH_CHECK: frozenset({JobState.LAUNCHING, JobState.FAILED, JobState.STOPPED}),
    # A launch can fail before every rank is up (a rank dies at start-up): go to STOPPING.
    JobState.LAUNCHING: frozenset({JobState.RUNNING, JobState.STOPPING, JobState.FAILED,
                                   JobState.STOPPED}),
    JobState.RUNNING: frozenset({JobState.COMPLETED, JobState.STOPPING}),
    JobState.STOPPING: frozenset({JobState.RECOVERING, JobState.FAILED, JobState.STOPPED}),
    # LAUNCHING directly: an in-job recovery keeps the placement (no health check).
    JobState.RECOVERING: frozenset({JobState.HEALTH_CHECK, JobState.LAUNCHING, JobState.FAILED,
                                    JobState.STOPPED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    # Only by the operator's `up --resume`: the job goes on as a new segment.
    JobState.STOPPED: frozenset({JobState.PENDING}),
}


class IllegalTransition(RuntimeError):
    """A move the state machine does not allow (a bug in the caller, never swallowed)."""


def check_transition(current: JobState, target: JobState) -> None:
    """Raise IllegalTransition unless ``current -> target`` is allowed."""
    if target not in ALLOWED[current]:
        raise IllegalTransition(f"{current.value} -> {target.value} is not allowed")


class Cause(str, enum.Enum):
    """Why a generation of the job stopped: one of a closed set."""

    WORKER_EXIT = "worker_exit"  # a rank exited (code or signal)
    HANG = "hang"  # no progress past the phase's timeout
    NODE_LOST = "node_lost"  # an agent went silent
    HEALTH_CHECK = "health_check"  # a node failed a health check
    DIVERGENCE = "divergence"  # stability asked for a rollback
    OPERATOR = "operator"  # asked to stop
    CONFIG = "config"  # the config does not fit where the job runs (the allocation's size)
    COMPLETED = "completed"  # every rank finished


class NodeState(str, enum.Enum):
    """A node as the supervisor sees it."""

    REGISTERED = "registered"  # agent up, not in the job yet
    ACTIVE = "active"  # holds a node rank of the job
    SPARE = "spare"  # healthy, held back
    LOST = "lost"  # agent silent past node_lost_s
    EXCLUDED = "excluded"  # failed a health check or failed too often
    EXITED = "exited"  # agent finished cleanly
