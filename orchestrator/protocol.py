"""Messages of the control API between agents and the supervisor (HTTP + JSON).

Agents always connect to the supervisor (never the reverse), so agents behind NAT or in
Kubernetes pods work. Commands travel as a declarative *assignment* per node, which the agent
fetches by long-poll and reconciles against what it runs: an assignment says which generation
of the job the node should run (or that it should stop, or exit), so a supervisor rebuilt from
its journal re-issues the same assignment and a running node carries on undisturbed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RankInfo(Message):
    """What an agent knows of one of its ranks."""

    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    pid: int | None = None
    alive: bool = True
    exit_code: int | None = None
    signal: str | None = None
    step: int | None = None
    phase: str | None = None
    last_step_ts: float | None = None  # wall time the rank's last step finished
    beat_ts: float | None = None  # wall time of the rank's last heartbeat
    step_interval_max: float | None = None  # largest recent step interval seen by the rank
    # Who counts the steps: "sdk" (the script's step_done) or "hook" (the preload hook's
    # optimizer-step count: a script with no SDK, judged by liveness until its first step).
    progress: Literal["sdk", "hook"] | None = None
    finished: bool = False  # the rank sent its last beat (worker SDK shutdown): tearing down


class RegisterRequest(Message):
    node_id: str = Field(min_length=1, max_length=128)
    host: str
    addr: str  # address other nodes use to reach this one (MASTER_ADDR when node rank 0)
    procs: int = Field(ge=0)  # accelerators (or CPU slots) available
    agent_pid: int
    free_port: int | None = Field(None, ge=1, le=65535)
    generation: int | None = None  # generation it is running, when re-registering
    assignment_version: int = Field(0, ge=0)  # newest assignment version it has seen
    ranks: list[RankInfo] = Field(default_factory=list)


class RegisterResponse(Message):
    node_id: str
    job: str
    config: dict[str, Any]
    heartbeat_interval_s: float


class Heartbeat(Message):
    node_id: str
    generation: int | None = None
    free_port: int | None = Field(None, ge=1, le=65535)
    ranks: list[RankInfo] = Field(default_factory=list)
    records: list[dict[str, Any]] = Field(default_factory=list, max_length=100_000)


class RankExit(Message):
    type: Literal["rank_exit"] = "rank_exit"
    generation: int
    rank: int = Field(ge=0)
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    ts: float
    log_tail: list[str] = Field(default_factory=list)
    # The rank's own account of its failure: its @record error file's message, or the OS
    # error of a spawn that failed (``job.entrypoint 'pyhton' not found``).
    error: str | None = Field(None, max_length=4096)


class RanksStarted(Message):
    type: Literal["ranks_started"] = "ranks_started"
    generation: int
    ranks: list[RankInfo]
    ts: float


class RanksStopped(Message):
    type: Literal["ranks_stopped"] = "ranks_stopped"
    generation: int
    ts: float
    free_port: int | None = Field(None, ge=1, le=65535)  # for the next rendezvous


class WorkerEvent(Message):
    """An event a rank sent through the worker SDK (checkpoint committed, phase change...)."""

    type: Literal["worker"] = "worker"
    generation: int
    rank: int = Field(ge=0)
    name: str = Field(min_length=1, max_length=64)
    data: dict[str, Any] = Field(default_factory=dict)
    ts: float


class HealthReport(Message):
    """A node's results for one stage of a health round (see ``orchestrator.health``)."""

    type: Literal["health"] = "health"
    nonce: str
    stage: Literal["node", "network"]
    results: list[dict[str, Any]] = Field(default_factory=list, max_length=1000)
    measured: dict[str, Any] | None = None  # the network test's table
    error: str | None = None  # why the network test produced nothing here
    sent_ts: float  # the agent's wall clock when it sent this (clock-skew check)
    free_port: int | None = Field(None, ge=1, le=65535)


AgentEvent = Annotated[RankExit | RanksStarted | RanksStopped | WorkerEvent | HealthReport,
                       Field(discriminator="type")]


class EventBatch(Message):
    node_id: str
    events: list[AgentEvent] = Field(max_length=10_000)


class SignalOrder(Message):
    """Send ``signal`` to a rank once (chaos kills, stack dumps)."""

    id: int
    rank: int
    signal: str


class HealthOrder(Message):
    """Run one stage of a health round. ``node``: the node's own checks (``context`` is an
    ``orchestrator.health.context.NodeContext``); ``network``: ranks of the network test,
    placed by the assignment's ``node_rank``/``nproc``/``world_size``/``master_*`` fields
    (``spec`` is the netcheck's spec)."""

    nonce: str = Field(min_length=1, max_length=64)
    stage: Literal["node", "network"]
    context: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None
    timeout_s: float = Field(gt=0)


class Assignment(Message):
    """What one node should be doing now. ``version`` grows with every change."""

    version: int = 0
    action: Literal["idle", "run", "stop", "exit", "health"] = "idle"
    generation: int | None = None
    node_rank: int | None = None
    nproc: int = 0
    world_size: int = 0
    rank_offset: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    entrypoint: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    signals: list[SignalOrder] = Field(default_factory=list)
    # Modules a spare interpreter imports ahead of the next start (empty: no spares).
    preload: list[str] = Field(default_factory=list)
    health: HealthOrder | None = None
