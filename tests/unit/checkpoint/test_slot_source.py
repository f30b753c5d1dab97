"""A durable save whose tensors come from the memory tier's copy of its step: it writes
exactly the state at the save (bit for bit, its plain values those of the save too), it
holds the slot until its bytes are copied out (never the whole write), it is refused, doing
nothing, for a copy that does not match the state, and the matching of tensors to segments
never lets a byte move when any of dtype, shape, size or place disagree (fuzzed)."""

from __future__ import annotations

import dataclasses
import mmap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent.memory import NodeMemory
from trainer.checkpoint import layout, signing, slot_source
from trainer.checkpoint import memory_format as mf
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.retry import retrying
from trainer.checkpoint.store import open_store
from trainer.config import CheckpointConfig
from trainer.model import build_model
from trainer.presets import PRESETS
from trainer.state import ModelOptimState, Progress

TRIED = {"matched": 0, "refused": 0}


class Job:
    """One rank's model, optimizer and progress, its durable tier and its memory tier."""

    def __init__(self, root: Path, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = build_model(PRESETS["tiny"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.progress = Progress()
        self.state = {"app": ModelOptimState(self.model, self.opt), "progress": self.progress}
        self.logs: list[str] = []
        cfg = CheckpointConfig(url=str(root / "ck"))
        self.ckpt = Checkpointer(cfg, open_store(cfg, "job", str(root / "ck"),
                                                 retrying(1, 0.01, 0.01)),
                                 rank=0, world_size=1, group=dist.group.WORLD,
                                 meta={"job": "job"}, report=lambda *a, **k: None,
                                 log=self.logs.append)
        node = NodeMemory(root, root / "run", "n0")
        node.provision([0], 1, 1, 64 * 2**20, partner=False)
        self.memory = MemoryTier(node.path, rank=0, world_size=1, procs_per_node=1, job="job",
                                 config_hash=None, generation=1, partner=False, group=None,
                                 trust=lambda: signing.Trust(b"k" * 32),
                                 log=self.logs.append)
        self.ckpt.stage_from_memory()

    def step(self) -> None:
        tokens = torch.randint(0, 264, (2, 16))
        loss = torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1),
                                                 tokens.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.progress.step += 1
        self.progress.tokens += 32

    def save(self, commit: bool = True) -> float | None:
        """Both tiers at this step, as the loop does it."""
        step = self.progress.step
        self.memory.save(step, self.progress.tokens, self.state, commit=commit)
        copy = self.memory.copy_of(step)
        assert copy is not None
        return self.ckpt.save_from(step, self.progress.tokens, copy)

    def snapshot(self) -> dict[str, Any]:
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "opt": {i: {k: v.clone() for k, v in s.items()}
                        for i, s in enumerate(self.opt.state.values())},
                "progress": (self.progress.step, self.progress.tokens)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["progress"] == b["progress"] and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and all(
        torch.equal(a["opt"][i][k], b["opt"][i][k]) for i in a["opt"] for k in a["opt"][i])


def test_the_save_writes_the_state_at_its_step_from_the_copy(tmp_path: Path, pg: None) -> None:
    job = Job(tmp_path)
    job.step()
    job.ckpt.prepare_staging(job.state)  # nothing ahead: the first save's thread allocates
    assert job.ckpt.staging is not None and not job.ckpt.staging.started
    wants, buffers = {}, []
    for _ in range(2):
        job.step()
        blocked = job.save()
        assert blocked is not None and blocked < 30
        wants[job.progress.step] = job.snapshot()
        job.step()  # training goes on while the files are written
        job.ckpt.wait()
        buffers.append(job.ckpt._buffers)
    assert not job.ckpt.staging.pinned and job.ckpt.staging.started
    assert buffers[0] is not None and buffers[1] is buffers[0]  # allocated once, kept
    assert not [line for line in job.logs if "cannot serve" in line or "no longer" in line]
    for step, want in wants.items():
        fresh = Job(tmp_path / f"fresh{step}", seed=1)
        fresh.ckpt = job.ckpt
        manifest = job.ckpt.restore(fresh.state, max_step=step)
        assert manifest is not None and manifest["step"] == step
        assert _same(fresh.snapshot(), want), step
    job.memory.close()


def test_the_slot_is_held_until_copied_out_and_the_last_copy_is_not_committed(
        tmp_path: Path, pg: None, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path)
    job.step()
    release = threading.Event()
    real_fill = slot_source.fill

    def slow_fill(buf: mmap.mmap, pairs: list[Any], threads: int | None = None) -> int:
        release.wait(30)
        return real_fill(buf, pairs, threads)

    monkeypatch.setattr(slot_source, "fill", slow_fill)
    job.save()
    want = job.snapshot()
    for _ in range(2):  # the second memory save comes to the held slot and must wait
        job.step()
        if job.progress.step == 3:
            threading.Timer(0.5, release.set).start()
        job.memory.save(job.progress.step, job.progress.tokens, job.state)
    assert release.is_set()
    assert [line for line in job.logs if "for a durable save to copy slot" in line]
    job.ckpt.wait()
    fresh = Job(tmp_path / "fresh", seed=1)
    job.ckpt.restore(fresh.state, max_step=1)
    assert _same(fresh.snapshot(), want)  # not the later state the memory tier holds now
    job.step()
    assert job.save(commit=False) is not None
    job.ckpt.wait()
    job.memory.wait()
    assert 4 not in [c.manifest.step for c in job.memory.slots.copies("own", 0)]
    job.memory.close()


def test_a_copy_that_does_not_match_is_refused_and_nothing_is_written(
        tmp_path: Path, pg: None) -> None:
    job = Job(tmp_path)
    job.step()
    job.memory.save(1, 32, job.state)
    copy = job.memory.copy_of(1)
    assert copy is not None
    assert job.ckpt.save_from(2, 64, copy) is None  # another step's copy
    # Segments that no longer describe the state dicts the copy was made from.
    segs = list(copy.segments)
    segs[0] = segs[0].model_copy(update={"shape": [*segs[0].shape, 1]})
    bad = dataclasses.replace(copy, segments=tuple(segs))
    assert job.ckpt.save_from(1, 32, bad) is None
    assert [line for line in job.logs if "cannot serve the save" in line]
    assert layout.list_checkpoints(job.ckpt.store.primary.root) == []
    assert job.ckpt.save(1, job.state, 32) >= 0  # the plain save works as before
    job.ckpt.wait()
    assert [(c.step, c.committed) for c in layout.list_checkpoints(
        job.ckpt.store.primary.root)] == [(1, True)]
    job.memory.close()


# -- matching, fuzzed ------------------------------------------------------------------------
_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
_tensor = st.tuples(st.lists(st.integers(0, 5), max_size=3), st.sampled_from(_DTYPES)).map(
    lambda t: torch.randint(0, 100, tuple(t[0])).to(t[1]))
_leaf = st.one_of(_tensor, st.integers(), st.none(), st.text(max_size=3))
_trees = st.recursive(_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=3), kids, max_size=3)),
    max_leaves=8)
