"""TorchNeuron (``trainer.device: neuron``) on the CPU: which backend a config picks, what it
refuses, the process-group and compiler backends, and the NeuronCore each rank takes.

torch-neuronx cannot be installed here (no wheel for this torch, no Trainium). Where the device
must exist, a stand-in ``torch_neuronx`` does what the real package does on import: it names
PyTorch's PrivateUse1 device ``neuron`` and registers a ``neuron`` process-group backend
(backed by gloo here), in processes of their own since the renaming is for the process's life.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import free_port

from orchestrator.config import ConfigError
from orchestrator.config.loader import validate_data
from trainer.backends import backend_for
from trainer.backends import torchneuron as tn
from trainer.backends.native import NativeBackend
from trainer.backends.neuron import NeuronBackend
from trainer.config import TrainerConfig
from trainer.distributed import AUTO_BACKEND, process_group_spec

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"

NATIVE = {"cluster": {"nodes": 2, "accelerator": "neuron"},
          "trainer": {"device": "neuron", "model": {"preset": "tiny"},
                      "parallelism": {"strategy": "fsdp2"}}}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and key in base \
            else value
    return out


def _problems(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate_data(data, "job.yaml")
    return {p.path: p.message for p in err.value.problems}


# -- which path a config picks ---------------------------------------------------------------
@pytest.mark.parametrize("device,strategy,cls,auto,spec", [
    ("neuron", "fsdp2", NativeBackend, "neuron", "cpu:gloo,neuron:neuron"),
    ("neuron", "ddp", NativeBackend, "neuron", "cpu:gloo,neuron:neuron"),
    ("neuron", "none", NativeBackend, "neuron", "cpu:gloo,neuron:neuron"),
    ("xla", "neuron", NeuronBackend, "xla", "xla"),
    ("cuda", "fsdp2", NativeBackend, "nccl", "cpu:gloo,cuda:nccl"),
    ("cpu", "fsdp2", NativeBackend, "gloo", "gloo"),
])
def test_the_device_and_strategy_pick_backend_and_process_group(
        device: str, strategy: str, cls: type, auto: str, spec: str) -> None:
    cfg = TrainerConfig.model_validate({"device": device, "model": {"preset": "tiny"},
                                        "parallelism": {"strategy": strategy}})
    assert type(backend_for(cfg.parallelism.strategy)) is cls
    backend = AUTO_BACKEND.get(device, "gloo")
    assert backend == auto
    assert process_group_spec(backend) == spec


def test_the_native_config_runs_fsdp2_on_neuron() -> None:
    path = CONFIGS / "llama2-7b-trn2-native.yaml"
    cfg = validate_data(yaml.safe_load(path.read_text()), path.name)
    assert (cfg.trainer.device, cfg.trainer.parallelism.strategy) == ("neuron", "fsdp2")
    assert cfg.cluster.accelerator == "neuron" and cfg.health.expect_device_name == "trn2"
    assert type(backend_for(cfg.trainer.parallelism.strategy)) is NativeBackend
    # The seed study's batch: 1,024 sequences of 4,096 tokens, one per data-parallel rank.
    data = cfg.trainer.data
    assert cfg.cluster.world_size * data.micro_batch_size * data.grad_accum_steps == 1024
    assert data.seq_len == 4096
    nxd = validate_data(yaml.safe_load((CONFIGS / "llama2-7b-trn1-128.yaml").read_text()),
                        "llama2-7b-trn1-128.yaml")
    assert (nxd.trainer.device, nxd.trainer.parallelism.strategy) == ("xla", "neuron")
    ours, theirs = cfg.trainer, nxd.trainer
    for section in ("model", "optimizer", "schedule", "precision"):
        assert getattr(ours, section) == getattr(theirs, section), section
    assert (ours.steps, ours.seed, ours.data.path) == (theirs.steps, theirs.seed,
                                                       theirs.data.path)
    tp = theirs.parallelism.tensor_parallel
    nxd_batch = nxd.cluster.world_size // tp * theirs.data.micro_batch_size * \
        theirs.data.grad_accum_steps
    assert nxd_batch == 1024


# -- what a mismatched combination gets ------------------------------------------------------
@pytest.mark.parametrize("over,field,words", [
    ({"trainer": {"parallelism": {"strategy": "neuron"}}}, "trainer.parallelism.strategy",
     ["mixes the two Trainium paths", "Neuron SDK 2.31 or earlier", "use strategy fsdp2"]),
    ({"trainer": {"device": "xla"}}, "trainer.device",
     ["ended the torch-xla training flow", "set trainer.device: neuron"]),
    ({"trainer": {"parallelism": {"strategy": "deepspeed"}}}, "trainer.parallelism.strategy",
     ["DeepSpeed does not run on the neuron device"]),
    ({"trainer": {"parallelism": {"backend": "nccl"}}}, "trainer.parallelism.backend",
     ["neuron process-group backend", "not nccl"]),
    ({"trainer": {"parallelism": {"backend": "xla"}}}, "trainer.parallelism.backend",
     ["not xla"]),
    ({"trainer": {"device": "cuda", "parallelism": {"backend": "neuron"}},
      "cluster": {"accelerator": "cuda"}}, "trainer.parallelism.backend",
     ["drives TorchNeuron's device"]),
    ({"trainer": {"precision": {"fp8": True, "param_dtype": "bf16"}}},
     "trainer.precision.fp8", ["trainer.device is neuron"]),
    ({"cluster": {"accelerator": "cpu"}}, "cluster.accelerator",
     ["needs cluster.accelerator: neuron"]),
    ({"job": {"env": {"XLA_USE_BF16": "1", "PJRT_DEVICE": "NEURON", "FI_PROVIDER": "efa"}}},
     "job.env", ["PJRT_DEVICE, XLA_USE_BF16 configure torch-xla"]),
])
def test_a_mismatched_combination_is_refused_with_a_hint(over: dict, field: str,
                                                         words: list[str]) -> None:
    validate_data(NATIVE, "job.yaml")  # the base itself is valid
    problems = _problems(_merge(NATIVE, over))
    assert field in problems, problems
    for w in words:
        assert w in problems[field]


DEVICES = ["auto", "cpu", "cuda", "xla", "neuron"]
STRATEGIES = ["fsdp2", "ddp", "none", "deepspeed", "neuron"]
BACKENDS = ["auto", "gloo", "nccl", "xla", "neuron"]
ACCELERATORS = ["cpu", "cuda", "neuron"]
FUZZ_CASES = 400  # of 375 distinct combinations (hypothesis draws some twice)


@settings(max_examples=FUZZ_CASES, deadline=None)
@given(st.sampled_from(DEVICES), st.sampled_from(STRATEGIES), st.sampled_from(BACKENDS),
       st.sampled_from(ACCELERATORS))
def test_no_combination_crosses_the_two_trainium_paths(device: str, strategy: str,
                                                       backend: str, accelerator: str) -> None:
    """Whatever the combination: refused with dotted fields, or accepted only if it stays
    on one Trainium path (TorchNeuron: device neuron, a native strategy, the neuron backend,
    a neuron cluster; NxD: strategy neuron on device xla)."""
    data = {"cluster": {"nodes": 2, "accelerator": accelerator},
            "trainer": {"device": device, "model": {"preset": "tiny"},
                        "parallelism": {"strategy": strategy, "backend": backend}}}
    try:
        cfg = validate_data(data, "job.yaml")
    except ConfigError as err:
        assert err.problems and all(p.path.split(".")[0] in ("trainer", "cluster")
                                    for p in err.problems)
        return
    par = cfg.trainer.parallelism
    if device == "neuron":
        assert strategy in ("fsdp2", "ddp", "none") and backend in ("auto", "neuron")
        assert accelerator == "neuron"
        assert process_group_spec(AUTO_BACKEND["neuron"] if backend == "auto" else backend) \
            == tn.PG_SPEC
    if backend == "neuron":
        assert device == "neuron"
    if strategy == "neuron":
        assert device == "xla" and type(backend_for(par.strategy)) is NeuronBackend
    if device == "xla":
        assert strategy == "neuron"


# -- compile ---------------------------------------------------------------------------------
def test_compile_uses_the_neuron_backend_on_neuron_only() -> None:
    assert tn.compile_kwargs("neuron") == {"backend": "neuron", "fullgraph": True,
                                           "dynamic": False}
    for device in ("cpu", "cuda", "xla"):
        assert tn.compile_kwargs(device) == {}


@pytest.mark.parametrize("device_type", ["neuron", "cpu"])
def test_blocks_and_the_loss_get_the_devices_compile_arguments(
        monkeypatch: pytest.MonkeyPatch, device_type: str) -> None:
    """What parallelize (per block) and the native step (the loss) hand torch.compile."""
    from torch import nn

    from trainer.backends.native import TorchStepper
    from trainer.model import build_model
    from trainer.parallel import apply_compile
    from trainer.presets import PRESETS

    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(nn.Module, "compile",
                        lambda self, **kw: calls.append((type(self).__name__, kw)))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append((fn.__name__, kw)))
    model = build_model(PRESETS["tiny"], device="meta")
    apply_compile(model, device_type)
    cfg = TrainerConfig.model_validate({"model": {"preset": "tiny"},
                                        "parallelism": {"compile": True}})
    TorchStepper(model, None, None, cfg, types.SimpleNamespace(type=device_type))
    want = tn.compile_kwargs(device_type)
    assert calls == [("TransformerBlock", want)] * len(model.layers) + [("lm_loss", want)]


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_blocks_and_loss_compile_as_one_graph_each(checkpointing: str) -> None:
    """fullgraph=True (AWS's recommendation for backend neuron) raises on a graph break: our
    blocks, with or without activation checkpointing, and the loss have none. Dynamo's
    capture is checked with the "eager" backend, the neuron one's other arguments kept."""
    from trainer.backends.base import lm_loss
    from trainer.model import build_model
    from trainer.parallel import apply_activation_checkpointing
    from trainer.presets import PRESETS

    kwargs = {**tn.compile_kwargs("neuron"), "backend": "eager"}
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], device="cpu")
    apply_activation_checkpointing(model, checkpointing)
    inputs = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 16))
    want = lm_loss(model(inputs), inputs)
    for block in model.layers:
        block.compile(**kwargs)
    got = torch.compile(lm_loss, **kwargs)(model(inputs), inputs)
    got.backward()
    torch.testing.assert_close(got, want)
    assert all(p.grad is not None for p in model.parameters())


