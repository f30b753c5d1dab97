"""Arrow text data, tokenized and packed online, resumable at the exact token.

The source (``trainer.data.format: arrow``) is one Arrow IPC file (file or stream format), a
directory of them, or a Hugging Face ``datasets`` directory written by ``save_to_disk``
(``state.json`` names its ``.arrow`` files, in IPC stream format). Local files are
memory-mapped with ``pyarrow.memory_map``: the table's buffers are the file's pages, nothing
is copied into Python lists, and a row's text is read only when it is tokenized. ``s3://``
(any fsspec URL) is read through fsspec into Arrow buffers (no mapping across a network).

Order. Rank ``r`` of ``W`` data-parallel ranks reads, in epoch ``e``, the rows
``permutation_e[r::W]`` with ``permutation_e = np.random.default_rng([seed, e]).permutation
(rows)``. Its token stream is those rows' tokens, each followed by the tokenizer's EOS (packing:
no padding, documents run across sample boundaries), epoch after epoch. A sample is the next
``seq_len + 1`` tokens of the stream (inputs and shifted targets); the stream then advances by
``seq_len`` (the last token starts the next sample, as with the prepared shards).

State. ``(epoch, cursor, offset, next_index)``: the next unread token is token ``offset`` of
the rank's ``cursor``-th row of ``epoch``; ``next_index`` is the next global batch. A resume
re-tokenizes that one row and drops ``offset`` tokens, so it reads exactly what an
uninterrupted run would. Each rank has its own state (``per_rank_state``: the backend stores
it under a per-rank key). Global batches inside a skip window are read and dropped, so a
rollback steps over the same data on every rank.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.data.dataset import Batch
from trainer.data.prepare import local_path

__all__ = ["ArrowLoader", "ArrowTexts", "source_files"]

_SUFFIXES = (".arrow", ".feather", ".ipc")
_DATASETS_STATE = "state.json"
_STATE_KEYS = {"epoch", "cursor", "offset", "next_index", "dp_world"}


def source_files(path: str) -> list[str]:
    """The Arrow files of ``path``, in order: the file itself, a ``save_to_disk`` directory's
    ``_data_files``, or a directory's ``*.arrow`` / ``*.feather`` / ``*.ipc`` sorted by name."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    remote = local_path(path) is None
    prefix = path.split("://", 1)[0] + "://" if remote else ""
    if fs.isfile(root):
        return [path]
    if not fs.isdir(root):
        raise FileNotFoundError(f"{path}: no such Arrow file or directory")
    root = root.rstrip("/")
    if fs.isfile(f"{root}/dataset_dict.json"):
        raise ValueError(f"{path} is a datasets DatasetDict: point data.path at one split's "
                         "directory (the one holding state.json)")
    if fs.isfile(f"{root}/{_DATASETS_STATE}"):
        with fs.open(f"{root}/{_DATASETS_STATE}", "r") as f:
            state = json.load(f)
        names = [entry["filename"] for entry in state.get("_data_files", [])]
        for name in names:
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise ValueError(f"{path}/{_DATASETS_STATE}: bad file name {name!r}")
    else:
        names = sorted(Path(p).name for p in fs.ls(root, detail=False)
                       if p.endswith(_SUFFIXES))
    if not names:
        raise FileNotFoundError(f"{path}: no Arrow files ({', '.join(_SUFFIXES)})")
    return [f"{prefix}{root}/{name}" for name in names]


def _read_table(url: str) -> Any:
    """One Arrow IPC file (file or stream format) as a table; memory-mapped when local."""
    import pyarrow as pa

    local = local_path(url)
    if local is not None:
        source: Any = pa.memory_map(str(local), "r")
    else:
        import fsspec

        with fsspec.open(url, "rb") as f:
            source = pa.BufferReader(f.read())  # one ranged GET per file, no mapping
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:  # datasets writes the stream format
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


class ArrowTexts:
    """The text column of every row of an Arrow source (zero-copy over mapped files)."""

    def __init__(self, path: str, column: str = "text") -> None:
        import pyarrow as pa

        self.path = path
        self.files = source_files(path)
        chunks = []
        for url in self.files:
            table = _read_table(url)
            if column not in table.column_names:
                raise ValueError(f"{url}: no column {column!r} (columns: "
                                 f"{', '.join(table.column_names)})")
            col = table.column(column)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                raise ValueError(f"{url}: column {column!r} is {col.type}, not a string")
            chunks.extend(col.chunks)
        self.column = pa.chunked_array(chunks, type=chunks[0].type if chunks else pa.string())
        self.rows = len(self.column)
        if self.rows == 0:
            raise ValueError(f"{path}: no rows")

    def text(self, row: int) -> str:
        """Row ``row``'s text ('' for a null)."""
        value = self.column[row].as_py()
        return value if value is not None else ""


