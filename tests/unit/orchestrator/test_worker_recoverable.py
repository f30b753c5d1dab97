"""The worker SDK's in-job state (``ow.recoverable``) in one process: off outside the
orchestrator, the parts it accepts, and a save / restore round trip through a real memory
tier and a real gloo group of one. Two ranks, a kill and the in-place rollback:
tests/integration/test_user_script.py."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent.memory import NodeMemory
from orchestrator.contracts import env as ec
from orchestrator.worker.recoverable import Recoverable, RecoveryFailed
from orchestrator.worker.sdk import Worker
from trainer.checkpoint import signing

CASES = 300
TRUST = signing.Trust(b"k" * 32)  # the agent's key service signs for a real rank


class Counter:
    """A loader's position, as a script keeps it."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen = int(sd["seen"])


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Linear(4, 3)
    return net, torch.optim.Adam(net.parameters(), lr=0.1)


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    net(x).pow(2).mean().backward()
    opt.step()


def test_outside_the_orchestrator_it_only_reports_and_reraises() -> None:
    worker = Worker(env={})
    net, opt = model_and_optimizer(0)
    notes: list[str] = []
    state = Recoverable(worker, model=net, optimizer=opt, log=notes.append)
    assert not state.enabled and state.off_reason == "not running under the orchestrator"
    said = "in-job recovery and the memory tier off: not running under the orchestrator"
    assert notes == [said]
    assert state.restore() == 0
    state.step_done(3, loss=0.5)
    assert worker._step == 3 and state.progress.step == 3
    boom = RuntimeError("Connection reset by peer")  # a peer's failure, but no tier
    with pytest.raises(RuntimeError) as raised:
        state.recover(boom)
    assert raised.value is boom
    assert not worker.injob.enabled


@pytest.mark.parametrize("extra, error", [
    ({"app": Counter()}, ValueError), ({"progress": Counter()}, ValueError),
    ({"rng_rank00000": Counter()}, ValueError), ({"1st": Counter()}, ValueError),
    ({"ok": object()}, TypeError), ({f"p{i}": Counter() for i in range(65)}, ValueError),
])
def test_extra_parts_are_checked(extra: dict[str, Any], error: type[Exception]) -> None:
    net, opt = model_and_optimizer(0)
    with pytest.raises(error, match="recoverable"):
        Recoverable(Worker(env={}), model=net, optimizer=opt, extra=extra,
                    log=lambda _m: None)


def test_a_loader_without_state_is_refused() -> None:
    net, opt = model_and_optimizer(0)
    with pytest.raises(TypeError, match="loader must have state_dict"):
        Recoverable(Worker(env={}), model=net, optimizer=opt, loader=[1, 2, 3],
                    log=lambda _m: None)


@settings(max_examples=CASES, deadline=None)
@given(st.text(max_size=70))
def test_extra_part_names_fuzz(name: str) -> None:
    """A name is taken exactly when it is a short identifier that is not one of ours."""
    net, opt = model_and_optimizer(0)
    fine = bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,63}", name)) and name.isascii() \
        and name not in ("app", "progress", "data") and not name.startswith("rng_rank")
    try:
        state = Recoverable(Worker(env={}), model=net, optimizer=opt,
                            extra={name: Counter()}, log=lambda _m: None)
    except ValueError:
        assert not fine, name
    else:
        assert fine and name in state.parts, name