# -- the NeuronCore of each rank -------------------------------------------------------------
CORE_CASES = 500


@settings(max_examples=CORE_CASES, deadline=None)
@given(st.integers(-4, 300), st.integers(0, 256))
def test_each_rank_takes_a_core_of_its_own(local_rank: int, visible: int) -> None:
    try:
        core = tn.core_index(local_rank, visible)
    except ValueError:
        assert local_rank < 0
        return
    except RuntimeError as err:
        assert visible == 0 or (visible > 1 and local_rank >= visible)
        assert ("no NeuronCore is visible" if visible == 0 else "procs_per_node") in str(err)
        return
    assert local_rank >= 0 and 0 <= core < visible
    # One visible core: the launcher gave this process its own; several: one per rank.
    assert core == (0 if visible == 1 else local_rank)


class FakeAccelerator:
    def __init__(self, count: int) -> None:
        self.count, self.index, self.calls = count, 0, []

    def device_count(self) -> int:
        return self.count

    def set_device_index(self, index: int, /) -> None:
        self.calls.append(index)
        self.index = index

    def current_device_index(self) -> int:
        return self.index


def test_without_torch_neuronx_the_error_names_both_paths() -> None:
    if importlib.util.find_spec(tn.PACKAGE) is not None:
        pytest.skip("torch-neuronx is installed here")
    acc = FakeAccelerator(64)
    with pytest.raises(RuntimeError) as err:
        tn.pick_device(3, acc)
    assert str(err.value).startswith(tn.MISSING)
    assert "No module named 'torch_neuronx'" in str(err.value)
    assert acc.calls == []  # nothing chosen before the device exists


