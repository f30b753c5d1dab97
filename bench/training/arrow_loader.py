"""Tokens/s of the Arrow loader (online tokenize + pack) against the prepared-shards loader.

The same text, the standard library's own source (one row per file, up to ``--mbytes``), is
written once as an Arrow IPC file (pyarrow) and once as prepared token shards
(``trainer.data.prepare``); both loaders then hand out ``--batches`` global batches of
``--mbs`` x ``--seq`` tokens to one rank, one thread. The ratio of the two rates, measured in
one run, is what online tokenization costs against reading prepared tokens. Two tokenizers:
the byte tokenizer, and a byte-level BPE of ``--bpe-vocab`` ids trained here on the same text
with the ``tokenizers`` library (a stand-in for a Llama tokenizer.json: nothing is downloaded).

    python bench/training/arrow_loader.py        # writes bench/results/arrow-loader-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rate(loader, batches: int) -> float:
    loader.next_batch()  # first batch: maps, permutations
    t0 = time.perf_counter()
    tokens = sum(loader.next_batch().tokens for _ in range(batches))
    return tokens / (time.perf_counter() - t0)


def train_bpe(files: list[Path], out: Path, vocab: int):
    """A byte-level BPE trained on ``files`` with </s> as EOS, loaded as the trainer loads
    any tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from trainer.tokenizer import load_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out))
    return load_tokenizer(str(out))


def main() -> int:
    import pyarrow as pa
    import torch

    from bench.common import header, write
    from trainer.data.arrow import ArrowLoader, ArrowTexts
    from trainer.data.dataset import ResumableLoader, TokenShards
    from trainer.data.prepare import prepare_dataset, stdlib_sources
    from trainer.tokenizer import ByteTokenizer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mbytes", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--mbs", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    a = parser.parse_args()
    torch.set_num_threads(1)
    files = stdlib_sources(a.mbytes << 20)
    with tempfile.TemporaryDirectory() as tmp:
        table = pa.table({"text": [f.read_text(errors="replace") for f in files]})
        arrow = Path(tmp) / "stdlib.arrow"
        with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table, max_chunksize=256)
        prepare_dataset([str(f) for f in files], Path(tmp) / "shards", "byte",
                        max_bytes=a.mbytes << 20)
        t0 = time.perf_counter()
        texts = ArrowTexts(str(arrow))
        open_s = time.perf_counter() - t0
        arrow_rate = rate(ArrowLoader(texts, ByteTokenizer(), a.seq, a.mbs), a.batches)
        shards_rate = rate(ResumableLoader(TokenShards(Path(tmp) / "shards"), a.seq, a.mbs),
                           a.batches)
        bpe = train_bpe(files, Path(tmp) / "tokenizer.json", a.bpe_vocab)
        bpe_rate = rate(ArrowLoader(texts, bpe, a.seq, a.mbs), max(1, a.batches // 10))
    report = {**header(), "text": f"{len(files)} stdlib files, {table.nbytes} bytes of text",
              "tokenizer": "byte", "batch": f"{a.mbs} x {a.seq} tokens, one rank, 1 thread",
              "batches_timed": a.batches, "arrow_open_s": round(open_s, 4),
              "arrow_tokens_per_s": round(arrow_rate), "shards_tokens_per_s": round(shards_rate),
              "arrow_vs_shards": round(arrow_rate / shards_rate, 3),
              "arrow_bpe_tokens_per_s": round(bpe_rate), "bpe_vocab": a.bpe_vocab,
              "bpe_batches_timed": max(1, a.batches // 10)}
    print(report)
    print(write("arrow-loader-cpu.json", report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
