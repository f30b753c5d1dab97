"""Preparing token shards, reading them, and the deterministic resumable sample order."""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import DataConfig
from trainer.data.dataset import ResumableLoader, TokenShards, ensure_dataset
from trainer.data.prepare import prepare_dataset, read_index, stdlib_sources

EOS = 257
DOCS = ["first file\n", "second — file with ünïcode\n", "alpha", "beta", "gamma delta"]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(DOCS[0])
    (src / "b.txt").write_text(DOCS[1])
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS[2:])]
    (src / "c.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    return src


def _stream(docs: list[str]) -> np.ndarray:
    return np.array([t for d in docs for t in [*d.encode("utf-8"), EOS]])


def _read_all(out: Path, index: dict) -> np.ndarray:
    return np.concatenate([np.fromfile(out / s["name"], dtype="<u2") for s in index["shards"]])


def test_prepare_packs_documents_with_eos(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    calls: list[tuple[int, int]] = []
    index = prepare_dataset([str(corpus / "*.txt"), corpus / "c.jsonl"], out, shard_tokens=16,
                            progress=lambda done, total: calls.append((done, total)))
    expected = _stream(DOCS)
    assert index == json.loads((out / "index.json").read_text())
    assert index["version"] == 1 and index["dtype"] == "uint16"
    assert index["tokenizer"] == {"name": "byte", "vocab_size": 258, "bos": 256, "eos": 257}
    assert index["documents"] == 5 and index["total_tokens"] == len(expected)
    assert [s["tokens"] for s in index["shards"][:-1]] == [16] * (len(index["shards"]) - 1)
    assert len(index["shards"]) == -(-len(expected) // 16)
    assert all(s["bytes"] == 2 * s["tokens"] for s in index["shards"])
    assert index["sources"]["count"] == 3 and index["truncated"] is False
    stream = _read_all(out, index)
    assert np.array_equal(stream, expected)
    assert (stream == EOS).sum() == 5
    assert calls[-1] == (index["source_bytes"], index["source_bytes"])
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_prepare_is_idempotent(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    first = prepare_dataset([corpus / "a.txt"], out, shard_tokens=8)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    called = []
    again = prepare_dataset([corpus / "b.txt"], out, progress=lambda *a: called.append(a))
    assert again == first and not called
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ('{"txt": "x"}', "expected an object with a string 'text'"),
])
def test_bad_jsonl_fails_without_leaving_a_directory(tmp_path: Path, line: str,
                                                     message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    out = tmp_path / "out" / "ds"
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: {message}"):
        prepare_dataset([bad], out, shard_tokens=4)
    assert not out.exists()
    assert list((tmp_path / "out").iterdir()) == []  # no temporary directory left behind


def test_missing_sources_and_nonempty_target_are_errors(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="matches no files"):
        prepare_dataset([str(corpus / "*.md")], tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="not found"):
        prepare_dataset([corpus / "missing.txt"], tmp_path / "x")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "stray").write_text("x")
    with pytest.raises(FileExistsError, match="no complete dataset"):
        prepare_dataset([corpus / "a.txt"], junk)


def test_max_bytes_truncates_at_a_document_boundary(corpus: Path, tmp_path: Path) -> None:
    cap = len(DOCS[0].encode()) + 3
    index = prepare_dataset([corpus / "a.txt", corpus / "b.txt"], tmp_path / "ds",
                            max_bytes=cap)
    assert index["truncated"] is True and index["documents"] == 1
    assert np.array_equal(_read_all(tmp_path / "ds", index), _stream(DOCS[:1]))


def test_stdlib_sources_are_sorted_capped_and_library_only() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    small, large = stdlib_sources(30_000), stdlib_sources(120_000)
    assert small and large[: len(small)] == small and len(large) > len(small)
    assert sum(p.stat().st_size for p in large) <= 120_000
    rel = [p.relative_to(root).as_posix() for p in large]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert stdlib_sources(120_000) == large
    excluded = {"site-packages", "test", "tests", "idlelib"}
    assert not any(excluded & set(r.split("/")) for r in
                   (p.relative_to(root).as_posix() for p in stdlib_sources(3_000_000)))


def test_prepare_stdlib(tmp_path: Path) -> None:
    index = prepare_dataset("stdlib", tmp_path / "std", shard_tokens=4096, max_bytes=60_000)
    files = stdlib_sources(60_000)
    assert index["sources"]["kind"] == "stdlib" and index["sources"]["count"] == len(files)
    assert index["documents"] == len(files) and index["source_bytes"] <= 60_000
    assert index["total_tokens"] == sum(len(p.read_bytes()) + 1 for p in files)
    assert read_index(tmp_path / "std") == index


def test_token_shards_read_across_boundaries(make_shards: Callable[..., Path]) -> None:
    shards = TokenShards(make_shards(100, 16))
    assert shards.total_tokens == 100
    assert np.array_equal(shards.read(10, 40), np.arange(10, 50))  # spans three shards
    assert np.array_equal(shards.read(96, 4), np.arange(96, 100))
    with pytest.raises(IndexError):
        shards.read(90, 11)


def test_token_shards_through_fsspec_url(make_shards: Callable[..., Path]) -> None:
    fsspec = pytest.importorskip("fsspec")
    local = make_shards(100, 16)
    fs = fsspec.filesystem("memory")
    for path in local.iterdir():
        fs.pipe(f"/mem-ds/{path.name}", path.read_bytes())
    shards = TokenShards("memory://mem-ds")
    assert np.array_equal(shards.read(5, 60), np.arange(5, 65))
    shards.close()


def _loader(path: Path, **kw) -> ResumableLoader:
    args = {"seq_len": 4, "micro_batch_size": 2, "grad_accum_steps": 2, "dp_rank": 0,
            "dp_world": 2, "seed": 5, **kw}
    return ResumableLoader(TokenShards(path), **args)


def _ids(batch, seq_len: int = 4) -> list[int]:
    """Sample ids of a rank's batch: the stream is 0, 1, 2, ... so input[0] = id * seq_len."""
    return [int(x) // seq_len for inp, _ in batch.micro_batches for x in inp[:, 0]]


def test_samples_are_shifted_windows_in_documented_order(make_shards) -> None:
    loader = _loader(make_shards(201, 64))  # (201 - 1) // 4 = 50 samples
    assert loader.num_samples == 50 and loader.global_batch_size == 8
    batch = loader.next_batch()
    assert batch.index == 0 and len(batch.micro_batches) == 2
    inp, tgt = batch.micro_batches[0]
    assert inp.dtype == torch.long and inp.shape == (2, 4)
    assert torch.equal(tgt, inp + 1)
    perm = np.random.default_rng([5, 0]).permutation(50)
    # rank 0 takes offsets [0, 2) of micro-step 0 and [(1*2 + 0)*2, +2) = [4, 6) of micro-step 1
    assert _ids(batch) == [*perm[0:2], *perm[4:6]]
    assert batch.tokens == 16


def test_ranks_are_disjoint_and_cover_the_global_batch(make_shards) -> None:
    path = make_shards(401, 128)
    loaders = [_loader(path, dp_rank=r, dp_world=3) for r in range(3)]
    for _ in range(4):
        per_rank = [_ids(ld.next_batch()) for ld in loaders]
        flat = [i for ids in per_rank for i in ids]
        assert len(set(flat)) == len(flat) == loaders[0].global_batch_size
        index = loaders[0].next_index - 1
        assert sorted(flat) == sorted(loaders[0].global_sample_ids(index).tolist())


def test_same_seed_same_batches_other_seed_differs(make_shards) -> None:
    path = make_shards(401, 128)

    def first_five(loader: ResumableLoader) -> list[list[int]]:
        return [_ids(loader.next_batch()) for _ in range(5)]

    a, b = first_five(_loader(path)), first_five(_loader(path))
    assert a == b and a != first_five(_loader(path, seed=6))


def test_resume_from_state_dict_is_exact(make_shards) -> None:
    path = make_shards(401, 128)
    straight = _loader(path)
    expected = [straight.next_batch() for _ in range(9)]
    first = _loader(path)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # plain data survives serialisation
    assert state == {"next_index": 4}
    resumed = _loader(path)
    resumed.load_state_dict(state)
    for want in expected[4:]:
        got = resumed.next_batch()
        assert got.index == want.index
        for (gi, gt), (wi, wt) in zip(got.micro_batches, want.micro_batches):
            assert torch.equal(gi, wi) and torch.equal(gt, wt)
    with pytest.raises(ValueError, match="exactly 'next_index'"):
        resumed.load_state_dict({"next_index": 1, "epoch": 0})


def test_skip_windows_skip_exactly_those_indices(make_shards) -> None:
    path = make_shards(401, 128)
    loader = _loader(path, skip_windows=[(2, 4), (3, 6)])  # overlapping: skips 2..5
    indices = [loader.next_batch().index for _ in range(3)]
    assert indices == [0, 1, 6]
    loader.add_skip_window(7, 9)
    assert [loader.next_batch().index for _ in range(2)] == [9, 10]
    plain = _loader(path)
    plain.load_state_dict({"next_index": 9})
    assert _ids(plain.next_batch()) == _ids(_loader(path, skip_windows=[(0, 9)]).next_batch())
    with pytest.raises(ValueError):
        loader.add_skip_window(5, 5)


def test_batches_cross_epochs_in_permutation_order(make_shards) -> None:
    loader = _loader(make_shards(4 * 21 + 1, 32), dp_world=1, grad_accum_steps=1,
                     micro_batch_size=5)  # 21 samples, G = 5: batch 4 spans epochs 0 and 1
    seen = [loader.global_sample_ids(b) for b in range(13)]  # 65 positions, 4 epochs
    order = np.concatenate(seen)
    perms = np.concatenate([np.random.default_rng([5, e]).permutation(21) for e in range(4)])
    assert np.array_equal(order, perms[:65])
    assert sorted(order[21:42].tolist()) == list(range(21))  # epoch 1 visits each once
    assert loader.epoch_of(4) == 0 and loader.epoch_of(5) == 1
    assert _ids(loader.next_batch()) == perms[:5].tolist()


def test_too_small_dataset_is_a_clear_error(make_shards) -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _loader(make_shards(30, 16))  # 7 samples < G = 8


def test_ensure_dataset_prepares_reuses_and_checks(corpus: Path, tmp_path: Path) -> None:
    cfg = DataConfig(path=str(tmp_path / "ds"), prepare_from=[str(corpus / "*")])
    path = ensure_dataset(cfg)
    assert path == str(tmp_path / "ds") and read_index(path)["documents"] == 5
    assert ensure_dataset(cfg) == path
    index_file = tmp_path / "ds" / "index.json"
    index = json.loads(index_file.read_text())
    index["tokenizer"]["vocab_size"] = 1000
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="prepared with tokenizer"):
        ensure_dataset(cfg)
    with pytest.raises(FileNotFoundError, match="prepare_from is null"):
        ensure_dataset(DataConfig(path=str(tmp_path / "none"), prepare_from=None))
