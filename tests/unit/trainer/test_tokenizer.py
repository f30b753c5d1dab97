"""Byte and Hugging Face tokenizers."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.presets import PRESETS
from trainer.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_round_trip_including_multibyte_text() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 🚀\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert np.array_equal(tok.encode_array(text), np.array(ids))


def test_byte_special_ids_only_when_asked() -> None:
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    assert tok.encode("ab", bos=True, eos=True) == [256, 97, 98, 257]
    assert tok.encode("ab") == [97, 98]
    assert tok.decode([256, 104, 105, 257]) == "hi"  # specials dropped
    assert tok.decode([0xFF, 104]) == "\ufffdh"  # invalid UTF-8 replaced, not raised


def test_byte_vocab_fits_the_byte_presets() -> None:
    assert ByteTokenizer().vocab_size <= PRESETS["tiny"].vocab_size
    assert ByteTokenizer().vocab_size <= PRESETS["small"].vocab_size


def test_byte_describe_and_load() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.describe() == {"name": "byte", "vocab_size": 258, "bos": 256, "eos": 257}


def test_load_tokenizer_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(missing))


def test_hf_import_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match=r"orchestrator\[hf\]"):
        HFTokenizer(path)


def _write_word_level(path: Path, specials: list[str]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    for token in specials:
        vocab[token] = len(vocab)
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(path))
    return path


def test_hf_tokenizer_finds_specials_and_round_trips(tmp_path: Path) -> None:
    path = _write_word_level(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    tok = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json works too
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (4, 5, 6)
    assert tok.encode("hello world", bos=True, eos=True) == [4, 1, 2, 5]
    assert tok.decode([4, 1, 2, 5]) == "hello world"
    assert list(tok.encode_array("world again")) == [2, 3]
    # The identity is the content, not the location.
    copy = tmp_path / "elsewhere.json"
    shutil.copy(path, copy)
    assert HFTokenizer(copy).describe() == tok.describe()
    assert tok.describe()["vocab_size"] == 6 and tok.describe()["eos"] == 5


def test_hf_llama3_style_eos_and_explicit_ids(tmp_path: Path) -> None:
    path = _write_word_level(tmp_path / "t.json", ["<|begin_of_text|>", "<|end_of_text|>"])
    tok = HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id) == (4, 5)
    assert HFTokenizer(path, eos_id=3).eos_id == 3


def test_hf_without_eos_is_an_error(tmp_path: Path) -> None:
    path = _write_word_level(tmp_path / "t.json", [])
    with pytest.raises(ValueError, match="no EOS token"):
        HFTokenizer(path)
    assert HFTokenizer(path, eos_id=0).bos_id is None