def test_a_torch_neuronx_that_registers_no_device_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if torch._C._get_privateuse1_backend_name() == "neuron":
        pytest.skip("this process already has a neuron device")
    monkeypatch.setitem(sys.modules, tn.PACKAGE, types.ModuleType(tn.PACKAGE))
    with pytest.raises(RuntimeError, match="torch knows no 'neuron' device.*'privateuseone'"):
        tn.pick_device(0, FakeAccelerator(1))


# -- a stand-in torch_neuronx, two real ranks ------------------------------------------------
STAND_IN = '''
"""Does on import what torch-neuronx does: the device ``neuron`` (PrivateUse1) and the
``neuron`` process-group backend. No NeuronCore here: the backend is gloo underneath, the
accelerator calls answer from FAKE_NEURON_CORES, and every creation is counted."""
import os
import types

import torch
import torch.distributed as dist

torch.utils.rename_privateuse1_backend("neuron")
created = []


def _create(store, rank, size, timeout):
    created.append((rank, size))
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend("neuron", _create, devices=["neuron"])
_current = [0]
torch.accelerator.device_count = lambda: int(os.environ["FAKE_NEURON_CORES"])
torch.accelerator.set_device_index = lambda i, /: _current.__setitem__(0, int(i))
torch.accelerator.current_device_index = lambda: _current[0]
'''

RANK = '''
import json, sys
import torch
import torch.distributed as dist
from trainer.config import TrainerConfig
from trainer.distributed import init_distributed, teardown

cfg = TrainerConfig.model_validate({"device": "neuron", "model": {"preset": "tiny"},
                                    "parallelism": {"strategy": "fsdp2"}})
dctx = init_distributed(cfg)
import torch_neuronx
value = torch.tensor([float(dctx.rank + 1)])
dist.all_reduce(value)  # a CPU tensor: the gloo half of "cpu:gloo,neuron:neuron"
out = {"device": str(dctx.device), "backend": dctx.backend, "sum": value.item(),
       "pg": str(dist.get_backend()), "created": torch_neuronx.created,
       "world": dctx.world_size}
teardown()
print(json.dumps(out))
'''


def test_two_ranks_join_the_neuron_process_group(tmp_path: Path) -> None:
    pkg = tmp_path / "torch_neuronx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "FAKE_NEURON_CORES": "64", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for rank, got in enumerate(results):
        assert got["device"] == f"neuron:{rank}"  # local rank r drives core r
        assert got["backend"] == "neuron" and got["world"] == 2
        assert got["sum"] == 3.0
        assert got["pg"] == tn.PG_SPEC
        # The default group made its neuron half through the registered backend, once.
        assert got["created"] == [[rank, 2]]
