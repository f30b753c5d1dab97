"""Checksum throughput for checkpoint manifests: which algorithm to digest files with.

Since manifests are signed, the digest must be cryptographic (a signature over an XXH3 value
vouches for nothing: XXH3 collisions are cheap). BLAKE3 and SHA-256 are measured against
XXH3-64, the format-1 checksum; BLAKE3 once on one thread and once with its own threads
(``max_threads=AUTO``), which is how ``layout`` runs it on a mapped file.

Hashes one buffer in the 8 MiB chunks ``layout`` reads files in, best of several rounds
(the machine is shared, so the best round is the least disturbed one), on one thread and on
two (an algorithm whose binding releases the GIL verifies several files at once), then end
to end through ``trainer.checkpoint.layout`` on a file in the page cache. Writes one JSON
file under bench/results/ with the device, the commit and the date.

    python bench/checkpoint/checksum.py [--mib 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import blake3
import xxhash
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, header  # noqa: E402

CHUNK = 8 * 2**20


def _algorithms() -> dict[str, Callable[[list[memoryview]], object]]:
    def crc32(chunks):
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        return crc

    def streaming(factory):
        def run(chunks):
            h = factory()
            for c in chunks:
                h.update(c)
            return h.digest()
        return run

    algos = {"zlib.crc32": crc32, "sha256": streaming(hashlib.sha256),
             "blake3": streaming(blake3.blake3),
             "blake3.auto_threads": streaming(
                 lambda: blake3.blake3(max_threads=blake3.blake3.AUTO)),
             "blake2b": streaming(hashlib.blake2b), "xxhash.xxh3_64": streaming(xxhash.xxh3_64),
             "xxhash.xxh3_128": streaming(xxhash.xxh3_128),
             "xxhash.xxh64": streaming(xxhash.xxh64)}
    try:  # an optional candidate, not a dependency
        import google_crc32c

        def crc32c(chunks):
            crc = 0
            for c in chunks:
                crc = google_crc32c.extend(crc, c)
            return crc
        algos["google_crc32c"] = crc32c
    except ImportError:
        pass
    return algos


def _best(fn: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="Buffer size per thread.")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    size = args.mib * 2**20
    data = [os.urandom(size), os.urandom(size)]
    # bytes chunks (not memoryviews): google_crc32c accepts only read-only bytes.
    views = [[d[i:i + CHUNK] for i in range(0, size, CHUNK)] for d in data]
    results = {}
    pool = concurrent.futures.ThreadPoolExecutor(2)
    for name, fn in _algorithms().items():
        one = _best(lambda fn=fn: fn(views[0]), args.rounds)
        two = _best(lambda fn=fn: list(pool.map(fn, views)), args.rounds)
        results[name] = {"gb_s_1_thread": round(size / one / 1e9, 3),
                         "gb_s_2_threads": round(2 * size / two / 1e9, 3)}
        print(f"{name:18s} {results[name]['gb_s_1_thread']:7.2f} GB/s  "
              f"{results[name]['gb_s_2_threads']:7.2f} GB/s on 2 threads", flush=True)
    pool.shutdown()
    files = _through_layout(data[0], args.rounds)
    doc = {"bench": "checksum", **header(),
           "buffer_mib": args.mib, "chunk_mib": CHUNK // 2**20, "rounds": args.rounds,
           "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
           "results": results,
           "file_end_to_end_gb_s": files,
           "chosen": "blake3",
           "why": "cryptographic, so a signed manifest vouches for the bytes; faster than "
                  "SHA-256 on one thread and scales with cores (its own threads), where "
                  "SHA-256 stays one core per file"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"checksum-{doc['date'][:16].replace('-', '').replace(':', '')}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def _through_layout(data: bytes, rounds: int) -> dict[str, float]:
    """GB/s of ``layout.file_digest`` on a file in the page cache: reading included, as a
    manifest build or a verification sees it."""
    import tempfile

    import fsspec

    from trainer.checkpoint import layout

    fs = fsspec.filesystem("file")
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        out = {}
        for name in layout.DIGESTS:
            secs = _best(lambda name=name: layout.file_digest(fs, f.name, name), rounds)
            out[name] = round(len(data) / secs / 1e9, 3)
            print(f"file via layout {name:9s} {out[name]:7.2f} GB/s", flush=True)
    return out


if __name__ == "__main__":
    main()
