"""The framework hooks in one process: torchtitan's training loop (its interface: torchtitan
itself does not run on a CPU-only host), the phases the preload hook marks in a script
without the SDK, and the job's opt-out. A real ``Worker`` (its beats kept, not sent), real
torch, a real checkpoint layout in a temporary directory."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.contracts import env as ec
from orchestrator.worker.hook import _framework_hooks_wanted
from orchestrator.worker.hooks import attach, core
from orchestrator.worker.hooks import hf as hf_hook
from orchestrator.worker.hooks import torchtitan as tt_hook
from orchestrator.worker.scriptphases import ScriptPhases
from orchestrator.worker.sdk import Worker
from trainer.checkpoint import layout


class _Worker(Worker):
    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(env=env)
        self.sent: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []

    def _send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True

    def event(self, name: str, **data: Any) -> None:
        self.events.append((name, data))

    def records(self) -> list[dict[str, Any]]:
        return [r for m in self.sent for r in m.get("records", [])] + self._records


def _managed(tmp: Path, job_cfg: dict[str, Any]) -> _Worker:
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps(job_cfg))
    env = {"RANK": "0", "WORLD_SIZE": "1"}
    env.update(ec.AgentEnv(agent_socket=str(tmp / "no-agent.sock"), config_path=str(cfg),
                           run_dir=str(tmp)).to_env())
    env.update(ec.GenerationEnv(job="t", generation=1,
                                checkpoint_root=str(tmp / "ckpt")).to_env())
    return _Worker(env)


# -- torchtitan's loop, as its Trainer.train and train_step call their parts --------------
class _Optimizers:
    def __init__(self, model: torch.nn.Module) -> None:
        self.optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2)]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)


class _Checkpointer:
    """torchtitan's CheckpointManager's interface: ``save(curr_step, last_step)`` writes
    ``<folder>/step-N`` every ``interval`` steps (DCP), ``load(step=-1)`` reads one."""

    def __init__(self, folder: Path, interval: int, state: dict[str, Any]) -> None:
        self.folder, self.interval, self.state = str(folder), interval, state
        self.loaded: int | None = None

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if curr_step % self.interval and not last_step:
            return
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=f"{self.folder}/step-{curr_step}")

    def load(self, step: int = -1) -> bool:
        if step == -1:
            return False
        import torch.distributed.checkpoint as dcp

        dcp.load(self.state, checkpoint_id=f"{self.folder}/step-{step}")
        self.loaded = step
        return True


def _trainer_module() -> types.SimpleNamespace:
    dist_utils = types.SimpleNamespace(
        clip_grad_norm_=lambda params, max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm))

    class Trainer:
        def __init__(self, folder: Path, steps: int, poison: int = -1) -> None:
            torch.manual_seed(0)
            self.model_parts = [torch.nn.Linear(4, 1)]
            self.optimizers = _Optimizers(self.model_parts[0])
            self.step, self.ntokens_seen, self.poison = 0, 0, poison
            self.config = types.SimpleNamespace(training=types.SimpleNamespace(steps=steps))
            self.checkpointer = _Checkpointer(folder, 5, {"model": self.model_parts[0]})
            self.validator = types.SimpleNamespace(validate=lambda parts, step: None)

        def forward_backward_step(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.model_parts[0](x).pow(2).mean()
            if self.step == self.poison:
                loss = loss * 1e4
            loss.backward()
            return loss

        def train_step(self, data: Any) -> None:
            self.optimizers.zero_grad()
            self.forward_backward_step(next(data))
            module.dist_utils.clip_grad_norm_(self.model_parts[0].parameters(), 1.0)
            self.optimizers.step()
            self.ntokens_seen += 8

        def train(self) -> None:  # torchtitan's Trainer.train, its calls in order
            self.checkpointer.load(step=-1)
            data = iter(lambda: torch.ones(8, 4), None)
            while self.step < self.config.training.steps:
                self.step += 1
                self.train_step(data)
                self.checkpointer.save(self.step, last_step=self.step == self.config.training.steps)
                self.validator.validate(self.model_parts, self.step)

    Trainer.__module__ = "torchtitan.trainer"
    module = types.SimpleNamespace(Trainer=Trainer, dist_utils=dist_utils)
    return module


def test_torchtitans_loop_reports_skips_commits_and_resumes_from_our_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = {"checkpoint": {"interval_steps": 5, "keep_last": 2},
           "stability": {"warmup_steps": 3,
                         "grad_spike": {"mode": "relative", "rel_margin": 9.0, "window": 4,
                                        "action": "skip_step"}}}
    worker = _managed(tmp_path, job)
    module = _trainer_module()
    tt_hook.patch_class(module)
    monkeypatch.setattr(core.ow, "current", lambda: worker)
    trainer = module.Trainer(tmp_path / "titan", steps=12, poison=8)
    assert attach(trainer) is trainer  # already attached when made: idempotent
    before = trainer.model_parts[0].weight.detach().clone()
    trainer.train()
    records = worker.records()
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(r["framework"] == "torchtitan" and r["loss"] >= 0 for r in records)
    poisoned = records[7]
    assert poisoned["skipped"] and poisoned["grad_norm"] > 100 * records[6]["grad_norm"]
    assert ("stability_skip", {"step": 8, "loss": poisoned["loss"],
                               "grad_norm": poisoned["grad_norm"]}) in worker.events
    assert not torch.equal(before, trainer.model_parts[0].weight)
    committed = [d["step"] for n, d in worker.events if n == "checkpoint_committed"]
    assert committed == [5, 10, 12]
    root = tmp_path / "ckpt" / "t"
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-00000010", "step-00000012"]
    assert layout.verify(str(root / "step-00000012")).ok
    # A restart: torchtitan is pointed at our newest committed checkpoint.
    again = module.Trainer(tmp_path / "titan2", steps=12)
    again.checkpointer.load(step=-1)
    assert again.checkpointer.loaded == 12
    assert torch.equal(again.model_parts[0].weight, trainer.model_parts[0].weight)


def test_a_stop_request_is_agreed_saved_and_ends_torchtitans_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _managed(tmp_path, {"checkpoint": {"interval_steps": 100}})
    module = _trainer_module()
    monkeypatch.setattr(core.ow, "current", lambda: worker)
    trainer = tt_hook.attach(module.Trainer(tmp_path / "titan", steps=50))
    orig = trainer.train_step

    def asked_at_7(data: Any) -> None:
        worker.checkpoint_requested = trainer.step >= 7
        orig(data)

    trainer.train_step = asked_at_7
    trainer.train()
    assert trainer.step == 7
    # torchtitan's own save at 5 (its interval), then the stop's at 7.
    assert [d["step"] for n, d in worker.events if n == "checkpoint_committed"] == [5, 7]


def test_a_script_without_the_sdk_evaluates_and_saves_in_their_phases(tmp_path: Path) -> None:
    worker = _Worker({"RANK": "0"})
    worker.progress = "hook"
    phases = ScriptPhases(worker)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    phases.mode_changed(False)
    assert worker._phase == "init"  # before its first step: nothing is marked
    worker.optimizer_stepped(1)
    seen: list[str] = []
    save = phases.saving(lambda obj, path: seen.append(worker._phase))
    phases.mode_changed(False)  # model.eval()
    assert worker._phase == "evaluating"
    save(model.state_dict(), tmp_path / "x.pt")
    assert seen == ["checkpointing"] and worker._phase == "evaluating"
    phases.mode_changed(True)  # model.train()
    assert worker._phase == "training"
    phases.new_epoch()
    assert worker._phase == "loading"
    worker.optimizer_stepped(2)  # the next step ends it
    assert worker._phase == "training"
    worker.progress = "sdk"  # a script reporting its own steps marks its own phases
    phases.mode_changed(False)
    assert worker._phase == "training"


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                 st.dictionaries(st.text(max_size=8), st.booleans() | st.none(), max_size=3)))
def test_framework_hooks_are_on_unless_the_job_says_false(
        tmp_path_factory: pytest.TempPathFactory, job: Any) -> None:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps({"job": job}) if job is not None else "not json{")
    wanted = _framework_hooks_wanted(str(path))
    off = isinstance(job, dict) and job.get("framework_hooks") is False
    assert wanted is (not off)
    assert _framework_hooks_wanted(None) is True


def test_attach_refuses_what_is_not_a_trainer() -> None:
    with pytest.raises(TypeError, match="not a trainer"):
        attach(object())


# -- the Hugging Face Trainer itself, in this process (one rank, no process group) ----------
def _hf_trainer(out: Path, steps: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8))
    tokens = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in tokens]
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, logging_steps=100)
    return Trainer(model=model, args=args, train_dataset=data)


def _digest(trainer: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_a_trainer_resumed_from_its_final_checkpoint_trains_no_step_more(
        tmp_path: Path) -> None:
    """A job restarted after its last save (a rank that failed on its way out) resumes the
    final checkpoint: the Trainer, which tests for ``max_steps`` only after a step, would
    train (and report, and save) one step more."""
    job = {"checkpoint": {"interval_steps": 2, "keep_last": 2}}
    first = hf_hook.attach(_hf_trainer(tmp_path / "out", 4),
                   core.FrameworkHook("hf", _managed(tmp_path, job)))
    first.train()
    assert first.state.global_step == 4
    done = _digest(first)
    worker = _managed(tmp_path, job)  # the next generation's process
    again = hf_hook.attach(_hf_trainer(tmp_path / "out", 4), core.FrameworkHook("hf", worker))
    assert not all(torch.equal(a, b) for a, b in zip(_digest(again), done))
    out = again.train()
    assert again.state.global_step == out.global_step == 4
    assert [r["step"] for r in worker.records()] == []
    assert [d["step"] for n, d in worker.events if n == "checkpoint_committed"] == []
    assert all(torch.equal(a, b) for a, b in zip(_digest(again), done))
    # A job given more steps still trains on from the same checkpoint.
    more = _managed(tmp_path, job)
    longer = hf_hook.attach(_hf_trainer(tmp_path / "out", 6), core.FrameworkHook("hf", more))
    longer.train()
    assert [r["step"] for r in more.records()] == [5, 6]


def test_an_attached_trainer_is_freed_when_the_script_drops_it(tmp_path: Path) -> None:
    """The hook keeps no reference cycle through the trainer: dropped, it goes at once (its
    DDP model and process group references with it), not in the garbage collection of the
    interpreter's shutdown, where native threads of torch.distributed may be gone."""
    import gc
    import weakref

    trainer = hf_hook.attach(_hf_trainer(tmp_path / "out", 2),
                     core.FrameworkHook("hf", _managed(tmp_path, {})))
    trainer.train()
    assert trainer.state.global_step == 2
    gone = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert gone() is None
    finally:
        gc.enable()
