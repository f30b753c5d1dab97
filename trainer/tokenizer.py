"""Tokenizers: a byte-level one that needs nothing, and a wrapper of Hugging Face ``tokenizers``.

No torch here: the supervisor prepares datasets with these. Each tokenizer's ``describe()`` is
stored in the dataset's index.json, so a dataset prepared with one tokenizer is never trained
with another by mistake.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer"]

# Tried in order when the caller gives no id: Llama 2 / Mistral, Llama 3, GPT-2 / NeoX / Qwen,
# Gemma. The first one the vocabulary holds wins.
_EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """Byte-level tokens: 0..255 are the UTF-8 bytes, 256 is BOS, 257 is EOS."""

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``, with BOS/EOS only when asked."""
        ids = list(text.encode("utf-8"))
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """Like ``encode`` without specials, as an int64 array (fast path for preparing)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte tokens; special tokens are dropped, bad UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        """Identity stored in the dataset index."""
        return {"name": "byte", "vocab_size": self.vocab_size, "bos": self.bos_id,
                "eos": self.eos_id}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

    BOS/EOS ids come from the arguments, else from the first known special token the
    vocabulary holds. An EOS id is required: packing separates documents with it.
    """

    def __init__(self, path: str | Path, bos_id: int | None = None,
                 eos_id: int | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer  # optional dependency
        except ImportError as exc:
            raise ImportError(
                "HF tokenizers need the 'tokenizers' package: pip install 'orchestrator[hf]'"
            ) from exc
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        raw = self.path.read_bytes()
        # The content hash names the tokenizer, so two copies of one file at different paths
        # match and two different files never do.
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self._tok = _HFTokenizer.from_str(raw.decode("utf-8"))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = bos_id if bos_id is not None else self._find(_BOS_CANDIDATES)
        found_eos = eos_id if eos_id is not None else self._find(_EOS_CANDIDATES)
        if found_eos is None:
            raise ValueError(
                f"{self.path}: no EOS token found (looked for {', '.join(_EOS_CANDIDATES)}); "
                "pass eos_id explicitly"
            )
        self.eos_id = found_eos
        for name, value in (("bos_id", self.bos_id), ("eos_id", self.eos_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} outside the vocabulary [0, {self.vocab_size})")

    def _find(self, candidates: Sequence[str]) -> int | None:
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        return None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text`` without the tokenizer's own template, BOS/EOS only when asked."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if bos:
            if self.bos_id is None:
                raise ValueError(f"{self.path}: this tokenizer has no BOS token")
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """Like ``encode`` without specials, as an int64 array."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids with special tokens dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def describe(self) -> dict[str, Any]:
        """Identity stored in the dataset index (content hash, not path)."""
        return {"name": f"hf-{self.sha256[:16]}", "vocab_size": self.vocab_size,
                "bos": self.bos_id, "eos": self.eos_id}


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` gives the byte tokenizer; anything else is a path to ``tokenizer.json``.

    A directory is accepted when it holds ``tokenizer.json`` (a Hugging Face model directory).
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {spec!r}: no such file {path} (use 'byte' or a path to tokenizer.json)"
        )
    return HFTokenizer(path)
