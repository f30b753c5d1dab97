"""Messages of the control API between agents and the supervisor (HTTP + JSON).

Agents always connect to the supervisor (never the reverse), so agents behind NAT or in
Kubernetes pods work. Commands travel as a declarative *assignment* per node, which the agent
fetches by long-poll and reconciles against what it runs: an assignment says which generation
of the job the node should run (or that it should stop, or exit), so a supervisor rebuilt from
its journal re-issues the same assignment and a running node carries on undisturbed.

Everything an agent sends is an ``Inbound`` model: strict types (no "5" for 5, no bool for an
int), finite numbers, bounded strings and lists, closed sets of phases and signals, node ids of
printable ASCII. Worker events are typed per name (``contracts.worker_events``). A message
that does not fit is refused at the door with 422; nothing behind the API sees it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationInfo,
    model_validator,
)

from orchestrator.contracts.phases import PHASES, Phase
from orchestrator.contracts.steprecord import Records, StepRecord, keep_valid_records
from orchestrator.contracts.worker_events import (
    FiniteFloat,
    ShortStr,
    Signal,
    Text,
    Timestamp,
    validate_worker_data,
)

# A node id: printable ASCII, safe in a file name, a metric label and a terminal. (A
# superscript digit passes ``str.isdigit`` but not ``int``; an escape code repaints a TTY.)
NodeId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
HostName = Annotated[str, StringConstraints(min_length=1, max_length=255,
                                            pattern=r"^[\x21-\x7e]+$")]
Port = Annotated[int, Field(ge=1, le=65535)]
# Bounds far above any real cluster, low enough that no arithmetic on them overflows.
MAX_RANKS = 1 << 20
Rank = Annotated[int, Field(ge=0, lt=MAX_RANKS)]
Step = Annotated[int, Field(ge=0, le=1 << 53)]
Generation = Annotated[int, Field(ge=0, le=1 << 31)]
Pid = Annotated[int, Field(ge=0, le=1 << 31)]
ExitCode = Annotated[int, Field(ge=-(1 << 31), le=1 << 31)]
# A step interval above a week is a broken clock or a forgery (the hang timeout is a multiple).
MAX_STEP_INTERVAL_S = 7 * 86400.0
# Depth of free-form JSON (health details, measured tables); the parser stops at 200.
DEFAULT_MAX_JSON_DEPTH = 32


def _depth_ok(value: Any, info: ValidationInfo) -> Any:
    limit = (info.context or {}).get("max_json_depth", DEFAULT_MAX_JSON_DEPTH)
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            raise ValueError(f"nested deeper than {limit} levels")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return value


# Free-form JSON of bounded depth (pydantic's JsonValue refuses NaN only in JSON mode).
FreeJson = Annotated[dict[str, JsonValue], AfterValidator(_depth_ok)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Inbound(Message):
    """A message an agent sends: strict, finite, bounded."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RankInfo(Inbound):
    """What an agent knows of one of its ranks."""

    rank: Rank
    local_rank: Annotated[int, Field(ge=0, lt=4096)]
    pid: Pid | None = None
    alive: bool = True
    exit_code: ExitCode | None = None
    signal: Signal | None = None
    step: Step | None = None
    phase: Phase | None = None
    last_step_ts: Timestamp | None = None  # wall time the rank's last step finished
    beat_ts: Timestamp | None = None  # wall time of the rank's last heartbeat
    # largest recent step interval seen by the rank (calibrates the hang timeout)
    step_interval_max: Annotated[float, Field(ge=0, le=MAX_STEP_INTERVAL_S)] | None = None
    # Who counts the steps: "sdk" (the script's step_done) or "hook" (the preload hook's
    # optimizer-step count: a script with no SDK, judged by liveness until its first step).
    progress: Literal["sdk", "hook"] | None = None
    finished: bool = False  # the rank sent its last beat (worker SDK shutdown): tearing down
    # The rank's recent steps, summarized by the worker SDK (means over its last steps): the
    # straggler detector compares them across ranks (``supervisor.generation.stragglers``).
    step_time: Annotated[float, Field(ge=0, le=MAX_STEP_INTERVAL_S)] | None = None
    data_wait: Annotated[float, Field(ge=0, le=MAX_STEP_INTERVAL_S)] | None = None
    # The rank can rejoin a new generation in place (it enabled in-job recovery).
    recoverable: bool = False


