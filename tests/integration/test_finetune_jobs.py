"""LoRA and QLoRA jobs end to end: adapters only in checkpoints, bit-exact kill + resume,
and ``export --to-hf`` (merged, and the adapter alone in peft's format) checked against
transformers' own ``LlamaForCausalLM`` (+ peft) on the same tokens.

Real supervisor, agents and two gloo ranks on the CPU; the base is a seeded tiny model
written as a Hugging Face directory by the test (nothing is downloaded).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import assert_bit_identical, env, final_state_dict, journal, status, up, write_config

from trainer.checkpoint import layout

pytestmark = pytest.mark.slow

STEPS = 20
LORA = {"method": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.1}
STATE = ("app.model.", "app.optim.", "progress.", "data.", "schedule.")


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset from seed 7, as a Llama-format directory: the frozen base."""
    from trainer.hf import write_hf_dir
    from trainer.model import build_model
    from trainer.presets import PRESETS

    out = tmp_path_factory.mktemp("base") / "hf"
    torch.manual_seed(7)
    write_hf_dir(out, build_model(PRESETS["tiny"]).state_dict(), PRESETS["tiny"])
    return out


def _trainer(base: Path, finetune: dict, strategy: str = "fsdp2", **extra: object) -> dict:
    return {"steps": STEPS, "model": {"init_from_hf": str(base)}, "finetune": finetune,
            "parallelism": {"strategy": strategy}, **extra}


@pytest.fixture(scope="module")
def clean_lora(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path,
               hf_base: Path) -> Path:
    tmp = tmp_path_factory.mktemp("lora-clean")
    cfg = write_config(tmp / "job.yaml", dataset_dir, trainer=_trainer(hf_base, LORA))
    result = up(cfg, tmp / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    return tmp / "run"


def _step_dir(run: Path, step: int = STEPS) -> Path:
    return run / "checkpoints" / "t" / f"step-{step:08d}"


def test_lora_checkpoint_holds_adapters_only(clean_lora: Path) -> None:
    sd = final_state_dict(_step_dir(clean_lora))
    weights = sorted(k for k in sd if k.startswith("app.model."))
    # 2 blocks x 4 targets (wqkv, wo, w13, w2) x (A, B): nothing of the frozen base.
    assert len(weights) == 16 and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert any("attention.wqkv.lora_B" in k for k in weights)  # the fused layers are adapted
    assert any("feed_forward.w13.lora_A" in k for k in weights)
    # B starts at zero: after 20 steps every B has moved.
    assert all(sd[k].abs().sum() > 0 for k in weights if ".lora_B." in k)
    manifest = layout.verify(str(_step_dir(clean_lora))).manifest
    assert manifest is not None
    assert manifest["finetune"]["method"] == "lora" and manifest["finetune"]["rank"] == 4
    assert "adapters" in manifest["state"]["model_and_optimizer"]
    log = (clean_lora / "logs" / "rank-00000.log").read_text()
    assert "lora: base from" in log and "parameters train (rank 4)" in log


def test_lora_kill_resumes_bit_exactly(tmp_path: Path, dataset_dir: Path, hf_base: Path,
                                       clean_lora: Path) -> None:
    # After the first checkpoint (10), late enough for its async commit (digest, signature)
    # to land first on a loaded host: a kill at 11 in CI restarted from scratch.
    kill = random.Random().randrange(15, 19)
    print(f"chaos kill at step {kill}")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer=_trainer(hf_base, LORA),
                       chaos={"kill": [{"step": kill}], "seed": kill})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    st = status(tmp_path / "run")
    assert st["state"] == "COMPLETED"
    assert [r["cause"] for r in st["restarts"]] == ["worker_exit"]
    resumed = [e["step"] for e in journal(tmp_path / "run") if e["kind"] == "resumed"]
    assert resumed == [10]
    a = final_state_dict(_step_dir(clean_lora))
    b = final_state_dict(_step_dir(tmp_path / "run"))
    # Adapters, both Adam moments of each, counters, data position, schedule: bit for bit.
    assert assert_bit_identical(a, b, STATE) > 40
    # Each rank's final digest of its adapter shards (FSDP2) matches the clean run's.
    assert _digests(tmp_path / "run") == _digests(clean_lora)


def _digests(run: Path) -> dict[int, str]:
    """rank -> CRC32 of its trained parameters at the end (the last generation's report)."""
    out = {e["rank"]: e["crc32"] for e in journal(run)
           if e["kind"] == "worker_event" and e.get("name") == "params_digest"}
    assert sorted(out) == [0, 1]
    return out


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                          text=True, env=env(), timeout=300, check=False)


