"""The Hugging Face mapping: our model and transformers' LlamaForCausalLM agree on logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer import hf
from trainer.model import build_model
from trainer.presets import ModelArgs

transformers = pytest.importorskip("transformers")

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97,
                 max_seq_len=64, rope_theta=50000.0, norm_eps=1e-6)


def _ours(seed: int = 0, args: ModelArgs = ARGS) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(args)
    with torch.no_grad():  # norms away from 1, so a mix-up of the two norms would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _tokens(args: ModelArgs = ARGS) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(7))


def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    model = _ours()
    written = hf.write_hf_dir(tmp_path / "hf", model.state_dict(), ARGS)
    assert set(written) == {"config.json", "model.safetensors"}
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf",
                                                           torch_dtype=torch.float32).eval()
    assert theirs.config.num_key_value_heads == 2
    assert theirs.config.tie_word_embeddings is False
    tokens = _tokens()
    with torch.no_grad():
        a = model(tokens)
        b = theirs(tokens).logits.float()
    assert a.shape == b.shape == (2, 48, ARGS.vocab_size)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # And the mapping is not vacuous: another model's weights give other logits.
    with torch.no_grad():
        assert (_ours(seed=1)(tokens) - b).abs().max() > 1e-2


def test_import_from_transformers_gives_the_same_logits(tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf.hf_config(ARGS).items()
                                      if k not in ("architectures", "model_type")})
    torch.manual_seed(3)
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    theirs.save_pretrained(tmp_path / "hf")
    args, sd = hf.read_hf_dir(tmp_path / "hf")
    assert args == ModelArgs(**{**ARGS.__dict__, "init_std": cfg.initializer_range})
    model = build_model(args)
    model.load_state_dict(sd, strict=True)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), theirs(tokens).logits.float(),
                                   rtol=1e-4, atol=1e-5)


def test_round_trip_is_exact_and_sharded_export_has_an_index(tmp_path: Path) -> None:
    model = _ours()
    written = hf.write_hf_dir(tmp_path / "hf", model.state_dict(), ARGS, max_shard_bytes=40_000)
    assert hf.INDEX in written and sum(w.endswith(".safetensors") for w in written) > 2
    index = json.loads((tmp_path / "hf" / hf.INDEX).read_text())
    assert len(index["weight_map"]) == 3 + 9 * ARGS.n_layers
    _, sd = hf.read_hf_dir(tmp_path / "hf")
    ref = model.state_dict()
    assert sd.keys() == ref.keys()
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k


def test_bf16_export_and_tied_import(tmp_path: Path) -> None:
    model = _ours()
    hf.write_hf_dir(tmp_path / "hf", model.state_dict(), ARGS, dtype="bfloat16")
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "hf" / hf.WEIGHTS))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tied = {k: v for k, v in hf.to_hf(model.state_dict(), ARGS).items() if k != "lm_head.weight"}
    ours = hf.from_hf(tied, ARGS)
    assert torch.equal(ours["output.weight"], ours["tok_embeddings.weight"])


def test_tokenizer_files_are_copied(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["hello world " * 20], trainers.BpeTrainer(
        vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    src = tmp_path / "tok"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    written = hf.write_hf_dir(tmp_path / "hf", _ours().state_dict(), ARGS,
                              tokenizer=str(src / "tokenizer.json"))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    none = hf.write_hf_dir(tmp_path / "hf2", _ours().state_dict(), ARGS, tokenizer="byte")
    assert not any(w.startswith("tokenizer") for w in none)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "mistral"}, "not 'llama'"),
])
def test_unsupported_hf_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf.args_from_hf_config({**hf.hf_config(ARGS), **change})


def test_check_shape_names_the_fields() -> None:
    other = ModelArgs(**{**ARGS.__dict__, "n_layers": 3, "max_seq_len": 999})
    assert hf.check_shape(ARGS, other) == ["n_layers: 2 here, 3 in the HF config"]
