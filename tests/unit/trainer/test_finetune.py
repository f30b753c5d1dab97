"""LoRA/QLoRA pieces on their own: peft covers the fused layers, the base keeps its draw,
NF4 quantization, the adapter-only state, the peft-format split, and the config's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import FinetuneConfig
from trainer.finetune import (
    AdapterOptimState,
    add_adapters,
    base_state_dict,
    is_adapter_key,
    lora_layers,
    prepare_base,
    quantize_base,
    trainable_counts,
)
from trainer.hf_adapters import peft_adapter
from trainer.model import Transformer, build_model
from trainer.presets import ModelArgs

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97,
                 max_seq_len=32)


def adapted(ft: FinetuneConfig, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = add_adapters(Transformer(ARGS), ft)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


LORA = FinetuneConfig(method="lora", rank=4, alpha=8.0)


def test_adapters_cover_the_fused_layers_and_only_they_train() -> None:
    model = adapted(LORA)
    names = sorted(n for n, _ in lora_layers(model))
    assert names == sorted(f"layers.{i}.{m}" for i in range(2) for m in
                           ("attention.wqkv", "attention.wo", "feed_forward.w13",
                            "feed_forward.w2"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_key(n) for n in trainable)
    # A: r x in, B: out x r, on the fused wqkv (q + k + v rows).
    wqkv = model.layers[0].attention.wqkv
    assert wqkv.lora_A["default"].weight.shape == (4, 64)
    assert wqkv.lora_B["default"].weight.shape == ((4 + 2 * 2) * 16, 4)
    n, total = trainable_counts(model)
    per_layer = 4 * (64 + 128) + 4 * (64 + 64) + 4 * (64 + 256) + 4 * (128 + 64)
    assert n == 2 * per_layer and total == ARGS.num_params() + n


def test_adapters_leave_the_seeds_base_unchanged_and_start_at_the_base() -> None:
    torch.manual_seed(5)
    plain = build_model(ARGS)
    model = adapted(LORA, seed=5)
    base = {k.replace("base_layer.", ""): v for k, v in model.state_dict().items()
            if not is_adapter_key(k)}
    assert base.keys() == plain.state_dict().keys()
    assert all(base[k].equal(v) for k, v in plain.state_dict().items())
    tokens = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert model(tokens).equal(plain(tokens))  # B = 0: the adapted model is the base


def test_prepare_base_loads_hf_weights_and_qlora_quantizes(tmp_path: Path) -> None:
    from torchao.quantization import NF4Tensor

    from trainer.hf import write_hf_dir

    torch.manual_seed(1)
    source = build_model(ARGS)
    write_hf_dir(tmp_path / "hf", source.state_dict(), ARGS)
    model = adapted(LORA)
    prepare_base(model, LORA, str(tmp_path / "hf"))
    assert model.layers[1].feed_forward.w13.base_layer.weight.equal(
        source.layers[1].feed_forward.w13.weight)
    assert model.tok_embeddings.weight.equal(source.tok_embeddings.weight)
    qlora = FinetuneConfig(method="qlora", rank=4, nf4_scaler_block_size=64)
    q = adapted(qlora)
    prepare_base(q, qlora, str(tmp_path / "hf"))
    weights = [layer.get_base_layer().weight for _, layer in lora_layers(q)]
    assert len(weights) == 8 and all(isinstance(w, NF4Tensor) for w in weights)
    tokens = torch.randint(0, 97, (2, 16))
    out = q(tokens)
    out.float().pow(2).mean().backward()  # gradients reach the adapters through NF4
    a = q.layers[0].attention.wqkv.lora_B["default"].weight.grad
    assert a is not None and a.abs().sum() > 0
    # NF4 is lossy but close: the logits of the quantized base stay near the source's.
    with torch.no_grad():
        assert (q(tokens) - source(tokens)).abs().max() < 0.5


def test_adapter_state_is_adapters_only_and_strict_on_load() -> None:
    model = adapted(LORA)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randint(0, 97, (1, 8))).sum().backward()
    opt.step()
    state = AdapterOptimState(model, opt).state_dict()
    assert state["model"] and all(is_adapter_key(k) for k in state["model"])
    assert len(state["optim"]["state"]) == len(state["model"])
    other = adapted(FinetuneConfig(method="lora", rank=4, target_modules=["wqkv"]))
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match="adapter checkpoint does not match the model"):
        AdapterOptimState(other, other_opt).load_state_dict(state)
    again = adapted(LORA, seed=9)
    again_opt = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad])
    AdapterOptimState(again, again_opt).load_state_dict(state)
    for k, v in state["model"].items():
        assert again.state_dict()[k].equal(v)


def test_peft_split_is_exact() -> None:
    """B split by the weight's rows with A shared gives each HF projection its exact delta."""
    model = adapted(LORA)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B["default"].weight.normal_()
    sd = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    out = peft_adapter(sd, ARGS, LORA)
    assert len(out) == 2 * 2 * 7  # layers x (A, B) x seven HF projections
    p = "base_model.model.model.layers.1."
    fused = (sd["layers.1.attention.wqkv.lora_B.default.weight"]
             @ sd["layers.1.attention.wqkv.lora_A.default.weight"])
    parts = [out[p + f"self_attn.{n}_proj.lora_B.weight"] @ out[p + f"self_attn.{n}_proj."
                                                                  "lora_A.weight"]
             for n in "qkv"]
    assert torch.cat(parts).equal(fused)
    gate_up = (sd["layers.1.feed_forward.w13.lora_B.default.weight"]
               @ sd["layers.1.feed_forward.w13.lora_A.default.weight"])
    parts = [out[p + f"mlp.{n}_proj.lora_B.weight"] @ out[p + f"mlp.{n}_proj.lora_A.weight"]
             for n in ("gate", "up")]
    assert torch.cat(parts).equal(gate_up)


