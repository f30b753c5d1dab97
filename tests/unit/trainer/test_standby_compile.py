"""A warm standby compiles the job's step on a two-block copy of the model, under a fake
process group; the rank it becomes then compiles nothing at its first step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.servers import free_port
from trainer import standby_compile
from trainer.settings import load_settings

ROOT = Path(__file__).resolve().parents[3]

# The standby's preparation (as the agent's spare runs it: its environment names the job's
# config and the rank it would replace), then the rank it becomes: the real process group
# (gloo, world 1), the job's whole model and its first step, counting compiled graphs.
_PROBE = """
import json, os, sys
import trainer.warm_compile  # what the agent preloads when the job compiles
# TorchDynamo's cache is what is tested, not Inductor's kernels: AOTAutograd's eager backend
# keeps the capture, the guards and the lookups, without a C++ compile per graph.
from trainer.backends import native, torchneuron
native.compile_kwargs = torchneuron.compile_kwargs = lambda device_type: {"backend": "aot_eager"}
from torch._dynamo.utils import counters
from trainer import standby
import weakref
built = []
build = native.NativeBackend.build_model
def build_copy(self, s, d):
    model = build(self, s, d)
    built.append(weakref.ref(model))
    return model
native.NativeBackend.build_model = build_copy
standby.prepare(0)
copy = built.pop()
native.NativeBackend.build_model = build
prepared = {k: v for k, v in standby.PREPARED.items() if k.startswith("compile_ahead")}
before = counters["stats"]["unique_graphs"]
import torch.distributed as dist
from trainer.backends import backend_for
from trainer.distributed import init_distributed
from trainer.settings import load_settings
from trainer.standby_compile import random_batch
settings = load_settings(os.environ["ORCH_CONFIG"])
dctx = init_distributed(settings.trainer)
backend = backend_for("fsdp2")
backend.setup(settings, dctx)
model = backend.build_model(settings, dctx)
stepper = backend.build_stepper(model, None, None, settings, dctx)
inputs, targets = random_batch(settings, dctx.device)
stepper.forward_backward(inputs, targets, True, 1.0)
blocks = list(model.layers)
print(json.dumps({"prepared": prepared, "before": before,
                  "after": counters["stats"]["unique_graphs"], "blocks": len(blocks),
                  "compiled": all(b._compiled_call_impl is not None for b in blocks),
                  "group": dist.get_backend(), "copy_freed": copy() is None}))
