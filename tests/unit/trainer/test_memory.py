"""CPU offload and FP8: the config rules, DeepSpeed's offload config, FSDP2's offload policy on
a real (one-rank gloo) process group, and FP8 refused on a device without FP8 (this CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from orchestrator.config import ConfigError
from orchestrator.config.loader import validate_data
from trainer.backends.deepspeed import deepspeed_config
from trainer.config import TrainerConfig
from trainer.precision.fp8 import FP8Unsupported, fp8_capable, require_fp8


def _problems(trainer: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate_data({"trainer": {"model": {"preset": "tiny"}, **trainer}}, "job.yaml")
    return {p.path: p.message for p in err.value.problems}


@pytest.mark.parametrize("trainer,field,words", [
    ({"parallelism": {"strategy": "fsdp2", "offload": "optimizer"}},
     "trainer.parallelism.offload", "use params"),
    ({"parallelism": {"strategy": "deepspeed", "zero_stage": 2, "offload": "params"}},
     "trainer.parallelism.offload", "stage 3 only"),
    ({"parallelism": {"strategy": "deepspeed", "zero_stage": 0, "offload": "optimizer"}},
     "trainer.parallelism.offload", "zero_stage 1-3"),
    ({"parallelism": {"strategy": "ddp", "offload": "params"}},
     "trainer.parallelism.offload", "fsdp2 and deepspeed"),
    ({"device": "cpu", "precision": {"fp8": True, "param_dtype": "bf16"}},
     "trainer.precision.fp8", "H100/H200-class CUDA GPU; trainer.device is cpu"),
    ({"device": "cuda", "precision": {"fp8": True}},
     "trainer.precision.fp8", "param_dtype: bf16"),
    ({"device": "cuda", "precision": {"fp8": True, "param_dtype": "bf16"},
      "parallelism": {"strategy": "deepspeed"}},
     "trainer.precision.fp8", "not 'deepspeed'"),
])
def test_config_refuses(trainer: dict, field: str, words: str) -> None:
    problems = _problems(trainer)
    assert words in problems[field], problems


def test_deepspeed_offload_config_is_accepted_by_deepspeed() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    for stage, offload in ((2, "optimizer"), (3, "optimizer"), (3, "params")):
        cfg = TrainerConfig.model_validate({
            "model": {"preset": "tiny"},
            "parallelism": {"strategy": "deepspeed", "zero_stage": stage, "offload": offload}})
        ds = deepspeed_config(cfg)
        assert ds["zero_force_ds_cpu_optimizer"] is False  # our torch AdamW steps on the CPU
        zero = DeepSpeedConfig(ds).zero_config
        assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
        assert (zero.offload_param is not None) is (offload == "params")
        if zero.offload_param is not None:
            assert zero.offload_param.device == "cpu"
    plain = deepspeed_config(TrainerConfig.model_validate(
        {"model": {"preset": "tiny"}, "parallelism": {"strategy": "deepspeed"}}))
    assert "offload_optimizer" not in plain["zero_optimization"]


def test_fp8_is_refused_on_this_cpu_with_a_clear_error() -> None:
    ok, why = fp8_capable(torch.device("cpu"))
    assert not ok and "compute capability 8.9+" in why
    with pytest.raises(FP8Unsupported, match="trainer.precision.fp8 is true, but device cpu"):
        require_fp8(torch.device("cpu"))


def test_fp8_with_device_auto_is_refused_when_the_backend_builds_on_a_cpu(
        tmp_path: Path) -> None:
    """device: auto passes validation (the GPU is only known on the rank); the backend
    refuses before anything is converted."""
    from trainer.backends.native import NativeBackend
    from trainer.distributed import DistContext
    from trainer.settings import load_settings

    if torch.cuda.is_available() and fp8_capable(torch.device("cuda"))[0]:
        pytest.skip("this machine has an FP8 GPU: the refusal is for the others")
    (tmp_path / "job.yaml").write_text(
        "trainer:\n  device: auto\n  model: {preset: tiny}\n"
        "  precision: {fp8: true, param_dtype: bf16}\n  parallelism: {strategy: none}\n")
    settings = load_settings(str(tmp_path / "job.yaml"))
    dctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                       backend="gloo", ckpt_group=None)
    backend = NativeBackend("none")
    backend.setup(settings, dctx)
    with pytest.raises(FP8Unsupported, match="device cpu has no FP8 matmul"):
        backend.build_model(settings, dctx)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_offload_policy_is_applied_and_trains(one_rank: None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from trainer.config import ParallelismConfig, PrecisionConfig
    from trainer.model import build_model
    from trainer.parallel import apply_fsdp, materialize
    from trainer.presets import PRESETS

    model = build_model(PRESETS["tiny"], device="meta")
    par = ParallelismConfig(strategy="fsdp2", offload="params")
    apply_fsdp(model, par, PrecisionConfig(), world_size=1)
    materialize(model, torch.device("cpu"), seed=0)
    policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy
                for m in [*model.layers, model]]
    assert all(isinstance(p, CPUOffloadPolicy) for p in policies)
    assert all(p.device.type == "cpu" for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 258, (2, 16))
    before = model(tokens).float().logsumexp(-1).mean()
    before.backward()
    opt.step()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())
    assert not torch.equal(model(tokens).float().logsumexp(-1).mean(), before.detach())
