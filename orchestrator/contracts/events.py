"""Journal events as types: one model per kind, one tagged union, one parser.

The journal line is ``{"seq", "ts", "kind", **fields}``. The envelope (``seq``, ``ts``) is
the journal's own: no model has those fields, so no data can set them; ``kind`` is a
``Literal`` default of each model, so no data can change it either. Writers construct a
model (pydantic validates it: strict types, finite numbers, bounded strings and lists,
closed enums) and hand it to ``Journal.append``; readers get typed events back from
``parse_event``, which never raises: a line no model accepts is returned as ``None`` with
the reason, and the caller reports it once and skips it.

Reading is tolerant where versions differ and strict where it matters: keys a model does
not know (written by a newer version) are dropped before validation, fields added since an
older version have defaults, and a value of the wrong type rejects the line.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from orchestrator.contracts.state import Cause, JobState, NodeState
from orchestrator.contracts.worker_events import RESERVED_KEYS, NoteKind

# Bounds: generous for what we write, small enough that no message can bloat the journal.
Text = Annotated[str, StringConstraints(max_length=4096)]
Name = Annotated[str, StringConstraints(max_length=256)]
Step = Annotated[int, Field(ge=0, le=2**53)]
Count = Annotated[int, Field(ge=0, le=2**53)]
Gen = Annotated[int, Field(ge=0, le=2**31)]
Rank = Annotated[int, Field(ge=0, le=2**24)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
LogTail = Annotated[list[Annotated[str, StringConstraints(max_length=2048)]],
                    Field(max_length=200)]


def _bounded_json(value: Any, depth: int = 0) -> Any:
    """A JSON value of bounded size and depth with finite numbers, or ValueError."""
    if depth > 6:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        if isinstance(value, str) and len(value) > 4096:
            raise ValueError("string longer than 4096 characters")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**63:
            raise ValueError("integer out of range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite number")
        return value
    if isinstance(value, list):
        if len(value) > 1000:
            raise ValueError("list longer than 1000 items")
        return [_bounded_json(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if len(value) > 200:
            raise ValueError("object with more than 200 keys")
        return {str(k)[:256]: _bounded_json(v, depth + 1) for k, v in value.items()}
    raise ValueError(f"not a JSON value: {type(value).__name__}")


Json = Annotated[Any, AfterValidator(_bounded_json)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_json)]



class Event(BaseModel):
    """Base of every journal event. ``kind`` is fixed per model."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    kind: str

    def fields(self) -> dict[str, Any]:
        """The event's own fields as JSON (no envelope)."""
        return self.model_dump(mode="json", by_alias=True, exclude={"kind"})


