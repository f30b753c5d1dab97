"""The events a rank sends through the worker SDK, typed per name (a tagged union on ``name``).

``WorkerEvent.data`` is checked here against the model its name selects: the trainer's
checkpoint and start-up events have fixed fields with types and ranges (a
``checkpoint_committed`` must carry a step that is an integer >= 0); any other name (a user
script's own event) carries a flat mapping of scalars. In every case the data may not name
the fields that the supervisor's journal adds itself (generation, rank, node_id, kind, seq,
ts, name), so no event can overwrite them.

Known events accept extra scalar fields besides their own (a trainer of a newer version may
add one), never a nested value and never a reserved key.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

# A closed set: what ``signal.Signals(n).name`` gives on Linux for a process's end.
Signal = Literal["SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS",
                 "SIGFPE", "SIGKILL", "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM",
                 "SIGTERM", "SIGSTKFLT", "SIGCHLD", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN",
                 "SIGTTOU", "SIGURG", "SIGXCPU", "SIGXFSZ", "SIGVTALRM", "SIGPROF", "SIGWINCH",
                 "SIGIO", "SIGPWR", "SIGSYS", "SIGRTMIN", "SIGRTMAX"]

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# Wall-clock seconds since the epoch: finite, and not past the year 2500.
Timestamp = Annotated[float, Field(ge=0, le=1.7e10, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=1 << 62)]
Step = Annotated[int, Field(ge=0, le=1 << 53)]
ShortStr = Annotated[str, StringConstraints(max_length=256)]
Text = Annotated[str, StringConstraints(max_length=4096)]
Scalar = FiniteFloat | int | bool | None | Text

# Envelope fields of a journal line or an event: never taken from a node's or a rank's data
# (``contracts.events`` refuses them in any open event's data too).
RESERVED_KEYS = frozenset({"generation", "rank", "node_id", "kind", "seq", "ts", "name"})
# A rank's event data also may not set the agent's observation discriminator.
RANK_DATA_RESERVED = RESERVED_KEYS | {"type"}


class EventData(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    __pydantic_extra__: dict[str, Scalar]  # type: ignore[assignment]


class CheckpointCommitted(EventData):
    step: Step
    tier: ShortStr | None = None
    path: Text | None = None
    via: Literal["upload"] | None = None
    tokens: Count | None = None
    bytes: Count | None = None
    blocking_s: Seconds | None = None
    save_s: Seconds | None = None
    upload_s: Seconds | None = None
    retries: Count | None = None


class CheckpointFailed(EventData):
    step: Step
    path: Text | None = None
    error: Text | None = None
    failures_in_a_row: Count | None = None
    previous_step: Step | None = None
    retries: Count | None = None


class CheckpointFenced(EventData):
    """A save or an upload refused by the fence: a newer generation owns the checkpoints."""

    step: Step
    path: Text | None = None
    error: Text | None = None


class CheckpointPruned(EventData):
    steps: list[Step] = Field(max_length=100_000)
    tier: ShortStr | None = None
    failing: list[Step] = Field(default_factory=list, max_length=100_000)  # kept: unverified


class CheckpointSkipped(EventData):
    step: Step
    path: Text | None = None
    tier: ShortStr | None = None
    reason: Text | None = None
    problems: list[Text] = Field(default_factory=list, max_length=100)
    signature: Text | None = None


class CheckpointFetched(EventData):
    step: Step
    source: Text | None = None
    path: Text | None = None


class CheckpointUploadRetry(EventData):
    step: Step
    attempt: Count
    error: Text | None = None
    sleep_s: Seconds | None = None


class CheckpointUploadSkipped(EventData):
    step: Step
    superseded_by: Step


class Resumed(EventData):
    step: Step
    path: Text | None = None
    load_s: Seconds | None = None
    tier: ShortStr | None = None
    fetched_from: Text | None = None


class RestoreTier(EventData):
    """Which tier a generation restored from, and why it passed the faster ones over."""

    tier: Literal["memory", "memory_partner", "durable", "none"]
    step: Step
    reason: Text
    durable_step: Step | None = None
    partner_ranks: list[Annotated[int, Field(ge=0, le=1 << 24)]] = Field(
        default_factory=list, max_length=4096)
    load_s: Seconds | None = None
    verify_s: Seconds | None = None


class MemoryTier(EventData):
    """What a node's memory tier holds (rank 0's node, once a generation)."""

    step: Step
    bytes: Count  # one rank's copy
    node_bytes: Count  # the node's slot files, pages in use
    node_budget_bytes: Count  # the node's slot files, their size
    partner: bool


class Startup(EventData):
    """Wall times of a (re)start's milestones (process start, imports, process group...)."""

    __pydantic_extra__: dict[str, Annotated[float, Field(ge=0, le=1.7e10,  # type: ignore
                                                         allow_inf_nan=False)] | None]
    first_step_done: Annotated[float, Field(ge=0, le=1.7e10, allow_inf_nan=False)]
    warm: bool = False  # started in a pre-imported spare interpreter


class ParamsDigest(EventData):
    step: Step
    crc32: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,16}$")]
    numel: Count


class Chaos(EventData):
    """A step kill the rank carries out on itself (``rank`` must be the sender's)."""

    id: Annotated[str, StringConstraints(pattern=r"^[a-z]+-[0-9]{1,9}$")]
    chaos_rank: int = Field(alias="rank", ge=0)
    step: Step | None = None
    signal: Signal


class StabilitySkip(EventData):
    step: Step


