"""The Arrow source: reading IPC files and save_to_disk directories without copies, online
packing, the per-rank order, exact resume at any token, and bad states refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.data.arrow import ArrowLoader, ArrowTexts, source_files
from trainer.tokenizer import ByteTokenizer

DOCS = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(60)]
TOK = ByteTokenizer()


def write_ipc(path: Path, texts: list[str | None], stream: bool = False,
              batch_rows: int = 16) -> Path:
    table = pa.table({"text": pa.array(texts, pa.string()), "id": list(range(len(texts)))})
    with pa.OSFile(str(path), "wb") as sink:
        opener = pa.ipc.new_stream if stream else pa.ipc.new_file
        with opener(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    return path


@pytest.fixture
def arrow_file(tmp_path: Path) -> Path:
    return write_ipc(tmp_path / "docs.arrow", DOCS)


def stream_of(rows: list[int]) -> np.ndarray:
    return np.concatenate([np.append(TOK.encode_array(DOCS[r]), TOK.eos_id) for r in rows])


def test_file_stream_and_datasets_directory_read_the_same_rows(tmp_path: Path,
                                                               arrow_file: Path) -> None:
    import datasets

    write_ipc(tmp_path / "stream.arrow", DOCS, stream=True)
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"),
                                                           max_shard_size="2KB")
    saved = ArrowTexts(str(tmp_path / "saved"))
    assert len(saved.files) > 1  # several shards, read in state.json's order
    for texts in (ArrowTexts(str(arrow_file)), ArrowTexts(str(tmp_path / "stream.arrow")),
                  saved):
        assert texts.rows == len(DOCS)
        assert [texts.text(i) for i in range(texts.rows)] == DOCS


def test_local_files_are_memory_mapped_not_copied(tmp_path: Path) -> None:
    big = write_ipc(tmp_path / "big.arrow", ["x" * 4000] * 2000)  # 8 MB of text
    before = pa.total_allocated_bytes()
    texts = ArrowTexts(str(big))
    assert texts.rows == 2000 and texts.text(1999) == "x" * 4000
    # The column's buffers are the file's mapped pages: Arrow's allocator holds none of it.
    assert pa.total_allocated_bytes() - before < big.stat().st_size // 100


def test_bad_sources_are_refused(tmp_path: Path) -> None:
    table = pa.table({"body": ["a"], "n": [1]})
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ValueError, match="no column 'text'"):
        ArrowTexts(str(tmp_path / "t.arrow"))
    with pytest.raises(ValueError, match="column 'n' is int64, not a string"):
        ArrowTexts(str(tmp_path / "t.arrow"), column="n")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no Arrow files"):
        source_files(str(tmp_path / "empty"))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(ValueError, match="DatasetDict"):
        source_files(str(tmp_path / "dd"))
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "state.json").write_text('{"_data_files": [{"filename": "../x"}]}')
    with pytest.raises(ValueError, match="bad file name"):
        source_files(str(tmp_path / "evil"))


def test_samples_pack_the_ranks_rows_and_each_epoch_covers_every_row_once(
        arrow_file: Path) -> None:
    texts = ArrowTexts(str(arrow_file))
    seen: list[int] = []
    for rank in range(3):
        loader = ArrowLoader(texts, TOK, seq_len=16, micro_batch_size=2, dp_rank=rank,
                             dp_world=3, seed=5)
        rows = [int(r) for r in loader._rank_rows(0)]
        seen += rows
        expected = stream_of(rows)
        got = []
        for _ in range(4):
            batch = loader.next_batch()
            for inputs, targets in batch.micro_batches:
                assert inputs.shape == targets.shape == (2, 16)
                assert (inputs[:, 1:] == targets[:, :-1]).all()
                got += [row.numpy() for row in inputs]
        # Sample k is stream[16k : 16k + 17]: documents packed, EOS between them.
        for k, row in enumerate(got):
            np.testing.assert_array_equal(row, expected[16 * k:16 * k + 16])
    assert sorted(seen) == list(range(len(DOCS)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq_len=st.integers(1, 40), mbs=st.integers(1, 3), accum=st.integers(1, 2),
       world=st.integers(1, 3), data=st.data())
def test_resume_at_any_batch_reads_exactly_what_follows(arrow_file: Path, seq_len: int,
                                                         mbs: int, accum: int, world: int,
                                                         data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, world - 1))
    before = data.draw(st.integers(0, 30))  # up to several epochs of the small rows
    windows = data.draw(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), max_size=2))
    windows = [(s, s + n) for s, n in windows]
    texts = ArrowTexts(str(arrow_file))

    def make() -> ArrowLoader:
        return ArrowLoader(texts, TOK, seq_len, mbs, accum, dp_rank=rank, dp_world=world,
                           seed=11, skip_windows=windows)

    straight = make()
    for _ in range(before):
        straight.next_batch()
    state = straight.state_dict()
    resumed = make()
    resumed.load_state_dict(dict(state))
    assert resumed.state_dict() == state
    for _ in range(3):
        a, b = straight.next_batch(), resumed.next_batch()
        assert a.index == b.index and not any(s <= a.index < e for s, e in windows)
        for (xa, ya), (xb, yb) in zip(a.micro_batches, b.micro_batches, strict=True):
            assert xa.equal(xb) and ya.equal(yb)
    COUNTS["resume"] += 1


COUNTS = {"resume": 0, "bad_state": 0}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=st.dictionaries(
    st.sampled_from(["epoch", "cursor", "offset", "next_index", "dp_world", "extra"]),
    st.one_of(st.integers(-5, 10**6), st.text(max_size=3), st.none()), max_size=6))
def test_bad_loader_states_raise_value_errors_only(arrow_file: Path, state: dict) -> None:
    loader = ArrowLoader(ArrowTexts(str(arrow_file)), TOK, 8, 2, dp_rank=0, dp_world=2)
    try:
        loader.load_state_dict(state)
    except (ValueError, TypeError):
        COUNTS["bad_state"] += 1
        return
    # Accepted: the position is inside this rank's stream and a batch can be read from it.
    assert loader.state_dict() == {k: int(v) for k, v in state.items()}
    loader.next_batch()


def test_fuzz_case_counts() -> None:
    # Run after the two property tests in this module (pytest keeps file order).
    print(f"arrow fuzz cases: {COUNTS}")
    assert COUNTS["resume"] >= 50 and COUNTS["bad_state"] >= 100


def test_world_size_change_is_refused(arrow_file: Path) -> None:
    texts = ArrowTexts(str(arrow_file))
    a = ArrowLoader(texts, TOK, 8, 2, dp_rank=0, dp_world=2)
    a.next_batch()
    b = ArrowLoader(texts, TOK, 8, 2, dp_rank=0, dp_world=3)
    with pytest.raises(ValueError, match="saved by 2 data-parallel ranks, this run has 3"):
        b.load_state_dict(a.state_dict())


def test_s3_source_reads_the_same_rows(tmp_path: Path, arrow_file: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec
    from s3 import aws_env, s3_endpoint

    with s3_endpoint(bucket="data") as ep:
        for k, v in aws_env(ep.url).items():
            monkeypatch.setenv(k, v)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.put(str(arrow_file), "data/corpus/part-0.arrow")
        write_ipc(tmp_path / "part-1.arrow", ["tail one", None])
        fs.put(str(tmp_path / "part-1.arrow"), "data/corpus/part-1.arrow")
        texts = ArrowTexts("s3://data/corpus")
        assert texts.files == ["s3://data/corpus/part-0.arrow", "s3://data/corpus/part-1.arrow"]
        assert [texts.text(i) for i in range(texts.rows)] == DOCS + ["tail one", ""]