def _adapted_logits(step_dir: Path, base: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Our model with the checkpoint's adapters on the base, as the trainer computes."""
    from trainer.hf_adapters import load_adapted

    manifest = layout.verify(str(step_dir)).manifest
    model = load_adapted(str(step_dir), manifest)
    model.eval()
    with torch.no_grad():
        return model(tokens)


def test_export_merges_adapters_and_writes_peft_adapter(tmp_path: Path, clean_lora: Path,
                                                        hf_base: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    step = _step_dir(clean_lora)
    merged = _cli("export", "--checkpoint", str(step), "--to-hf", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr
    assert "merged lora adapters" in merged.stdout
    adapter = _cli("export", "--checkpoint", str(step), "--to-hf", str(tmp_path / "adapter"),
                   "--adapter-only")
    assert adapter.returncode == 0, adapter.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                                "q_proj", "up_proj", "v_proj"]

    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(3))
    ours = _adapted_logits(step, hf_base, tokens)
    hf_merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = LlamaForCausalLM.from_pretrained(hf_base).eval()
    with torch.no_grad():
        plain = base(tokens).logits
        via_peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
        via_merge = hf_merged(tokens).logits
    assert not torch.allclose(ours, plain, atol=1e-4)  # the adapters changed the model
    torch.testing.assert_close(via_merge, ours, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(via_peft, ours, atol=2e-4, rtol=1e-4)


# 2 FSDP2 ranks split every NF4 weight of the tiny preset evenly with 32 x 64-value blocks.
QLORA = {"method": "qlora", "rank": 4, "alpha": 8.0, "nf4_scaler_block_size": 32}


@pytest.fixture(scope="module")
def clean_qlora(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path,
                hf_base: Path) -> Path:
    """QLoRA under FSDP2: the NF4 base is sharded over the two ranks."""
    tmp = tmp_path_factory.mktemp("qlora-clean")
    cfg = write_config(tmp / "job.yaml", dataset_dir, trainer=_trainer(hf_base, QLORA))
    result = up(cfg, tmp / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    return tmp / "run"


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_qlora_on_fsdp2_shards_the_nf4_base_and_checkpoints_adapters(clean_qlora: Path) -> None:
    for rank in (0, 1):
        log = (clean_qlora / "logs" / f"rank-{rank:05d}.log").read_text()
        assert "NF4 base: 8 of 8 weights, sharded 2 ways" in log, log[-2000:]
    sd = final_state_dict(_step_dir(clean_qlora))
    weights = sorted(k for k in sd if k.startswith("app.model."))
    assert len(weights) == 16 and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert all(sd[k].abs().sum() > 0 for k in weights if ".lora_B." in k)  # they trained
    manifest = layout.verify(str(_step_dir(clean_qlora))).manifest
    assert manifest is not None and manifest["finetune"]["method"] == "qlora"
    assert manifest["finetune"]["nf4_scaler_block_size"] == 32
    assert len(_losses(clean_qlora)) >= STEPS


def test_qlora_on_fsdp2_kill_resumes_bit_exactly(tmp_path: Path, dataset_dir: Path,
                                                 hf_base: Path, clean_qlora: Path) -> None:
    # After the first checkpoint (10), late enough for its async commit (digest, signature)
    # to land first on a loaded host: a kill at 11 in CI restarted from scratch.
    kill = random.Random().randrange(15, 19)
    print(f"chaos kill at step {kill}")
    cfg = write_config(tmp_path / "job.yaml", dataset_dir, trainer=_trainer(hf_base, QLORA),
                       chaos={"kill": [{"step": kill}], "seed": kill})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    assert [r["cause"] for r in status(tmp_path / "run")["restarts"]] == ["worker_exit"]
    assert [e["step"] for e in journal(tmp_path / "run") if e["kind"] == "resumed"] == [10]
    a = final_state_dict(_step_dir(clean_qlora))
    b = final_state_dict(_step_dir(tmp_path / "run"))
    assert assert_bit_identical(a, b, STATE) > 40
    assert _digests(tmp_path / "run") == _digests(clean_qlora)


def test_qlora_on_fsdp2_exports_merged_weights(tmp_path: Path, clean_qlora: Path,
                                               hf_base: Path) -> None:
    from transformers import LlamaForCausalLM

    step = _step_dir(clean_qlora)
    out = _cli("export", "--checkpoint", str(step), "--to-hf", str(tmp_path / "merged"))
    assert out.returncode == 0, out.stderr
    assert "merged qlora adapters" in out.stdout
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(4))
    ours = _adapted_logits(step, hf_base, tokens)  # the NF4 base's round trip + adapters
    with torch.no_grad():
        merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
        plain = LlamaForCausalLM.from_pretrained(hf_base).eval()(tokens).logits
    assert not torch.allclose(ours, plain, atol=1e-3)
    torch.testing.assert_close(merged, ours, atol=2e-4, rtol=1e-4)


def test_qlora_on_ddp_trains_an_nf4_base(tmp_path: Path, dataset_dir: Path, hf_base: Path,
                                         clean_qlora: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", dataset_dir,
                       trainer=_trainer(hf_base, QLORA, strategy="ddp", steps=12),
                       checkpoint={"interval_steps": 6})
    result = up(cfg, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-4000:]
    log = (tmp_path / "run" / "logs" / "rank-00000.log").read_text()
    assert "NF4 base: 8 of 8 weights, sharded 1 ways" in log  # replicated, not sharded
    step = tmp_path / "run" / "checkpoints" / "t" / "step-00000012"
    sd = final_state_dict(step)
    weights = [k for k in sd if k.startswith("app.model.")]
    assert len(weights) == 16 and all(".lora_" in k for k in weights)
    manifest = layout.verify(str(step)).manifest
    assert manifest["finetune"]["method"] == "qlora"
    # DDP replicas agree: both ranks report the same adapters.
    digests = _digests(tmp_path / "run")
    assert digests[0] == digests[1]
    # The same NF4 base, adapters and batches as the FSDP2 run: the first step's loss (the
    # base's, B = 0) agrees, so FSDP2's all-gathered NF4 weights are the whole ones.
    assert _losses(tmp_path / "run")[0] == pytest.approx(_losses(clean_qlora)[0], abs=1e-5)
    out = _cli("export", "--checkpoint", str(step), "--to-hf", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert "merged qlora adapters" in out.stdout