class _OpenEvent(Event):
    """An event whose extra fields are allowed, as bounded JSON under unreserved keys."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def model_post_init(self, __context: Any) -> None:
        extra = self.__pydantic_extra__ or {}
        if len(extra) > 64:
            raise ValueError("more than 64 data fields")
        for key, value in list(extra.items()):
            if key in RESERVED_KEYS or len(key) > 64:
                raise ValueError(f"data key {key!r} is not allowed")
            extra[key] = _bounded_json(value)


class JobCreated(Event):
    kind: Literal["job_created"] = "job_created"
    job: Name = ""
    run_dir: Text = ""
    config_hash: Name = ""
    world_size: Count = 0
    nodes: Count = 0
    spares: Count = 0
    steps: Count = 0
    checkpoint_root: Text = ""
    launcher: Name = ""
    own_script: bool = False  # job.entrypoint is set: the user's script, not our trainer


class SupervisorStarted(Event):
    kind: Literal["supervisor_started"] = "supervisor_started"
    pid: int | None = None
    url: Text = ""
    resumed: bool = False
    gap_s: Finite | None = None
    epoch: Count | None = None  # its leader epoch, with a standby (``supervisor.leader``)


class Transition(Event):
    kind: Literal["transition"] = "transition"
    from_: JobState | None = Field(None, alias="from")
    to: JobState
    cause: Cause | None = None
    reason: Text | None = None
    generation: Gen = 0
    delay_s: Seconds | None = None


class NodeRegistered(Event):
    kind: Literal["node_registered"] = "node_registered"
    node_id: Name
    host: Name = ""
    addr: Name = ""
    procs: Count = 0
    agent_pid: int | None = None
    reregistered: bool = False
    running_generation: Gen | None = None


class NodeStateChanged(Event):
    """A node's state moved (``orchestrator.supervisor.nodes``'s table says which moves)."""

    kind: Literal["node_state"] = "node_state"
    node_id: Name
    state: NodeState
    previous: NodeState | None = None
    reason: Text | None = None
    node_rank: Count | None = None


class AgentSpawned(Event):
    kind: Literal["agent_spawned"] = "agent_spawned"
    node_id: Name
    pid: int
    launcher: Name = ""
    host: Name | None = None


class AgentsExpected(Event):
    kind: Literal["agents_expected"] = "agents_expected"
    count: Count
    launcher: Name = ""
    head_url: Text = ""


class RankPid(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: Rank
    pid: int | None = None


class GenerationLaunched(Event):
    kind: Literal["generation_launched"] = "generation_launched"
    generation: Gen
    world_size: Count = 0
    master_addr: Name | None = None
    master_port: int | None = None
    nodes: dict[Name, Count] = Field(default_factory=dict)
    spares: list[Name] = Field(default_factory=list)
    after_cause: Cause | None = None
    resume_step: Step | None = None
    assignments: dict[Name, JsonObject] = Field(default_factory=dict)
    # In-job recovery: the previous generation's survivors join this one in place, and
    # these ranks are replaced (by a warm standby where the node has one).
    in_place: bool = False
    replaced: list[Rank] = Field(default_factory=list, max_length=1 << 20)

    def fields(self) -> dict[str, Any]:
        """As ``Event.fields``, with the assignments as they are: validated into plain JSON
        already (``_bounded_json`` builds fresh dicts and lists), so a JSON dump of them
        would only copy them. At 2,048 nodes that copy was 0.06 s per use (the journal's
        line and the view's launch record), on the loop with every heartbeat waiting."""
        out = self.model_dump(mode="json", by_alias=True, exclude={"kind", "assignments"})
        out["assignments"] = dict(self.assignments)
        return out


class RanksStarted(Event):
    kind: Literal["ranks_started"] = "ranks_started"
    node_id: Name
    generation: Gen
    ranks: list[RankPid] = Field(default_factory=list, max_length=4096)


class RanksStopped(Event):
    kind: Literal["ranks_stopped"] = "ranks_stopped"
    node_id: Name
    generation: Gen


class RankExited(Event):
    kind: Literal["rank_exited"] = "rank_exited"
    generation: Gen
    rank: Rank
    node_id: Name | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: Name | None = None
    log_tail: LogTail = Field(default_factory=list)
    exit_ts: Finite | None = None
    error: Text | None = None  # the rank's own error (error file, spawn failure)


class RankExit(BaseModel):
    """One rank's exit inside a node's ``ranks_exited`` event."""

    model_config = ConfigDict(extra="forbid")
    rank: Rank
    pid: int | None = None
    exit_code: int | None = None
    signal: Name | None = None
    log_tail: LogTail = Field(default_factory=list)
    exit_ts: Finite | None = None
    error: Text | None = None


class RanksExited(Event):
    """The exits of one node's ranks that arrived together (a stop's SIGTERMs, a crash and
    its peers): one event per node instead of one per rank, so a stop of 2,048 nodes x 8
    is 2,048 journal lines, not 16,384."""

    kind: Literal["ranks_exited"] = "ranks_exited"
    generation: Gen
    node_id: Name | None = None
    exits: list[RankExit] = Field(default_factory=list, max_length=4096)


class Failure(Event):
    kind: Literal["failure"] = "failure"
    generation: Gen | None = None
    cause: Cause
    rank: Rank | None = None
    node_id: Name | None = None
    exit_code: int | None = None
    signal: Name | None = None
    message: Text = ""
    log_tail: LogTail = Field(default_factory=list)
    newest_checkpoint_step: Step | None = None
    # The newest step every rank held in the memory tier (rank 0's records say it).
    newest_memory_step: Step | None = None
    last_step: Step | None = None
    other_exits: list[JsonObject] = Field(default_factory=list, max_length=4096)
    suspects: list[JsonObject] | None = Field(None, max_length=4096)
    stacks: list[Text] | None = Field(None, max_length=4096)
    error: Text | None = None
    # How the job recovers from it: the survivors in place with a replacement for the
    # failed rank(s) (``in_job``), or every rank restarted from the best tier (``restart``),
    # and why that path (the first condition of in-job recovery that did not hold).
    recovery_path: Literal["in_job", "restart"] | None = None
    recovery_reason: Text | None = None


class CheckpointCommitted(Event):
    kind: Literal["checkpoint_committed"] = "checkpoint_committed"
    generation: Gen | None = None
    rank: Rank | None = None
    step: Step
    path: Text | None = None
    tier: Name | None = None
    tokens: Count | None = None
    blocking_s: Seconds | None = None
    save_s: Seconds | None = None
    bytes: Count | None = None
    via: Name | None = None
    upload_s: Seconds | None = None
    retries: Count | None = None


class CheckpointPruned(Event):
    kind: Literal["checkpoint_pruned"] = "checkpoint_pruned"
    generation: Gen | None = None
    rank: Rank | None = None
    steps: list[Step] = Field(default_factory=list, max_length=100_000)
    tier: Name | None = None
    reason: Text | None = None
    failing: list[Step] = Field(default_factory=list, max_length=100_000)  # kept: unverified


class FirstStep(Event):
    kind: Literal["first_step"] = "first_step"
    generation: Gen
    step: Step
    step_ts: Finite | None = None


class Progress(Event):
    kind: Literal["progress"] = "progress"
    generation: Gen
    step: Step
    tokens: Count | None = None


class Calibration(Event):
    kind: Literal["calibration"] = "calibration"
    max_interval_s: Seconds | None = None
    training_timeout_s: Seconds
    intervals: Count | None = None  # step intervals measured (the floor comes down after N)


class Chaos(_OpenEvent):
    kind: Literal["chaos"] = "chaos"
    id: Name
    rank: Rank | None = None
    signal: Name | None = None
    step: Step | None = None
    node_id: Name | None = None
    generation: Gen | None = None
    at: Name | None = None


class StabilityFired(_OpenEvent):
    """A stability rule fired; its figures (grad_norm, running_avg, ...) stand beside."""

    kind: Literal["stability"] = "stability"
    event: Name
    rule: Name
    action: Name
    step: Step | None = None
    generation: Gen | None = None
    batch: Count | None = None


class Rollback(Event):
    kind: Literal["rollback"] = "rollback"
    action: Name
    generation: Gen
    trigger: JsonObject = Field(default_factory=dict)
    detected_step: Step | None = None
    onset_step: Step | None = None
    onset_batch: Count | None = None
    restore_max_step: Step | None = None
    restore_step: Step | None = None
    skip_window: list[Step] | None = Field(None, max_length=2)
    lr_scale: Finite = 1.0
    lr_scale_total: Finite = 1.0
    discarded_checkpoints: list[Step] = Field(default_factory=list, max_length=100_000)
    from_step: Step | None = None
    wasted_steps: Count | None = None


class HealthRound(Event):
    kind: Literal["health_round"] = "health_round"
    round: Name
    level: Name
    nodes: list[Name] = Field(default_factory=list, max_length=100_000)
    failed: dict[Name, list[Name]] = Field(default_factory=dict)
    duration_s: Seconds | None = None


class HealthResult(_OpenEvent):
    kind: Literal["health"] = "health"
    round: Name = ""
    node_id: Name | None = None
    check: Name = "?"
    ok: bool = True
    severity: Name | None = None
    message: Text = ""
    value: Json = None
    duration_s: Seconds | None = None
    details: JsonObject | None = None


class WorkerNote(_OpenEvent):
    """A worker event with a known name and no fold of its own (resumed, startup, the
    checkpoint tier's reports...): its data travel as bounded JSON beside the rank."""

    kind: NoteKind
    generation: Gen | None = None
    rank: Rank | None = None
    node_id: Name | None = None
    name: Name | None = None  # for worker_event: the name the worker gave
    step: Step | None = None
    load_s: Seconds | None = None


class ProfileRequested(Event):
    """The operator asked for a profile: ``ranks`` profile steps ``start_step`` ..
    ``start_step + steps - 1`` into ``dir`` (``RUN_DIR/profiles/<start_step>``)."""

    kind: Literal["profile_requested"] = "profile_requested"
    id: Count
    generation: Gen
    start_step: Step
    steps: Count
    ranks: list[Rank] = Field(default_factory=list, max_length=1 << 20)
    dir: Text = ""


class ProfileWritten(Event):
    """A rank wrote its trace (``first_step`` > ``start_step``: the order reached it late)."""

    kind: Literal["profile_written"] = "profile_written"
    id: Count
    generation: Gen | None = None
    rank: Rank
    node_id: Name | None = None
    start_step: Step
    first_step: Step | None = None
    last_step: Step | None = None
    path: Text = ""
    bytes: Count | None = None
    profiled_s: Seconds | None = None
    export_s: Seconds | None = None


class ProfileFailed(Event):
    kind: Literal["profile_failed"] = "profile_failed"
    id: Count | None = None
    generation: Gen | None = None
    rank: Rank
    node_id: Name | None = None
    start_step: Step | None = None
    error: Text = ""


class Straggler(Event):
    """The straggler detector named a node (``action`` "named"), saw it catch up
    ("cleared"), or excluded it at a restart with a spare to take its place ("excluded")."""

    kind: Literal["straggler"] = "straggler"
    action: Literal["named", "cleared", "excluded"]
    node_id: Name
    generation: Gen | None = None
    ranks: list[Rank] = Field(default_factory=list, max_length=4096)
    # The slowest of its ranks against the median of the other ranks: seconds a step.
    excess_s: Seconds | None = None
    step_time_s: Seconds | None = None
    data_wait_s: Seconds | None = None
    peer_step_time_s: Seconds | None = None
    peer_data_wait_s: Seconds | None = None
    window_s: Seconds | None = None
    reason: Text | None = None
class RestoreTier(Event):
    """Which checkpoint tier a generation restored from (memory, memory_partner: some ranks
    from their partner node's copy, durable, none) and why it passed faster ones over."""

    kind: Literal["restore_tier"] = "restore_tier"
    generation: Gen | None = None
    rank: Rank | None = None
    node_id: Name | None = None
    tier: Literal["memory", "memory_partner", "durable", "none"]
    step: Step
    reason: Text
    durable_step: Step | None = None
    partner_ranks: list[Rank] = Field(default_factory=list, max_length=4096)
    load_s: Seconds | None = None
    verify_s: Seconds | None = None


class MemoryTier(Event):
    """What the memory tier holds: one rank's copy, and rank 0's node in all."""

    kind: Literal["memory_tier"] = "memory_tier"
    generation: Gen | None = None
    rank: Rank | None = None
    node_id: Name | None = None
    step: Step
    bytes: Count
    node_bytes: Count
    node_budget_bytes: Count
    partner: bool = False


class MessageRejected(Event):
    """A message a node was not allowed to send, or that did not parse: nothing changed."""

    kind: Literal["message_rejected"] = "message_rejected"
    node_id: Name | None = None
    route: Name
    reason: Text
    count: Count = 1


class ResumeMismatch(Event):
    """The ranks of a generation resumed from different optimizer steps (a warning)."""

    kind: Literal["resume_mismatch"] = "resume_mismatch"
    generation: Gen | None = None
    steps: dict[Name, Step] = Field(default_factory=dict, max_length=4096)  # rank -> step
    message: Text = ""


class JournalSkipped(Event):
    """Lines of the journal a reader could not parse (reported once per reader)."""

    kind: Literal["journal_skipped"] = "journal_skipped"
    lines: Count
    reasons: list[Text] = Field(default_factory=list, max_length=20)


AnyEvent = Annotated[Union[  # noqa: UP007 (a discriminated union needs Union here)
    JobCreated, SupervisorStarted, Transition, NodeRegistered, NodeStateChanged,
    AgentSpawned, AgentsExpected, GenerationLaunched, RanksStarted, RanksStopped,
    RankExited, RanksExited, Failure, CheckpointCommitted, CheckpointPruned, FirstStep,
    Progress, Calibration, Chaos, StabilityFired, Rollback, HealthRound, HealthResult, WorkerNote,
    MessageRejected, JournalSkipped, ProfileRequested, ProfileWritten, ProfileFailed,
    Straggler, RestoreTier, MemoryTier, ResumeMismatch], Field(discriminator="kind")]

_ADAPTER: TypeAdapter[Any] = TypeAdapter(AnyEvent)
_MODELS: dict[str, type[Event]] = {}
for _model in AnyEvent.__origin__.__args__:  # type: ignore[attr-defined]
    for _kind in _model.model_fields["kind"].annotation.__args__:
        _MODELS[_kind] = _model


class Envelope(BaseModel):
    """A journal line as read back: the journal's own numbering and time, and the event."""

    model_config = ConfigDict(frozen=True)
    seq: int
    ts: float
    event: Any  # an Event

    @property
    def kind(self) -> str:
        return self.event.kind


def parse_event(raw: Any) -> tuple[Envelope | None, str | None]:
    """A raw journal line's dict as a typed event, or ``(None, why)``; never raises."""
    if not isinstance(raw, dict):
        return None, "not a JSON object"
    kind = raw.get("kind")
    model = _MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        return None, f"unknown kind {str(kind)[:64]!r}"
    seq, ts = raw.get("seq", 0), raw.get("ts", 0.0)
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(ts, int | float) \
            or isinstance(ts, bool) or not math.isfinite(ts):
        return None, f"{kind}: bad envelope"
    known = model.model_fields.keys() | {f.alias for f in model.model_fields.values()
                                         if f.alias}
    data = raw if model.model_config.get("extra") == "allow" else \
        {k: v for k, v in raw.items() if k in known}
    data = {k: v for k, v in data.items() if k not in ("seq", "ts")}
    try:
        event = model.model_validate(data)
    except (ValidationError, ValueError) as exc:
        return None, f"{kind}: {_first_problem(exc)}"
    return Envelope(seq=seq, ts=float(ts), event=event), None


def as_envelope(event: Envelope | dict[str, Any]) -> Envelope | None:
    """A fold's input as a typed event: an Envelope as it is, a raw dict (a test's, a
    tool's) parsed, None for one that does not parse (skipped, as the reader would)."""
    if isinstance(event, dict):
        return parse_event(event)[0]
    return event


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False)[0]
        return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"[:200]
    return str(exc)[:200]


def to_line_dict(seq: int, ts: float, event: Event) -> dict[str, Any]:
    """The JSON object a journal line holds for ``event``."""
    return {"seq": seq, "ts": ts, "kind": event.kind, **event.fields()}
