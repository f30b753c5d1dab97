"""Fault injection, all of it: one typed plan and the wrappers that apply it.

Nothing outside this module decides what a fault does. The pieces of the product that
faults are injected into only accept a wrapper or a hook:

- The supervisor's :class:`ChaosDriver` decides which injections are still due (each fires
  once per job, even across restarts of the supervisor) and hands a generation its
  :class:`ChaosPlan`, which travels to the ranks as ``ORCH_CHAOS`` (built and parsed by
  ``orchestrator.contracts.env``, parsed into this type before any of it is used).
- In a rank: :func:`arm_worker` hooks the worker SDK's step reports (a rank signals itself
  right after the step a kill names, so it lands on that exact step); :func:`start_exit_code`
  is the trainer's fail-at-start; :func:`wrap_loader` poisons batches (their loss scale),
  :func:`wrap_stepper` slows a generation's first step or every step of a slow rank, and
  :func:`wrap_checkpointer` slows saves and the final commit.
- In a health check process: :func:`wrap_check` makes a check fail or hang, and
  :func:`slowed` delays every timed transfer of the network test (a slow link).

Interval kills are sent by the supervisor through the agent (``due_interval``).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# A poisoned batch (chaos) scales its loss, hence its gradients, by this much: a gradient
# explosion the stability detectors must catch, reproducible from the batch index alone.
POISON_SCALE = 1e4

Signal = Literal["SIGKILL", "SIGTERM", "SIGSEGV", "SIGSTOP"]
_Seconds = Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)]
_Rank = Annotated[int, Field(ge=0, le=1_000_000)]


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StepKill(_Plan):
    """A rank signals itself right after ``step`` (its ``chaos`` event marks it fired)."""

    id: str = Field(max_length=64)
    rank: _Rank
    step: Annotated[int, Field(ge=1)]
    signal: Signal = "SIGKILL"


class ChaosPlan(_Plan):
    """What a generation's ranks inject (``ORCH_CHAOS``); empty by default."""

    kills: list[StepKill] = Field(default_factory=list, max_length=10_000)
    poison_batches: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list,
                                                               max_length=100_000)
    fail_at_start_rank: _Rank | None = None
    fail_rejoin_rank: _Rank | None = None
    slow_checkpoint_s: _Seconds = 0.0
    slow_final_commit_s: _Seconds = 0.0
    slow_first_step_s: _Seconds = 0.0
    slow_abort_s: _Seconds = 0.0
    # rank -> seconds added to each of its steps (a throttled GPU, a noisy neighbour).
    slow_ranks: dict[_Rank, _Seconds] = Field(default_factory=dict, max_length=100_000)
    # n -> seconds added to each generation's n-th step on every rank (a recompile,
    # page-locking, a collection: one slow step that does not recur).
    slow_steps: dict[Annotated[int, Field(ge=1)], _Seconds] = Field(default_factory=dict,
                                                                     max_length=10_000)

    @classmethod
    def parse(cls, raw: str) -> ChaosPlan:
        """``ORCH_CHAOS``'s text; raises ``pydantic.ValidationError`` naming the field."""
        return cls.model_validate_json(raw or "{}")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_defaults=True)

    @property
    def empty(self) -> bool:
        return self == ChaosPlan()


# -- the supervisor's part ---------------------------------------------------------------
@dataclass(frozen=True)
class Injection:
    id: str
    rank: int
    signal: str
    step: int | None  # the step that triggered it (None for interval kills)


