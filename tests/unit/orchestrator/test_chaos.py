"""orchestrator.contracts.chaos: the one place faults are defined, parsed and applied."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator.contracts import chaos
from orchestrator.contracts import env as ec
from orchestrator.contracts.chaos import POISON_SCALE, ChaosDriver, ChaosPlan, StepKill
from orchestrator.config.schema import ChaosConfig, KillSpec

ROOT = Path(__file__).resolve().parents[3]


def test_the_plan_round_trips_through_the_environment() -> None:
    plan = ChaosPlan(kills=[StepKill(id="kill-0", rank=1, step=3, signal="SIGSTOP")],
                     poison_batches=[4, 9], fail_at_start_rank=2, slow_checkpoint_s=0.5,
                     slow_final_commit_s=2.0, slow_first_step_s=1.0, slow_ranks={1: 0.25})
    env = ec.GenerationEnv(chaos=plan).to_env()
    assert ec.GenerationEnv.from_env(env).chaos == plan
    assert ec.GenerationEnv.from_env({}).chaos == ChaosPlan()
    assert ChaosPlan().empty and not plan.empty


@pytest.mark.parametrize("raw", [
    '{"kills": [{"id": "k", "rank": -1, "step": 3}]}',
    '{"kills": [{"id": "k", "rank": 0, "step": 3, "signal": "SIGHUP"}]}',
    '{"slow_checkpoint_s": 1e400}', '{"slow_checkpoint_s": -1}', '{"slow_ranks": {"a": 1}}',
    '{"poison_batches": ["1"]}', '{"unknown": 1}', '[]', 'not json', '{"slow_ranks": {"1": NaN}}',
])
def test_a_bad_plan_is_an_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ec.EnvError, match="ORCH_CHAOS"):
        ec.GenerationEnv.from_env({ec.CHAOS: raw})


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=20), c,
                                                                        max_size=4),
                     max_leaves=20)
_keys = st.sampled_from(["kills", "poison_batches", "fail_at_start_rank", "slow_checkpoint_s",
                         "slow_final_commit_s", "slow_first_step_s", "slow_ranks"])


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys | st.text(max_size=10), _json, max_size=6))
def test_any_json_is_a_plan_or_a_validation_error(raw: dict[str, Any]) -> None:
    try:
        text = json.dumps(raw)
    except ValueError:
        return
    try:
        plan = ChaosPlan.parse(text)
    except ValidationError:
        return
    assert ChaosPlan.parse(plan.to_json()) == plan  # what the supervisor sends, ranks read


def test_the_driver_plans_the_config_and_only_kills_not_yet_fired() -> None:
    cfg = ChaosConfig(kill=[KillSpec(step=5, rank=0), KillSpec(step=9, rank=1, signal="SIGSTOP")],
                      poison_batches=[3], slow_ranks={1: 0.5}, slow_final_commit_s=4.0)
    driver = ChaosDriver(cfg, world_size=2, fired={"kill-0"})
    plan = driver.plan()
    assert plan.kills == [StepKill(id="kill-1", rank=1, step=9, signal="SIGSTOP")]
    assert plan.poison_batches == [3] and plan.slow_ranks == {1: 0.5}
    assert plan.slow_final_commit_s == 4.0


class FakeWorker:
    def __init__(self) -> None:
        self.hooks: list[Any] = []
        self.calls: list[Any] = []

    def on_step(self, hook: Any) -> None:
        self.hooks.append(hook)

    def beat_now(self) -> None:
        self.calls.append("beat")

    def event_acknowledged(self, name: str, **data: Any) -> bool:
        self.calls.append((name, data))
        return True


def test_a_kill_lands_right_after_its_step_on_its_rank_only() -> None:
    plan = ChaosPlan(kills=[StepKill(id="kill-0", rank=1, step=3),
                            StepKill(id="kill-1", rank=0, step=2, signal="SIGSTOP")])
    signals: list[int] = []
    mine, other = FakeWorker(), FakeWorker()
    chaos.arm_worker(mine, plan, rank=1, kill=lambda pid, sig: signals.append(sig))
    chaos.arm_worker(FakeWorker(), ChaosPlan(), rank=1)  # nothing to arm: no hook at all
    for step in (1, 2):
        mine.hooks[0](step)
    assert signals == [] and mine.calls == []
    mine.hooks[0](3)
    assert signals == [signal.SIGKILL]
    assert mine.calls == ["beat", ("chaos", {"id": "kill-0", "rank": 1, "step": 3,
                                             "signal": "SIGKILL"})]
    chaos.arm_worker(other, plan, rank=0, kill=lambda pid, sig: signals.append(sig))
    other.hooks[0](2)
    assert signals[-1] == signal.SIGSTOP


@dataclass(frozen=True)
class Batch:
    index: int
    loss_scale: float = 1.0


class Loader:
    dp_world = 2

    def __init__(self) -> None:
        self.i = 0

    def next_batch(self) -> Batch:
        self.i += 1
        return Batch(self.i)


def test_poisoned_batches_carry_the_poison_scale_and_the_rest_pass_through() -> None:
    loader = Loader()
    assert chaos.wrap_loader(loader, ChaosPlan()) is loader
    wrapped = chaos.wrap_loader(loader, ChaosPlan(poison_batches=[2]))
    scales = [wrapped.next_batch().loss_scale for _ in range(3)]
    assert scales == [1.0, POISON_SCALE, 1.0]
    assert wrapped.dp_world == 2  # everything else is the loader's


class Stepper:
    def __init__(self) -> None:
        self.steps = 0

    def step(self, *args: Any) -> int:
        self.steps += 1
        return self.steps


def test_slow_first_step_once_and_a_slow_rank_every_step() -> None:
    slept: list[float] = []
    stepper = Stepper()
    assert chaos.wrap_stepper(stepper, ChaosPlan(slow_ranks={1: 0.5}), rank=0) is stepper
    plan = ChaosPlan(slow_first_step_s=2.0, slow_ranks={1: 0.5})
    wrapped = chaos.wrap_stepper(stepper, plan, rank=1, sleep=slept.append)
    assert [wrapped.step() for _ in range(3)] == [1, 2, 3]
    assert slept == [2.5, 0.5, 0.5]
    first_only = chaos.wrap_stepper(Stepper(), plan, rank=0, sleep=slept.append)
    first_only.step()
    first_only.step()
    assert slept[3:] == [2.0]


class Checkpointer:
    def __init__(self) -> None:
        self.log: list[str] = []

    def save(self, step: int) -> float:
        self.log.append(f"save {step}")
        return 0.01

    def save_from(self, step: int, served: bool) -> float | None:
        self.log.append(f"save_from {step}")
        return 0.01 if served else None

    def finish(self) -> None:
        self.log.append("finish")


def test_slow_saves_and_a_slow_final_commit() -> None:
    slept: list[float] = []
    inner = Checkpointer()
    assert chaos.wrap_checkpointer(inner, ChaosPlan()) is inner
    wrapped = chaos.wrap_checkpointer(inner, ChaosPlan(slow_final_commit_s=3.0),
                                      sleep=slept.append)
    assert wrapped.save(5) == 0.01 and slept == []
    wrapped.finish()
    assert slept == [3.0] and inner.log == ["save 5", "finish"]
    # Only rank 0 commits: a peer's finish is not slowed (it waits in the teardown instead).
    assert chaos.wrap_checkpointer(inner, ChaosPlan(slow_final_commit_s=3.0), rank=1) is inner
    both = chaos.wrap_checkpointer(inner, ChaosPlan(slow_checkpoint_s=1.0), sleep=slept.append)
    both.save(6)
    both.finish()
    assert slept == [3.0, 1.0]
    # A save from the memory tier's copy is slowed as well; one it cannot serve is not (the
    # plain save that follows it is).
    assert both.save_from(7, True) == 0.01 and slept == [3.0, 1.0, 1.0]
    assert both.save_from(8, False) is None and slept == [3.0, 1.0, 1.0]


def test_a_forced_failure_keeps_the_real_outcome_text() -> None:
    from orchestrator.health.base import failed, passed

    def check() -> Any:
        return passed("disk ok", free_gb=10)

    assert chaos.wrap_check(check, hang=False, fail=False, failed=failed) is check
    out = chaos.wrap_check(check, hang=False, fail=True, failed=failed)()
    assert "forced to fail" in out.message and "disk ok" in out.message


def test_a_slowed_transfer_waits_first() -> None:
    calls: list[Any] = []
    op = chaos.slowed(lambda: calls.append("op"), 0.05, sleep=calls.append)
    op()
    assert calls == [0.05, "op"]


def test_no_other_module_interprets_chaos() -> None:
    """Chaos lives in one module: the knobs are read only there (and in the config schema
    and the health config, which declare them)."""
    knobs = ("poison_batches", "slow_checkpoint_s", "slow_first_step_s", "slow_final_commit_s",
             "fail_at_start_rank", "slow_ranks", "chaos_hang", "chaos_fail", "os.kill(os.getpid()")
    allowed = {"orchestrator/contracts/chaos.py", "orchestrator/config/schema.py"}
    offenders = []
    for base in ("orchestrator", "trainer", "stability"):
        for path in (ROOT / base).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in allowed:
                continue
            text = path.read_text()
            offenders += [f"{rel}: {k}" for k in knobs if k in text]
    # The health child passes its node's lists to chaos.wrap_check; the context declares them.
    offenders = [o for o in offenders if not o.startswith(("orchestrator/health/context.py",
                                                           "orchestrator/health/child.py"))]
    assert offenders == []