class RegisterRequest(Inbound):
    node_id: NodeId
    host: HostName
    addr: HostName  # address other nodes use to reach this one (MASTER_ADDR when node rank 0)
    procs: Annotated[int, Field(ge=0, le=4096)]  # accelerators (or CPU slots) available
    agent_pid: Pid
    free_port: Port | None = None
    generation: Generation | None = None  # generation it is running, when re-registering
    assignment_version: Annotated[int, Field(ge=0, le=1 << 53)] = 0  # newest version seen
    ranks: list[RankInfo] = Field(default_factory=list, max_length=4096)


class RegisterResponse(Message):
    node_id: str
    job: str
    config: dict[str, Any]
    heartbeat_interval_s: float
    # Where to send heartbeats instead of the API's port (``api.heartbeat_process``): the
    # same host the agent reached the supervisor at, this port; None: the API's own.
    heartbeat_port: Port | None = None
    epoch: int = 0  # the answering supervisor's leader epoch (``Assignment.epoch``)


class Heartbeat(Inbound):
    node_id: NodeId
    generation: Generation | None = None
    free_port: Port | None = None
    ranks: list[RankInfo] = Field(default_factory=list, max_length=4096)
    # Rank 0's step records (``orchestrator.contracts.steprecord``), at most MAX_RECORDS_PER_BEAT.
    records: Records = Field(default_factory=list)


class RankExit(Inbound):
    type: Literal["rank_exit"] = "rank_exit"
    generation: Generation
    rank: Rank
    pid: Pid | None = None
    exit_code: ExitCode | None = None
    signal: Signal | None = None
    ts: Timestamp
    log_tail: list[Text] = Field(default_factory=list, max_length=200)
    # The rank's own account of its failure: its @record error file's message, or the OS
    # error of a spawn that failed (``job.entrypoint 'pyhton' not found``).
    error: Annotated[str, Field(max_length=4096)] | None = None


class RanksStarted(Inbound):
    type: Literal["ranks_started"] = "ranks_started"
    generation: Generation
    ranks: list[RankInfo] = Field(max_length=4096)
    ts: Timestamp


class RanksStopped(Inbound):
    type: Literal["ranks_stopped"] = "ranks_stopped"
    generation: Generation
    ts: Timestamp
    free_port: Port | None = None  # for the next rendezvous


class WorkerEvent(Inbound):
    """An event a rank sent through the worker SDK (checkpoint committed, phase change...).

    ``data`` is checked against the model of ``name`` (``orchestrator.contracts.worker_events``): a
    ``checkpoint_committed`` without a valid step, or data that names the envelope's own
    fields (generation, rank, node_id, kind, seq, ts), is refused."""

    type: Literal["worker"] = "worker"
    generation: Generation
    rank: Rank
    name: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
    data: dict[str, Any] = Field(default_factory=dict)
    ts: Timestamp

    @model_validator(mode="after")
    def _typed_data(self) -> WorkerEvent:
        self.data = validate_worker_data(self.name, self.rank, self.data)
        return self


class HealthResult(Inbound):
    """One check's result as an agent reports it (``orchestrator.health.base.CheckResult``)."""

    node_id: NodeId
    check: ShortStr
    ok: bool
    severity: Literal["fatal", "warn"]
    message: Text
    duration_s: Annotated[float, Field(ge=0, le=MAX_STEP_INTERVAL_S)]
    level: Literal["quick", "full"]
    skipped: bool = False
    details: FreeJson = Field(default_factory=dict)