def test_base_state_dict_moves_wrapped_weights_only() -> None:
    model = adapted(FinetuneConfig(method="lora", target_modules=["w2"]))
    renamed = base_state_dict(model, {"layers.0.feed_forward.w2.weight": torch.zeros(1),
                                      "layers.0.attention.wo.weight": torch.zeros(1)})
    assert sorted(renamed) == ["layers.0.attention.wo.weight",
                               "layers.0.feed_forward.w2.base_layer.weight"]


def _problems(tmp_path: Path, trainer: dict) -> dict[str, str]:
    """The dotted fields (and messages) the config loader rejects ``trainer`` with."""
    from orchestrator.config import ConfigError
    from orchestrator.config.loader import validate_data
    from trainer.hf import write_hf_dir

    if not (tmp_path / "hf").exists():
        write_hf_dir(tmp_path / "hf", build_model(ARGS).state_dict(), ARGS)
    data = {"trainer": {"model": {"init_from_hf": str(tmp_path / "hf")},
                        "data": {"seq_len": 16}, **trainer}}
    try:
        validate_data(data, "job.yaml")
    except ConfigError as err:
        return {p.path: p.message for p in err.problems}
    return {}


@pytest.mark.parametrize("trainer,field,words", [
    ({"finetune": {"method": "lora"}, "parallelism": {"strategy": "deepspeed"}},
     "trainer.finetune", "strategy fsdp2, ddp or none"),
    ({"finetune": {"method": "qlora", "nf4_block_size": 48},
      "parallelism": {"strategy": "fsdp2"}},
     "trainer.finetune.nf4_scaler_block_size", "not a multiple"),
    ({"finetune": {"method": "qlora"}, "parallelism": {"strategy": "ddp"}},
     "trainer.finetune.nf4_scaler_block_size", "not a multiple"),
    ({"finetune": {"method": "lora", "target_modules": ["wqkv", "wqkv"]}},
     "trainer.finetune.target_modules", "names a module twice"),
    ({"finetune": {"method": "lora", "target_modules": ["q_proj"]}},
     "trainer.finetune.target_modules.0", "wqkv"),
    ({"finetune": {"method": "lora"}, "device": "cuda",
      "precision": {"fp8": True, "param_dtype": "bf16"}},
     "trainer.precision.fp8", "do not combine"),
])
def test_config_rules(tmp_path: Path, trainer: dict, field: str, words: str) -> None:
    problems = _problems(tmp_path, trainer)
    assert words in problems[field], problems