class ProfileWritten(EventData):
    """A rank wrote its profile's trace (``orchestrator.worker.profiling``)."""

    id: Annotated[int, Field(ge=1, le=1 << 31)]
    start_step: Step
    first_step: Step
    last_step: Step
    path: Text
    bytes: Count
    profiled_s: Seconds | None = None
    export_s: Seconds | None = None


class ProfileFailed(EventData):
    id: Annotated[int, Field(ge=1, le=1 << 31)] | None = None
    start_step: Step | None = None
    error: Text


class Recovered(EventData):
    """A rank joined the next generation in place (in-job recovery) and restored ``step``;
    where its seconds went, each part from the end of the one before."""

    step: Step  # the step every rank restored
    abandoned_step: Step | None = None  # the step this rank had reached
    from_generation: Annotated[int, Field(ge=0, le=1 << 31)]
    tier: ShortStr
    wait_s: Seconds  # from the failed collective to the agent's order
    abort_s: Seconds  # aborting the old process groups, draining their threads
    group_s: Seconds  # the new process groups
    restore_s: Seconds  # choosing and loading the state
    total_s: Seconds
    # From the order's arrival to the failed collective's catch (negative: the collective
    # failed first), and each aborted group's backend and seconds ("nccl:0.52 gloo:0.00").
    order_lag_s: Annotated[float, Field(ge=-1e7, le=1e7, allow_inf_nan=False)] | None = None
    group_aborts: ShortStr | None = None


class RecoveryFailed(EventData):
    """A rank could not recover in place (the supervisor falls back to a full restart)."""

    error: Text


class Custom(EventData):
    """Any other name: a user script's own event, a flat mapping of scalars."""


_MODELS: dict[str, type[EventData]] = {
    "checkpoint_committed": CheckpointCommitted,
    "checkpoint_failed": CheckpointFailed,
    "checkpoint_pruned": CheckpointPruned,
    "checkpoint_skipped": CheckpointSkipped,
    "checkpoint_fetched": CheckpointFetched,
    "checkpoint_upload_retry": CheckpointUploadRetry,
    "checkpoint_upload_failed": CheckpointFailed,
    "checkpoint_upload_skipped": CheckpointUploadSkipped,
    "checkpoint_fenced": CheckpointFenced,
    "resumed": Resumed,
    "restore_tier": RestoreTier,
    "memory_tier": MemoryTier,
    "startup": Startup,
    "params_digest": ParamsDigest,
    "chaos": Chaos,
    "stability_skip": StabilitySkip,
    "profile_written": ProfileWritten,
    "profile_failed": ProfileFailed,
    "recovered": Recovered,
    "recovery_failed": RecoveryFailed,
}
KNOWN_NAMES = frozenset(_MODELS)
# Names the journal records as a note of that kind (``events.WorkerNote``): the events with no
# journal event of their own. A rank's event of any other name that has no journal event of
# its own (``params_digest``, a user script's) becomes a note of kind ``OTHER_NOTE`` that
# keeps the name in its ``name`` field.
NoteName = Literal["resumed", "checkpoint_failed", "checkpoint_skipped", "checkpoint_fetched",
                   "checkpoint_upload_retry", "checkpoint_upload_failed",
                   "checkpoint_upload_skipped", "checkpoint_fenced", "stability_skip",
                   "startup", "recovered", "recovery_failed"]
NOTE_NAMES = frozenset(get_args(NoteName))
OTHER_NOTE = "worker_event"
NoteKind = Literal[NoteName, "worker_event"]  # a note's kind: its name, or OTHER_NOTE
# Events only rank 0 sends (it commits checkpoints and speaks for the restore): the journal
# folds them into the job's view (the resume step, the newest checkpoint), so another rank's
# would be a forgery. ``startup`` is not among them: it is a note nothing folds, and a
# replacement rank of an in-job recovery sends its own start-up breakdown whatever its rank.
RANK0_NAMES = frozenset({"checkpoint_committed", "checkpoint_failed", "checkpoint_pruned",
                         "checkpoint_skipped", "checkpoint_fetched", "checkpoint_upload_retry",
                         "checkpoint_upload_failed", "checkpoint_upload_skipped", "resumed",
                         "restore_tier", "memory_tier"})
# Keys a data mapping may have at most (a user event is a handful of figures).
MAX_KEYS = 64


_KEY = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")


def model_for(name: str) -> type[EventData]:
    return _MODELS.get(name, Custom)


def validate_worker_data(name: str, rank: int, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` checked against ``name``'s model; returns it as plain JSON-able values.

    Raises ValueError naming the problem (pydantic turns it into a 422 entry)."""
    if len(data) > MAX_KEYS:
        raise ValueError(f"data has {len(data)} keys; at most {MAX_KEYS}")
    bad = [k for k in data if not _KEY.match(k)]
    if bad:
        raise ValueError(f"data keys must be lowercase identifiers, not {bad[0][:40]!r}")
    model = model_for(name)
    allowed = {"rank"} if model is Chaos else set()
    reserved = sorted(k for k in data if k in RANK_DATA_RESERVED and k not in allowed)
    if reserved:
        raise ValueError(f"data may not set {', '.join(reserved)} (the supervisor sets them)")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{name} data: {where}: {first['msg']}") from None
    if isinstance(parsed, Chaos) and parsed.chaos_rank != rank:
        raise ValueError(f"chaos data names rank {parsed.chaos_rank}, sent by rank {rank}")
    return parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
