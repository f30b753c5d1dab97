"""Backend dispatch, DeepSpeed's config translation, and what each strategy's config rejects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from orchestrator.config import ConfigError
from orchestrator.config.loader import validate_data
from trainer.backends import backend_for
from trainer.backends.deepspeed import DEFAULT_BUCKET, DeepSpeedBackend, deepspeed_config
from trainer.backends.native import NativeBackend
from trainer.config import FieldError, TrainerConfig
from trainer.presets import PRESETS
from trainer.settings import load_settings


@pytest.mark.parametrize("strategy,cls", [("fsdp2", NativeBackend), ("ddp", NativeBackend),
                                          ("none", NativeBackend),
                                          ("deepspeed", DeepSpeedBackend)])
def test_each_strategy_has_its_backend(strategy: str, cls: type) -> None:
    backend = backend_for(strategy)
    assert type(backend) is cls and backend.strategy == strategy


def test_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown parallelism strategy 'fsdp3'"):
        backend_for("fsdp3")


def _trainer(**parallelism: object) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "model": {"preset": "tiny"},
        "data": {"micro_batch_size": 4, "grad_accum_steps": 3},
        "optimizer": {"grad_clip": 0.5},
        "parallelism": {"strategy": "deepspeed", **parallelism},
    })


def test_deepspeed_config_is_derived_from_ours() -> None:
    ds = deepspeed_config(_trainer(zero_stage=2))
    tiny = PRESETS["tiny"].num_params()
    assert ds == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
        "gradient_clipping": 0.5,
        # Buckets no larger than the model (the tiny one is far below DeepSpeed's default).
        "zero_optimization": {"stage": 2, "reduce_bucket_size": tiny,
                              "allgather_bucket_size": tiny},
        "communication_data_type": "fp32",
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def test_deepspeed_bf16_stage3_and_big_model_buckets() -> None:
    cfg = TrainerConfig.model_validate({
        "model": {"preset": "llama2-7b"}, "data": {"seq_len": 128},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "parallelism": {"strategy": "deepspeed", "zero_stage": 3}})
    ds = deepspeed_config(cfg)
    assert ds["bf16"] == {"enabled": True}
    assert ds["communication_data_type"] == "fp32"  # reductions stay fp32 under bf16
    assert ds["zero_optimization"] == {"stage": 3, "reduce_bucket_size": DEFAULT_BUCKET,
                                       "stage3_prefetch_bucket_size": DEFAULT_BUCKET}


@pytest.mark.parametrize("stage,bf16", [(0, False), (1, True), (2, False), (3, True)])
def test_deepspeed_accepts_the_config(stage: int, bf16: bool) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = _trainer(zero_stage=stage)
    if bf16:
        cfg = cfg.model_copy(update={"precision": cfg.precision.model_copy(
            update={"param_dtype": "bf16"})})
    parsed = DeepSpeedConfig(deepspeed_config(cfg))
    assert parsed.zero_optimization_stage == stage
    assert parsed.gradient_accumulation_steps == 3
    assert parsed.train_micro_batch_size_per_gpu == 4
    assert parsed.gradient_clipping == 0.5
    assert parsed.bfloat16_config.enabled is bf16
    assert parsed.communication_data_type == torch.float32


def _problems(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate_data(data, "job.yaml")
    return {p.path: p.message for p in err.value.problems}


def test_skip_step_is_rejected_with_deepspeed_naming_the_rule() -> None:
    problems = _problems({"trainer": {"parallelism": {"strategy": "deepspeed"}},
                          "stability": {"loss": {"nonfinite": {"action": "skip_step"}}}})
    assert list(problems) == ["stability.loss.nonfinite.action"]
    assert "engine.step()" in problems["stability.loss.nonfinite.action"]
    # The same rule with the native backend is fine.
    validate_data({"trainer": {"parallelism": {"strategy": "ddp"}},
                   "stability": {"loss": {"nonfinite": {"action": "skip_step"}}}}, "job.yaml")


def test_a_worker_started_alone_rejects_it_too(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"parallelism": {"strategy": "deepspeed"}},
                                    "stability": {"grad_spike": {"action": "skip_step"}}}))
    with pytest.raises(FieldError) as err:
        load_settings(str(path))
    assert err.value.field == "stability.grad_spike.action"


def test_deepspeed_needs_a_filesystem_tier_for_its_writer() -> None:
    problems = _problems({"trainer": {"parallelism": {"strategy": "deepspeed"}},
                          "checkpoint": {"url": "s3://bucket/ckpt"}})
    assert "local_url" in problems["checkpoint.url"]
    validate_data({"trainer": {"parallelism": {"strategy": "deepspeed"}},
                   "checkpoint": {"url": "s3://bucket/ckpt", "local_url": "/nvme/ckpt"}},
                  "job.yaml")


def test_tensor_parallel_is_for_neuron_only() -> None:
    problems = _problems({"cluster": {"nodes": 2},
                          "trainer": {"parallelism": {"strategy": "fsdp2",
                                                      "tensor_parallel": 2}}})
    assert "strategy neuron only" in problems["trainer.parallelism.tensor_parallel"]


@pytest.mark.parametrize("trainer,field,words", [
    ({"device": "cpu"}, "trainer.device", "trainer.device: xla"),
    ({"parallelism": {"zero_stage": 2}}, "trainer.parallelism.zero_stage", "ZeRO-1"),
    ({"parallelism": {"activation_checkpointing": "selective"}},
     "trainer.parallelism.activation_checkpointing", "none or full"),
    ({"parallelism": {"compile": True}}, "trainer.parallelism.compile", "neuronx-cc"),
    ({"parallelism": {"tensor_parallel": 4}}, "trainer.parallelism.tensor_parallel",
     "n_kv_heads (2)"),
    ({"parallelism": {"backend": "gloo"}}, "trainer.parallelism.backend", "xla"),
])
def test_neuron_rejects_what_it_cannot_do(trainer: dict, field: str, words: str) -> None:
    base = {"device": "xla", "model": {"preset": "tiny"},
            "parallelism": {"strategy": "neuron", "backend": "xla"}}
    merged = {**base, **trainer, "parallelism": {**base["parallelism"],
                                                 **trainer.get("parallelism", {})}}
    problems = _problems({"cluster": {"nodes": 8}, "trainer": merged})
    assert words in problems[field]


def test_the_trainium_example_config_is_valid() -> None:
    cfg = validate_data(yaml.safe_load(
        (Path(__file__).parents[3] / "configs" / "llama2-7b-trn1-128.yaml").read_text()),
        "llama2-7b-trn1-128.yaml")
    assert cfg.trainer.parallelism.strategy == "neuron"
    assert cfg.trainer.parallelism.tensor_parallel == 8


def test_parallelize_leaves_neuron_to_its_backend() -> None:
    from trainer.model import build_model
    from trainer.parallel import parallelize

    cfg = TrainerConfig.model_validate({"device": "xla", "parallelism": {
        "strategy": "neuron", "backend": "xla"}})
    with pytest.raises(ValueError, match="trainer.backends"):
        parallelize(build_model(PRESETS["tiny"], device="meta"), cfg.parallelism,
                    cfg.precision, None, seed=0)


def test_deepspeed_checkpointer_refuses_an_object_store_tier() -> None:
    from trainer.backends.deepspeed_checkpoint import DeepSpeedCheckpointer
    from trainer.checkpoint.store import CheckpointStore, Tier
    from trainer.config import CheckpointConfig

    store = CheckpointStore(Tier("remote", "s3://bucket/ckpt/job", fs=None))
    with pytest.raises(ValueError, match="local_url"):
        DeepSpeedCheckpointer(CheckpointConfig(), store, rank=0, world_size=1, group=None,
                              meta={}, report=lambda *a, **k: None, log=print)