class ChaosDriver:
    """Which injections are due: each fires once per job (``fired`` comes from the journal)."""

    def __init__(self, cfg: Any, world_size: int, fired: set[str]) -> None:
        # cfg: the config's chaos section (orchestrator.config.schema.ChaosConfig), not
        # imported even for its type: the config imports the contracts, not the reverse.
        self.cfg = cfg
        self.world_size = world_size
        self.fired = set(fired)
        self._rng = random.Random(cfg.seed)
        # Resolve "random" ranks up front from the seed, so a restarted supervisor picks the
        # same ranks as the one before it.
        self._targets = [spec.rank if spec.rank != "random" else self._rng.randrange(world_size)
                         for spec in cfg.kill]
        self._interval_count = sum(1 for f in fired if f.startswith("interval-"))
        self._interval_started: float | None = None

    def pending(self) -> list[StepKill]:
        """Step kills not yet fired, with their ranks resolved, for the next generation."""
        return [StepKill(id=f"kill-{i}", rank=self._targets[i], step=spec.step,
                         signal=spec.signal)
                for i, spec in enumerate(self.cfg.kill) if f"kill-{i}" not in self.fired]

    def plan(self) -> ChaosPlan:
        """The next generation's plan: the config's standing faults plus the kills due."""
        c = self.cfg
        return ChaosPlan(kills=self.pending(), poison_batches=list(c.poison_batches),
                         fail_at_start_rank=c.fail_at_start_rank,
                         fail_rejoin_rank=c.fail_rejoin_rank,
                         slow_checkpoint_s=c.slow_checkpoint_s,
                         slow_final_commit_s=c.slow_final_commit_s,
                         slow_first_step_s=c.slow_first_step_s,
                         slow_abort_s=c.slow_abort_s,
                         slow_ranks=dict(c.slow_ranks), slow_steps=dict(c.slow_steps))

    def mark_fired(self, key: str) -> None:
        self.fired.add(key)

    def due_interval(self, running_since: float | None, now: float) -> list[Injection]:
        """A random-rank kill every ``kill_interval_s`` seconds of RUNNING."""
        interval = self.cfg.kill_interval_s
        if interval is None or running_since is None:
            self._interval_started = None
            return []
        if self._interval_started is None:
            self._interval_started = running_since
        if now - self._interval_started < interval:
            return []
        self._interval_started = now
        self._interval_count += 1
        key = f"interval-{self._interval_count}"
        self.fired.add(key)
        return [Injection(key, self._rng.randrange(self.world_size), "SIGKILL", None)]


# -- a rank's part ------------------------------------------------------------------------
def arm_worker(worker: Any, plan: ChaosPlan, rank: int,
               kill: Callable[[int, int], None] = os.kill) -> None:
    """Hook this rank's step kills into the worker SDK's step reports."""
    kills = {k.step: k for k in plan.kills if k.rank == rank}
    if not kills:
        return

    def after_step(step: int) -> None:
        due = kills.get(step)
        if due is None:
            return
        worker.beat_now()  # the supervisor sees the step the kill landed on
        # Marks it fired before we die: acknowledged, so the supervisor has it before our
        # exit and does not plan this kill again for the generation that replaces us.
        worker.event_acknowledged("chaos", **due.model_dump())
        kill(os.getpid(), getattr(signal, due.signal))

    worker.on_step(after_step)


START_FAILURE = "chaos: failing at start-up (chaos.fail_at_start_rank)"


REJOIN_FAILURE = "chaos: failing the in-place rejoin (chaos.fail_rejoin_rank)"


def fails_rejoin(plan: ChaosPlan, rank: int) -> bool:
    """Whether this rank fails an in-job recovery midway (``fail_rejoin_rank``: its new
    process groups are made, then it gives up), to show the fall back to a full restart."""
    return plan.fail_rejoin_rank == rank


def start_exit_code(plan: ChaosPlan, rank: int) -> int | None:
    """The exit code this rank fails its start-up with (``fail_at_start_rank``), if any."""
    return 3 if plan.fail_at_start_rank == rank else None


