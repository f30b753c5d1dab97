"""Fixtures shared by the trainer unit tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from trainer.presets import ModelArgs


@pytest.fixture
def small_args() -> ModelArgs:
    """A model small enough for many forward passes per test, with GQA (4 heads, 2 kv)."""
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97,
                     max_seq_len=64)


@pytest.fixture
def make_shards(tmp_path: Path) -> Callable[..., Path]:
    """Write a dataset whose token stream is 0, 1, 2, ... so every token names its position."""

    def make(total_tokens: int, shard_tokens: int, name: str = "arange") -> Path:
        assert total_tokens < 65536
        out = tmp_path / name
        out.mkdir()
        stream = np.arange(total_tokens, dtype="<u2")
        shards = []
        for i, start in enumerate(range(0, total_tokens, shard_tokens)):
            part = stream[start:start + shard_tokens]
            (out / f"shard-{i:05d}.bin").write_bytes(part.tobytes())
            shards.append({"name": f"shard-{i:05d}.bin", "tokens": len(part),
                           "bytes": part.nbytes})
        index = {"version": 1, "tokenizer": {"name": "test", "vocab_size": 65536, "bos": None,
                                             "eos": 0},
                 "dtype": "uint16", "shards": shards, "total_tokens": total_tokens,
                 "documents": 1, "sources": {"kind": "files", "count": 0, "names": []}}
        (out / "index.json").write_text(json.dumps(index))
        return out

    return make
