"""Reading token shards and a deterministic, resumable sample order.

Samples are fixed windows of the packed token stream: sample ``i`` is
``tokens[i*seq_len : i*seq_len + seq_len + 1]``, its first ``seq_len`` tokens the inputs and
its last ``seq_len`` the targets. The order of samples is a pure function of the config (seed,
batch shape, world size) and of one integer, the next global batch index, so that integer is
the loader's whole checkpointed state and a resumed run reads exactly what an uninterrupted
run would have read.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.data.prepare import INDEX_NAME, INDEX_VERSION, ensure_dataset, local_path

__all__ = ["Batch", "ResumableLoader", "TokenShards", "ensure_dataset"]


class _LocalShard:
    """A shard file memory-mapped read-only on first use: reads touch only the pages they need.

    Mapping lazily keeps opening a dataset of thousands of shards instant.
    """

    def __init__(self, path: Path, dtype: np.dtype, tokens: int) -> None:
        self.path = path
        self.dtype = dtype
        self.tokens = tokens
        self._map: np.memmap | None = None

    def read(self, lo: int, hi: int) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.tokens,))
        return np.array(self._map[lo:hi])

    def close(self) -> None:
        self._map = None  # drops the mapping once no array views it


class _RemoteShard:
    """A shard behind an fsspec URL, read with seek/read range requests, opened on first use."""

    def __init__(self, url: str, dtype: np.dtype, tokens: int) -> None:
        self.url = url
        self.dtype = dtype
        self.tokens = tokens
        self._file: Any = None

    def read(self, lo: int, hi: int) -> np.ndarray:
        if self._file is None:
            import fsspec

            self._file = fsspec.open(self.url, "rb").open()
        size = self.dtype.itemsize
        self._file.seek(lo * size)
        data = self._file.read((hi - lo) * size)
        if len(data) != (hi - lo) * size:
            raise OSError(f"{self.url}: short read at token {lo} ({len(data)} bytes)")
        return np.frombuffer(data, dtype=self.dtype).copy()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TokenShards:
    """The token stream of a prepared dataset (local directory or fsspec URL)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        local = local_path(self.path)
        if local is not None:
            index_text = (local / INDEX_NAME).read_text()
        else:
            import fsspec

            with fsspec.open(f"{self.path.rstrip('/')}/{INDEX_NAME}", "r") as f:
                index_text = f.read()
        self.index: dict[str, Any] = json.loads(index_text)
        if self.index.get("version") != INDEX_VERSION:
            raise ValueError(f"{self.path}: unsupported dataset index version "
                             f"{self.index.get('version')!r}")
        self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        self._starts: list[int] = []
        self._shards: list[_LocalShard | _RemoteShard] = []
        start = 0
        for shard in self.index["shards"]:
            self._starts.append(start)
            if local is not None:
                self._shards.append(_LocalShard(local / shard["name"], self.dtype,
                                                shard["tokens"]))
            else:
                url = f"{self.path.rstrip('/')}/{shard['name']}"
                self._shards.append(_RemoteShard(url, self.dtype, shard["tokens"]))
            start += shard["tokens"]
        if start != self.index["total_tokens"]:
            raise ValueError(f"{self.path}: shards hold {start} tokens, index says "
                             f"{self.index['total_tokens']}")
        self.total_tokens = start

    @property
    def tokenizer(self) -> dict[str, Any]:
        """The ``describe()`` of the tokenizer the dataset was prepared with."""
        return self.index["tokenizer"]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the stream, across shard boundaries if needed."""
        if start < 0 or n < 0 or start + n > self.total_tokens:
            raise IndexError(f"tokens [{start}, {start + n}) outside [0, {self.total_tokens})")
        parts = []
        pos, end = start, start + n
        shard = bisect.bisect_right(self._starts, pos) - 1
        while pos < end:
            shard_start = self._starts[shard]
            shard_end = shard_start + self.index["shards"][shard]["tokens"]
            hi = min(end, shard_end)
            parts.append(self._shards[shard].read(pos - shard_start, hi - shard_start))
            pos = hi
            shard += 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)

    def close(self) -> None:
        """Release the maps and remote handles."""
        for shard in self._shards:
            shard.close()


@dataclass(frozen=True)
class Batch:
    """One global batch as seen by one rank: ``grad_accum_steps`` (inputs, targets) pairs."""

    index: int
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss_scale: float = 1.0  # the loss (hence gradients) times this; chaos poisons with it

    @property
    def tokens(self) -> int:
        """Target tokens this rank trains on in this batch."""
        return sum(t.numel() for _, t in self.micro_batches)


class ResumableLoader:
    """Deterministic global batches, split over data-parallel ranks and micro-steps.

    Order: epoch ``e`` visits samples in ``np.random.default_rng([seed, e]).permutation(N)``;
    the epochs' permutations are concatenated into one endless sequence, and global batch
    ``b`` is its entries ``[b*G, (b+1)*G)`` with ``G = micro_batch_size * grad_accum_steps *
    dp_world`` (a batch may straddle two epochs). Inside a global batch, micro-step ``m`` of
    rank ``r`` takes entries ``[(m*dp_world + r)*mbs, +mbs)``: each micro-step's samples over all
    ranks are contiguous, so the ranks' samples are disjoint and together cover the batch.

    ``state_dict()`` is only the next global batch index; global batches inside a skip window
    ``[start, end)`` are never returned (rollbacks use this to step over bad data).
    """

    def __init__(self, shards: TokenShards, seq_len: int, micro_batch_size: int,
                 grad_accum_steps: int = 1, dp_rank: int = 0, dp_world: int = 1,
                 seed: int = 0, skip_windows: list[tuple[int, int]] | None = None) -> None:
        if seq_len < 1 or micro_batch_size < 1 or grad_accum_steps < 1 or dp_world < 1:
            raise ValueError("seq_len, micro_batch_size, grad_accum_steps and dp_world must "
                             "be positive")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_world})")
        self.shards = shards
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.num_samples = (shards.total_tokens - 1) // seq_len
        self.global_batch_size = micro_batch_size * grad_accum_steps * dp_world
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"dataset {shards.path} has {self.num_samples} samples of {seq_len} tokens, "
                f"fewer than one global batch ({self.global_batch_size} = micro_batch_size "
                f"{micro_batch_size} x grad_accum_steps {grad_accum_steps} x dp_world "
                f"{dp_world}); prepare more data or shrink the batch"
            )
        self._windows: list[tuple[int, int]] = []
        for start, end in skip_windows or ():
            self.add_skip_window(start, end)
        self._next_index = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def next_index(self) -> int:
        """The global batch index the next call may return (before skip windows)."""
        return self._next_index

    @property
    def skip_windows(self) -> list[tuple[int, int]]:
        return list(self._windows)

    def add_skip_window(self, start: int, end: int) -> None:
        """Never return global batches ``start <= b < end``."""
        if start < 0 or end <= start:
            raise ValueError(f"skip window [{start}, {end}) must have 0 <= start < end")
        self._windows.append((int(start), int(end)))
        self._windows.sort()

    def resolve_index(self, index: int) -> int:
        """The first global batch index >= ``index`` outside every skip window."""
        moved = True
        while moved:  # windows may overlap or abut, so repeat until no window holds it
            moved = False
            for start, end in self._windows:
                if start <= index < end:
                    index, moved = end, True
        return index

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            # A batch spans at most two epochs, so two cached permutations suffice.
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def _samples_at(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))[offsets[mask]]
        return out

    def global_sample_ids(self, index: int) -> np.ndarray:
        """All sample ids of global batch ``index``, in position order (length G)."""
        start = index * self.global_batch_size
        return self._samples_at(np.arange(start, start + self.global_batch_size, dtype=np.int64))

    def rank_sample_ids(self, index: int) -> np.ndarray:
        """This rank's sample ids of global batch ``index``, shape [grad_accum, mbs]."""
        mbs, world = self.micro_batch_size, self.dp_world
        micro = np.arange(self.grad_accum_steps, dtype=np.int64)[:, None]
        within = np.arange(mbs, dtype=np.int64)[None, :]
        positions = index * self.global_batch_size + (micro * world + self.dp_rank) * mbs + within
        return self._samples_at(positions.reshape(-1)).reshape(self.grad_accum_steps, mbs)

    def next_batch(self) -> Batch:
        """This rank's micro-batches of the next global batch outside the skip windows."""
        index = self.resolve_index(self._next_index)
        micro_batches = []
        for sample_ids in self.rank_sample_ids(index):
            rows = np.stack([self.shards.read(int(i) * self.seq_len, self.seq_len + 1)
                             for i in sample_ids]).astype(np.int64)
            data = torch.from_numpy(rows)
            micro_batches.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
        self._next_index = index + 1
        return Batch(index=index, micro_batches=micro_batches)

    def epoch_of(self, index: int) -> int:
        """The epoch of global batch ``index``'s first sample."""
        return index * self.global_batch_size // self.num_samples

    def state_dict(self) -> dict[str, int]:
        """The loader's whole state; everything else is derived from the config."""
        return {"next_index": self._next_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position ``state_dict()`` recorded."""
        if set(state) != {"next_index"}:
            raise ValueError(f"loader state must hold exactly 'next_index', got {sorted(state)}")
        next_index = int(state["next_index"])
        if next_index < 0:
            raise ValueError(f"next_index {next_index} is negative")
        self._next_index = next_index