class _Proxy:
    """Everything but the wrapped methods goes to the wrapped object."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _PoisonLoader(_Proxy):
    def __init__(self, inner: Any, batches: frozenset[int]) -> None:
        super().__init__(inner)
        self._batches = batches

    def next_batch(self) -> Any:
        batch = self._inner.next_batch()
        if batch.index in self._batches:
            batch = dataclasses.replace(batch, loss_scale=POISON_SCALE)
        return batch


def wrap_loader(loader: Any, plan: ChaosPlan) -> Any:
    """Batches named by ``poison_batches`` come with their loss scaled by POISON_SCALE."""
    if not plan.poison_batches:
        return loader
    return _PoisonLoader(loader, frozenset(plan.poison_batches))


class _SlowStepper(_Proxy):
    def __init__(self, inner: Any, first_s: float, every_s: float,
                 sleep: Callable[[float], None], nth: dict[int, float] | None = None) -> None:
        super().__init__(inner)
        self._first_s, self._every_s, self._sleep = first_s, every_s, sleep
        self._nth, self._n = dict(nth or {}), 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = self._inner.step(*args, **kwargs)
        self._n += 1
        delay = self._every_s + self._first_s + self._nth.get(self._n, 0.0)
        self._first_s = 0.0
        if delay:
            self._sleep(delay)
        return out


def wrap_stepper(stepper: Any, plan: ChaosPlan, rank: int,
                 sleep: Callable[[float], None] = time.sleep) -> Any:
    """A generation's first step takes ``slow_first_step_s`` longer, its n-th step
    ``slow_steps[n]`` longer; every step of a rank in ``slow_ranks`` takes its seconds longer
    (inside the step: its step time shows it)."""
    every = plan.slow_ranks.get(rank, 0.0)
    if not plan.slow_first_step_s and not every and not plan.slow_steps:
        return stepper
    return _SlowStepper(stepper, plan.slow_first_step_s, every, sleep, plan.slow_steps)


class _SlowCheckpointer(_Proxy):
    def __init__(self, inner: Any, save_s: float, final_s: float,
                 sleep: Callable[[float], None]) -> None:
        super().__init__(inner)
        self._save_s, self._final_s, self._sleep = save_s, final_s, sleep

    def save(self, *args: Any, **kwargs: Any) -> Any:
        if self._save_s:
            self._sleep(self._save_s)
        return self._inner.save(*args, **kwargs)

    def save_from(self, *args: Any, **kwargs: Any) -> Any:
        out = self._inner.save_from(*args, **kwargs)
        if out is not None and self._save_s:  # None: ``save`` follows, and sleeps
            self._sleep(self._save_s)
        return out

    def finish(self, *args: Any, **kwargs: Any) -> Any:
        if self._final_s:
            self._sleep(self._final_s)
        return self._inner.finish(*args, **kwargs)


def wrap_checkpointer(checkpointer: Any, plan: ChaosPlan, rank: int = 0,
                      sleep: Callable[[float], None] = time.sleep) -> Any:
    """Every save blocks ``slow_checkpoint_s`` longer; the final commit (``finish``) takes
    ``slow_final_commit_s`` longer on rank 0, the rank that commits: its peers are done
    with the save and wait for it in the teardown, where a slow commit must not be judged a
    hang."""
    final_s = plan.slow_final_commit_s if rank == 0 else 0.0
    if not plan.slow_checkpoint_s and not final_s:
        return checkpointer
    return _SlowCheckpointer(checkpointer, plan.slow_checkpoint_s, final_s, sleep)


# -- a health check process's part --------------------------------------------------------
def wrap_check(check: Callable[[], Any], *, hang: bool, fail: bool,
               failed: Callable[..., Any]) -> Callable[[], Any]:
    """``health.chaos``: a check that hangs (stands for one stuck in a driver call) or whose
    outcome is forced to a failure (``failed`` builds it from the real outcome's text)."""
    if not hang and not fail:
        return check

    def run() -> Any:
        if hang:
            while True:
                time.sleep(3600)
        outcome = check()
        return failed(f"forced to fail by health.chaos.fail (the check said: "
                      f"{outcome.message})", **outcome.details)

    return run


def slowed(op: Callable[[], None], delay_s: float,
           sleep: Callable[[float], None] = time.sleep) -> Callable[[], None]:
    """``health.chaos.slow_network``: every call waits ``delay_s`` first (a slow NIC)."""
    if not delay_s:
        return op

    def run() -> None:
        sleep(delay_s)
        op()

    return run