dist.destroy_process_group()
"""


def _config(tmp_path: Path, **parallelism: object) -> Path:
    config = {"job": {"name": "standby"},
              "trainer": {"device": "cpu", "num_threads": 1,
                          "model": {"preset": "tiny", "n_layers": 4},
                          "data": {"seq_len": 32, "micro_batch_size": 2},
                          "parallelism": {"strategy": "fsdp2", "backend": "gloo",
                                          "compile": True, **parallelism}}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_the_rank_a_standby_becomes_compiles_nothing_at_its_first_step(tmp_path: Path) -> None:
    config = _config(tmp_path, activation_checkpointing="selective")
    env = {**os.environ, "ORCH_CONFIG": str(config), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run([sys.executable, "-P", "-c", _PROBE], check=False, env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    prepared = result["prepared"]
    # Both kinds of block (plain and checkpoint-wrapped) and the loss, on the copy.
    assert prepared["compile_ahead_graphs"] >= 3, prepared
    assert prepared["compile_ahead_peak_mib"] is None  # no GPU here
    assert prepared["compile_ahead_held_mib"] is None
    assert result["blocks"] == 4 and result["compiled"] and result["group"] == "gloo"
    assert result["copy_freed"]  # nothing of the copy outlives the preparation
    assert result["after"] == result["before"], result  # every lookup hit the standby's


@pytest.mark.parametrize(("config", "env", "words"), [
    ("{not json", {"RANK": "0", "WORLD_SIZE": "2"}, "failed: "),
    ('{"trainer": {"parallelism": {"compile": true}}}', {"RANK": "x", "WORLD_SIZE": "2"},
     "failed: "),
    ('{"trainer": {"parallelism": {"compile": true}}}', {"RANK": "0"}, "no rank or world size"),
    ('{"trainer": {"steps": 50}}', {"RANK": "0", "WORLD_SIZE": "2"}, "does not compile"),
])
def test_a_standby_that_cannot_compile_ahead_says_why_and_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str, env: dict[str, str],
        words: str) -> None:
    """A damaged config or environment never fails the rest of the standby's preparation."""
    from trainer import standby

    path = tmp_path / "config.json"
    path.write_text(config)
    monkeypatch.setenv("ORCH_CONFIG", str(path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert words in standby.compile_step_ahead(0, *standby.job_settings())["compile_ahead"]


def test_what_cannot_be_compiled_ahead_says_why(tmp_path: Path) -> None:
    settings = load_settings(str(_config(tmp_path)))
    assert standby_compile.why_not(settings) is None
    for parallelism, words in (({"compile": False}, "does not compile"),
                               ({"standby_compile": False}, "standby_compile is off"),
                               ({"strategy": "ddp"}, "ddp"),
                               ({"offload": "params"}, "offload")):
        other = load_settings(str(_config(tmp_path, **parallelism)))
        assert words in (standby_compile.why_not(other) or ""), parallelism


@pytest.mark.parametrize(("layers", "copy"), [(1, 1), (2, 2), (16, 2)])
def test_the_copy_keeps_at_most_two_blocks_and_everything_else(tmp_path: Path, layers: int,
                                                               copy: int) -> None:
    from trainer.presets import resolve_model_args

    settings = load_settings(str(_config(tmp_path)))
    model = settings.trainer.model.model_copy(update={"n_layers": layers})
    settings = standby_compile.dataclasses.replace(
        settings, trainer=settings.trainer.model_copy(update={"model": model}))
    small = standby_compile.copy_settings(settings)
    assert resolve_model_args(small.trainer.model).n_layers == copy
    assert small.trainer.data == settings.trainer.data
    assert small.trainer.parallelism == settings.trainer.parallelism
    assert small.config_hash == settings.config_hash


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.dictionaries(st.text(max_size=4), st.floats(), max_size=2))


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z_]{1,12}(_s|_graphs|_mib)?", fullmatch=True),
                       _VALUES, max_size=8))
def test_whatever_a_standby_prepared_its_startup_figures_fit_the_event(
        prepared: dict[str, object]) -> None:
    """The standby's figures cross into the rank's ``startup`` event: only bounded numbers
    go, so no preparation can make the event invalid."""
    from orchestrator.contracts.worker_events import Startup
    from trainer import main, standby

    saved = dict(standby.PREPARED)
    standby.PREPARED.clear()
    standby.PREPARED.update(prepared)
    try:
        figures = main.standby_figures()
    finally:
        standby.PREPARED.clear()
        standby.PREPARED.update(saved)
    Startup(first_step_done=1.7e9, **figures)
    assert all(k.startswith("standby_") and isinstance(v, float) for k, v in figures.items())
    assert len(figures) <= len(prepared)


@pytest.mark.parametrize(("config", "words"), [
    ("{not json", "failed: "),
    ('{"trainer": {"parallelism": {"standby_nccl": false}}}', "off (trainer.parallelism"),
    ('{"trainer": {"parallelism": {"backend": "gloo"}}}', "does not use NCCL"),
    (None, "no job config"),
])
def test_a_standby_that_does_not_set_nccl_up_ahead_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str | None,
        words: str) -> None:
    """NCCL ahead is best effort: a damaged config, the option off, or another backend
    leave a reason and no exception (this CPU build has no NCCL at all)."""
    from trainer import standby

    if config is None:
        monkeypatch.delenv("ORCH_CONFIG", raising=False)
    else:
        path = tmp_path / "config.json"
        path.write_text(config)
        monkeypatch.setenv("ORCH_CONFIG", str(path))
    assert words in standby.nccl_ahead(*standby.job_settings())["nccl_ahead"]