def test_a_valid_finetune_section_and_one_without_a_base(tmp_path: Path) -> None:
    assert _problems(tmp_path, {"finetune": {"method": "lora"},
                                "parallelism": {"strategy": "ddp"}}) == {}
    # QLoRA with FSDP2: the shards are checked at start, when the world size is known.
    assert _problems(tmp_path, {"finetune": {"method": "qlora", "nf4_scaler_block_size": 16},
                                "parallelism": {"strategy": "fsdp2"}}) == {}
    problems = _problems(tmp_path, {"finetune": {"method": "lora"}, "model": {}})
    assert "needs a base" in problems["trainer.finetune"]


FUZZ = {"finetune": 0}


@settings(max_examples=120, deadline=None)
@given(st.dictionaries(st.sampled_from(["method", "rank", "alpha", "dropout", "target_modules",
                                        "nf4_block_size", "bogus"]),
                       st.one_of(st.integers(-3, 5000), st.floats(allow_nan=True),
                                 st.text(max_size=6), st.lists(st.text(max_size=5),
                                                               max_size=3), st.none())))
def test_fuzzed_finetune_sections_validate_or_raise_value_errors(data: dict) -> None:
    FUZZ["finetune"] += 1
    try:
        ft = FinetuneConfig.model_validate(data)
    except ValueError:  # pydantic's ValidationError and FieldError are ValueErrors
        return
    assert ft.method in ("lora", "qlora") and ft.rank > 0 and 0 <= ft.dropout < 1
    assert set(ft.target_modules) <= {"wqkv", "wo", "w13", "w2"}


def test_finetune_fuzz_count() -> None:
    print(f"finetune config fuzz cases: {FUZZ['finetune']}")
    assert FUZZ["finetune"] >= 100


def test_quantize_base_names_a_weight_that_cannot_shard() -> None:
    # wo is 64 x 64: one scaler block of 64 x 64 values, which 2 FSDP2 ranks cannot split.
    qlora = FinetuneConfig(method="qlora", rank=4, nf4_scaler_block_size=64)
    with pytest.raises(ValueError, match=r"attention\.wo: 64 rows and 1 NF4 scaler blocks do "
                                         r"not both split into 2 FSDP2 shards"):
        quantize_base(adapted(qlora), qlora, shards=2)
    small = FinetuneConfig(method="qlora", rank=4, nf4_scaler_block_size=32)
    assert quantize_base(adapted(small), small, shards=2) == 8


SHARD_FUZZ = {"fits": 0, "refused": 0}


@settings(max_examples=100, deadline=None)
@given(rows=st.one_of(st.integers(1, 48), st.integers(1, 12).map(lambda k: 4 * k)),
       cols=st.sampled_from([16, 32, 64, 96]),
       block=st.sampled_from([16, 32, 64]), scaler=st.sampled_from([2, 4, 8]),
       shards=st.integers(1, 4))
def test_nf4_shard_rule_matches_how_fsdp2_chunks_an_nf4_tensor(rows: int, cols: int,
                                                              block: int, scaler: int,
                                                              shards: int) -> None:
    """Where the rule says yes, FSDP2's dim-0 chunks of torchao's NF4 tensor are exactly the
    chunks of its dequantized weight; where it says no, torchao cannot quantize the weight
    or the chunks come out uneven, missing, wrong or not at all."""
    from torchao.quantization import to_nf4

    from trainer.config import nf4_shard_problem

    ft = FinetuneConfig(method="qlora", nf4_block_size=block, nf4_scaler_block_size=scaler)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    problem = nf4_shard_problem((rows, cols), ft, shards)
    try:
        nf4 = to_nf4(weight, block, scaler)
        full = nf4.get_original_weight()
        chunks = torch.chunk(nf4, shards, dim=0)
        ok = len(chunks) == shards and all(
            c.get_original_weight().equal(f) for c, f in zip(chunks, torch.chunk(full, shards)))
    except (AssertionError, NotImplementedError, RuntimeError, ValueError):
        ok = False
    SHARD_FUZZ["refused" if problem else "fits"] += 1
    # The rule is exact: refused where and only where FSDP2 could not shard it correctly.
    assert ok == (problem is None), (rows, cols, block, scaler, shards, problem)


def test_nf4_shard_fuzz_count() -> None:
    print(f"nf4 shard rule cases: {SHARD_FUZZ}")
    assert SHARD_FUZZ["fits"] >= 5 and SHARD_FUZZ["refused"] >= 5