def _results_ok(results: list[dict[str, Any]], info: ValidationInfo) -> list[dict[str, Any]]:
    for r in results:
        HealthResult.model_validate(r, strict=False, context=info.context)
    return results


class HealthReport(Inbound):
    """A node's results for one stage of a health round (see ``orchestrator.health``)."""

    type: Literal["health"] = "health"
    nonce: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    stage: Literal["node", "network"]
    results: Annotated[list[dict[str, Any]], AfterValidator(_results_ok)] = Field(
        default_factory=list, max_length=1000)
    measured: FreeJson | None = None  # the network test's table
    error: Text | None = None  # why the network test produced nothing here
    sent_ts: Timestamp  # the agent's wall clock when it sent this (clock-skew check)
    free_port: Port | None = None


AgentEvent = Annotated[RankExit | RanksStarted | RanksStopped | WorkerEvent | HealthReport,
                       Field(discriminator="type")]


class EventBatch(Inbound):
    node_id: NodeId
    events: list[AgentEvent] = Field(max_length=10_000)


class StopRequest(Inbound):
    """The operator's ``/v1/stop`` (``orchestrator down``): why, and whether the ranks commit
    a checkpoint at their next step boundary before they stop."""

    reason: Annotated[str, StringConstraints(max_length=200,
                                             pattern=r"^[^\x00-\x1f\x7f]*$")] = "operator"
    checkpoint: bool = True


# A profile covers at most this many steps: a trace grows with every step (tens of MB a step
# for a large model with shapes and memory recorded), and a few steps show a steady state.
MAX_PROFILE_STEPS = 200


class ProfileRequest(Inbound):
    """The operator's ``/v1/profile`` (``orchestrator profile``): profile the next ``steps``
    steps of ``ranks`` (None: every rank)."""

    steps: Annotated[int, Field(ge=1, le=MAX_PROFILE_STEPS)]
    ranks: Annotated[list[Rank], Field(min_length=1, max_length=4096)] | None = None


class ProfileOrder(Message):
    """Profile steps ``start_step`` .. ``start_step + steps - 1`` of ``ranks`` (a node's
    share of a profile request), writing into ``RUN_DIR/profiles/<start_step>/rank-K/``."""

    id: Annotated[int, Field(ge=1, le=1 << 31)]
    generation: Generation  # an agent running another generation ignores it
    start_step: Step
    steps: Annotated[int, Field(ge=1, le=MAX_PROFILE_STEPS)]
    ranks: list[Rank] = Field(max_length=4096)


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
    # The leader epoch of the supervisor that gave it (``supervisor.leader``; 0: no
    # election): an agent ignores an order from an epoch older than one it has seen.
    epoch: int = 0
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
    profiles: list[ProfileOrder] = Field(default_factory=list, max_length=64)
    # In-job recovery: the node's live ranks of the previous generation join this one in
    # place (a ``recover`` order on the local socket); the ranks in ``replace`` (and any
    # that died meanwhile) are killed if alive and started anew, in a standby where the
    # node keeps one.
    in_place: bool = False
    replace: list[int] = Field(default_factory=list, max_length=4096)
    # A spare per local rank runs this ``module:function`` after its imports, becoming a
    # warm standby (device context up, compile cache loaded) for in-job replacements.
    standby_prepare: str | None = None


__all__ = ["PHASES", "AgentEvent", "Assignment", "EventBatch", "FiniteFloat", "HealthOrder",
           "HealthReport", "HealthResult", "Heartbeat", "Inbound", "Message", "NodeId", "Phase",
           "ProfileOrder", "ProfileRequest", "RankExit", "RankInfo", "RanksStarted", "RanksStopped", "RegisterRequest",
           "RegisterResponse", "SignalOrder", "StepRecord", "StopRequest", "WorkerEvent", "keep_valid_records"]