_states = st.dictionaries(st.sampled_from(["a", "b", "c"]), _trees, min_size=1)


def _copy_of(state: dict[str, Any]) -> tuple[slot_source.SlotCopy, list[torch.Tensor]]:
    """A slot holding ``state``'s tensors as the memory tier lays them out."""
    tensors: list[torch.Tensor] = []
    for k in sorted(state):
        mf.flatten(state[k], tensors, lambda v: isinstance(v, torch.Tensor))
    segments, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        segments.append(mf.Segment(offset=offset, nbytes=n, shape=list(t.shape),
                                   dtype=str(t.dtype).removeprefix("torch.")))
        offset = mf.aligned(offset + n)
    buf = mmap.mmap(-1, max(offset, 1))
    for t, seg in zip(tensors, segments, strict=True):
        buf[seg.offset:seg.offset + seg.nbytes] = t.contiguous().reshape(-1).view(torch.uint8) \
            .numpy().tobytes()
    return slot_source.SlotCopy(1, buf, tuple(sorted(state)), tuple(segments),
                                lambda _f: None, state), tensors


def _buffers(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _buffers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_buffers(v) for v in tree]
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else "stale"


@settings(max_examples=200, deadline=None)
@given(state=_states, damage=st.sampled_from(["none", "dtype", "shape", "nbytes", "offset",
                                               "count", "keys"]),
       which=st.integers(0, 50), piece=st.integers(1, 64))
def test_match_pairs_every_tensor_or_refuses(state: dict[str, Any], damage: str, which: int,
                                             piece: int) -> None:
    copy, tensors = _copy_of(state)
    segs = list(copy.segments)
    if damage == "keys":
        copy = dataclasses.replace(copy, keys=(*copy.keys, "zz"))
    elif damage == "count":
        copy = dataclasses.replace(copy, segments=tuple(segs[:-1] if segs else [
            mf.Segment(offset=0, nbytes=0, dtype="uint8", shape=[0])]))
    elif damage != "none" and segs:
        i = which % len(segs)
        s = segs[i]
        segs[i] = s.model_copy(update={
            "dtype": {"dtype": "float64" if s.dtype != "float64" else "int8"},
            "shape": {"shape": [*s.shape, 2]},
            "nbytes": {"nbytes": s.nbytes + 1},
            "offset": {"offset": len(copy.buf) + 64}}[damage])
        copy = dataclasses.replace(copy, segments=tuple(segs))
    else:
        damage = "none"
    buffers = _buffers(state)
    problem = slot_source.check(copy)
    if damage != "none":
        TRIED["refused"] += 1
        assert isinstance(problem, str)
        with pytest.raises(ValueError):
            slot_source.pair(copy, buffers)
        return
    TRIED["matched"] += 1
    assert problem is None
    staged, pairs = slot_source.pair(copy, buffers)
    assert len(pairs) == len(tensors)
    moved = sum(len(slot_source.pieces([p], 0, piece)) for p in pairs)
    assert moved >= len([t for t in tensors if t.numel()])
    slot_source.fill(copy.buf, pairs, threads=2)
    flat: list[torch.Tensor] = []
    for k in sorted(staged):
        mf.flatten(staged[k], flat, lambda v: isinstance(v, torch.Tensor))
    assert all(torch.equal(a, b) for a, b in zip(flat, tensors, strict=True))
    # Plain values are the state's own, never the buffers' stale ones.
    assert "stale" not in repr(staged)


def test_fuzz_counts() -> None:
    assert TRIED["matched"] >= 20 and TRIED["refused"] >= 30
