"""The trainer on CUDA: FSDP2 bf16 with fp32 reductions, per-block compile, activation
checkpointing, fused AdamW, flash attention, NCCL with an explicit timeout, and async
checkpoints with reused pinned staging buffers. Runs on the lent GPU; skipped elsewhere."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_parts(tmp_path: Path, dataset_dir: Path, monkeypatch: pytest.MonkeyPatch):
    import torch.distributed as dist

    from orchestrator.worker import WorkerContext
    from stability.config import StabilityConfig
    from trainer.build import build_parts
    from trainer.config import CheckpointConfig, TrainerConfig
    from trainer.distributed import init_distributed
    from trainer.settings import WorkerSettings

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("ORCH_COLLECTIVE_TIMEOUT_S", "123")):
        monkeypatch.setenv(k, v)

    def build(ac: str = "selective", compile_: bool = True):
        cfg = TrainerConfig.model_validate({
            "steps": 30, "device": "cuda", "deterministic": False,
            "model": {"preset": "small"},
            "data": {"path": str(dataset_dir), "seq_len": 256, "micro_batch_size": 4},
            "schedule": {"warmup_steps": 3},
            "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
            "parallelism": {"strategy": "fsdp2", "backend": "nccl", "compile": compile_,
                            "activation_checkpointing": ac}})
        ckpt = CheckpointConfig(url=str(tmp_path / "ckpt"), interval_steps=10)
        settings = WorkerSettings(cfg, ckpt, StabilityConfig(), "gpu", str(tmp_path / "ckpt"),
                                  "h")
        dctx = init_distributed(cfg)
        import orchestrator.worker as ow

        return build_parts(settings, dctx, WorkerContext(), ow.init(), print)

    yield build
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fsdp2_bf16_compile_checkpoint_and_resume(cuda_parts) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from trainer.loop import train, train_step

    parts = cuda_parts()
    assert isinstance(parts.model, FSDPModule)
    policy = parts.model._get_fsdp_state()._mp_policy
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in parts.model.parameters())  # fp32 master
    assert parts.stepper.optimizer.defaults["fused"] is True
    default_pg = dist.distributed_c10d._get_default_group()
    nccl = default_pg._get_backend(torch.device("cuda"))
    assert type(nccl).__name__ == "ProcessGroupNCCL"
    assert nccl.options._timeout == datetime.timedelta(seconds=123)  # ours, never NCCL's
    first = train_step(parts)["loss"]
    assert first > 4.0  # ~ln(258) at init
    train(parts)
    assert parts.progress.step == 30
    assert parts.checkpointer.last_committed == 30
    assert parts.checkpointer._staging_writer is not None  # pinned buffers, one writer
    last = train_step(parts)["loss"]
    assert last < first - 1.0
    del parts
    dist.destroy_process_group()
    resumed = cuda_parts()
    assert resumed.progress.step == 30  # restored from the committed step-30 checkpoint


def test_flash_attention_runs_in_bf16(cuda_parts) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    parts = cuda_parts(ac="full", compile_=False)
    tokens = torch.randint(0, 258, (2, 256), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot run
        logits = parts.model(tokens)
    assert logits.shape == (2, 256, parts.model.output.weight.shape[0])
    assert torch.isfinite(logits).all()