class ArrowLoader:
    """This rank's global batches from an Arrow source (see the module docstring)."""

    per_rank_state = True

    def __init__(self, texts: ArrowTexts, tokenizer: Any, seq_len: int, micro_batch_size: int,
                 grad_accum_steps: int = 1, dp_rank: int = 0, dp_world: int = 1,
                 seed: int = 0, skip_windows: list[tuple[int, int]] | None = None) -> None:
        if seq_len < 1 or micro_batch_size < 1 or grad_accum_steps < 1 or dp_world < 1:
            raise ValueError("seq_len, micro_batch_size, grad_accum_steps and dp_world must "
                             "be positive")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_world})")
        if texts.rows < dp_world:
            raise ValueError(f"{texts.path}: {texts.rows} rows for {dp_world} ranks")
        if tokenizer.eos_id is None:
            raise ValueError("the tokenizer has no EOS token to separate packed documents")
        self.texts = texts
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self._windows = sorted((int(s), int(e)) for s, e in skip_windows or ())
        for start, end in self._windows:
            if start < 0 or end <= start:
                raise ValueError(f"skip window [{start}, {end}) must have 0 <= start < end")
        self._rows_cache: tuple[int, np.ndarray] | None = None
        self._reset(epoch=0, cursor=0, offset=0)
        self._next_index = 0

    # -- the stream -----------------------------------------------------------------------

    def _rank_rows(self, epoch: int) -> np.ndarray:
        if self._rows_cache is None or self._rows_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.texts.rows)
            self._rows_cache = (epoch, perm[self.dp_rank::self.dp_world])
        return self._rows_cache[1]

    def _tokens(self, epoch: int, cursor: int) -> np.ndarray:
        row = int(self._rank_rows(epoch)[cursor])
        ids = self.tokenizer.encode_array(self.texts.text(row))
        return np.append(ids.astype(np.int64), np.int64(self.tokenizer.eos_id))

    def _reset(self, epoch: int, cursor: int, offset: int) -> None:
        # Segments of the stream read but not yet consumed: [epoch, cursor, tokens, offset].
        self._segments: deque[list[Any]] = deque()
        self._head = (epoch, cursor)  # the next row to tokenize
        self._buffered = 0  # unconsumed tokens across the segments
        if offset:
            self._read_row()
            seg = self._segments[0]
            if offset >= len(seg[2]):
                raise ValueError(f"offset {offset} is past row {cursor}'s {len(seg[2])} tokens")
            seg[3] = offset
            self._buffered -= offset

    def _read_row(self) -> None:
        epoch, cursor = self._head
        tokens = self._tokens(epoch, cursor)
        self._segments.append([epoch, cursor, tokens, 0])
        self._buffered += len(tokens)
        cursor += 1
        if cursor == len(self._rank_rows(epoch)):
            epoch, cursor = epoch + 1, 0
        self._head = (epoch, cursor)

    def _sample(self) -> np.ndarray:
        """The next ``seq_len + 1`` tokens; the stream advances by ``seq_len``."""
        need = self.seq_len + 1
        while self._buffered < need:
            self._read_row()
        parts, left = [], need
        for seg in self._segments:
            take = min(left, len(seg[2]) - seg[3])
            parts.append(seg[2][seg[3]:seg[3] + take])
            left -= take
            if not left:
                break
        advance = self.seq_len
        self._buffered -= advance
        while advance:
            seg = self._segments[0]
            step = min(advance, len(seg[2]) - seg[3])
            seg[3] += step
            advance -= step
            if seg[3] == len(seg[2]):
                self._segments.popleft()
        return np.concatenate(parts)

    def position(self) -> tuple[int, int, int]:
        """(epoch, cursor, offset) of the next unread token."""
        if self._segments:
            epoch, cursor, _, offset = self._segments[0]
            return int(epoch), int(cursor), int(offset)
        return self._head[0], self._head[1], 0

    # -- batches --------------------------------------------------------------------------

    @property
    def next_index(self) -> int:
        return self._next_index

    def _micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(self.grad_accum_steps):
            rows = np.stack([self._sample() for _ in range(self.micro_batch_size)])
            data = torch.from_numpy(rows)
            out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
        return out

    def next_batch(self) -> Batch:
        """This rank's micro-batches of the next global batch outside the skip windows."""
        while any(s <= self._next_index < e for s, e in self._windows):
            self._micro_batches()  # read and dropped: every rank skips the same data
            self._next_index += 1
        index = self._next_index
        batch = Batch(index=index, micro_batches=self._micro_batches())
        self._next_index = index + 1
        return batch

    def state_dict(self) -> dict[str, int]:
        epoch, cursor, offset = self.position()
        return {"epoch": epoch, "cursor": cursor, "offset": offset,
                "next_index": self._next_index, "dp_world": self.dp_world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the token ``state_dict()`` recorded (checked before anything moves)."""
        if set(state) != _STATE_KEYS:
            raise ValueError(f"arrow loader state must hold {sorted(_STATE_KEYS)}, got "
                             f"{sorted(state)}")
        values = {k: int(state[k]) for k in _STATE_KEYS}
        if min(values.values()) < 0:
            raise ValueError(f"arrow loader state has a negative entry: {values}")
        if values["dp_world"] != self.dp_world:
            raise ValueError(f"the checkpoint's data position was saved by {values['dp_world']} "
                             f"data-parallel ranks, this run has {self.dp_world}")
        if values["cursor"] >= len(self._rank_rows(values["epoch"])):
            raise ValueError(f"cursor {values['cursor']} is past this rank's rows")
        self._reset(values["epoch"], values["cursor"], values["offset"])
        self._next_index = values["next_index"]