@pytest.fixture
def managed_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A rank's environment with the memory tier and in-job recovery on, the slots its
    agent would make, and a gloo group of one."""
    mem = NodeMemory(tmp_path, tmp_path / "run", "n0")
    mem.provision([0], 1, 1, 4 * 2**20, partner=False)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"checkpoint": {"memory_interval_steps": 2}}))
    env = {ec.AGENT_SOCKET: str(tmp_path / "no-agent.sock"), ec.CONFIG: str(cfg),
           ec.MEMORY_DIR: str(mem.path), ec.RUN_DIR: str(tmp_path / "run"),
           ec.IN_JOB_WAIT_S: "5", ec.JOB: "j", ec.GENERATION: "1", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        yield env
    finally:
        dist.destroy_process_group()


def test_state_saved_every_interval_restores_bit_exactly(managed_rank: dict[str, str]
                                                         ) -> None:
    worker = Worker(env=managed_rank)
    net, opt = model_and_optimizer(0)
    loader = Counter()
    state = Recoverable(worker, model=net, optimizer=opt, loader=loader,
                        log=lambda _m: None, trust=TRUST)
    assert state.enabled and worker.injob.enabled, state.off_reason
    assert state.restore() == 0  # a fresh start: nothing held
    for step in range(1, 6):
        train(net, opt, step)
        loader.seen += 4
        random.random()
        state.step_done(step, loss=1.0)
        if step == 4:
            state.memory.wait()
            want = {k: v.detach().clone() for k, v in net.state_dict().items()}
            want_adam = [s["exp_avg"].clone() for s in opt.state.values()]
            want_rng = (torch.get_rng_state(), random.getstate())
    state.close()
    # A new process's state (a replacement, or a restart): another seed, one step ahead.
    net2, opt2 = model_and_optimizer(7)
    loader2 = Counter()
    again = Recoverable(Worker(env=managed_rank), model=net2, optimizer=opt2,
                        loader=loader2, log=lambda _m: None, trust=TRUST)
    assert again.restore() == 4  # step 5 was never saved (interval 2)
    for k, v in net2.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert all(torch.equal(s["exp_avg"], w)
               for s, w in zip(opt2.state.values(), want_adam, strict=True))
    assert loader2.seen == 16 and again.progress.step == 4
    assert torch.equal(torch.get_rng_state(), want_rng[0]) and random.getstate() == want_rng[1]
    again.close()


def test_recover_without_an_order_falls_back(managed_rank: dict[str, str]) -> None:
    """A peer's failure with no order from the agent within the wait: the rank says why
    (``recovery_failed``) and raises, so the job restarts in full."""
    worker = Worker(env={**managed_rank, ec.IN_JOB_WAIT_S: "0.2"})
    events: list[tuple[str, dict[str, Any]]] = []
    worker.event = lambda name, **data: events.append((name, data))  # type: ignore[method-assign]
    net, opt = model_and_optimizer(0)
    state = Recoverable(worker, model=net, optimizer=opt, log=lambda _m: None, trust=TRUST)
    with pytest.raises(RecoveryFailed, match="no recover order within"):
        state.recover(RuntimeError("Connection closed by peer"))
    assert [n for n, _ in events] == ["recovery_failed"]
    own = ValueError("the script's own bug")
    with pytest.raises(ValueError) as raised:
        state.recover(own)  # not a peer's failure: the script's error as it was
    assert raised.value is own
    state.close()


def test_with_in_job_off_the_state_still_goes_to_memory(managed_rank: dict[str, str]) -> None:
    """restart.in_job off: a failure restarts every rank, and the restart resumes from the
    memory tier; only ``recover`` re-raises."""
    env = {k: v for k, v in managed_rank.items() if k != ec.IN_JOB_WAIT_S}
    worker = Worker(env=env)
    net, opt = model_and_optimizer(0)
    state = Recoverable(worker, model=net, optimizer=opt, log=lambda _m: None, trust=TRUST)
    assert state.enabled and state.in_job_off == "restart.in_job is off"
    assert not worker.injob.enabled
    for step in (1, 2):
        train(net, opt, step)
        state.step_done(step)
    state.close()
    boom = RuntimeError("Connection reset by peer")
    with pytest.raises(RuntimeError) as raised:
        state.recover(boom)
    assert raised.value is boom
    net2, opt2 = model_and_optimizer(3)
    again = Recoverable(Worker(env=env), model=net2, optimizer=opt2, log=lambda _m: None,
                        trust=TRUST)
    assert again.restore() == 2
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters(),
                                                 strict=True))
    again.close()
