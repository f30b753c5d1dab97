"""How fast a memory-tier copy is verified: blake3 (``trainer.checkpoint.memory_slots.
digest_of``'s hash, all cores) over a shared-memory file of a rank's copy's size.

An in-place recovery's restore waits for the replacement's digest of its copy (6.8 GB per
rank of the 1.14B model); on 2 x H200 it was done 1.3-5.4 s after the takeover. This
separates the hash from the mapping's page faults and from a second digest running at the
same time (the survivor's):

    fresh       a new mapping of the file, digested (what ``DigestAhead`` does)
    faulted     the same mapping again (its pages already mapped)
    two         two processes, each a fresh mapping of its own file, at once

    python bench/recovery/digest_speed.py --gb 6.8 --repeat 2 --out F
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import mmap
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import blake3

CHUNK = 64 << 20


def _make(path: str, nbytes: int) -> None:
    block = os.urandom(CHUNK)
    with open(path, "wb") as f:
        f.writelines(block[: min(CHUNK, nbytes - off)] for off in range(0, nbytes, CHUNK))


def _digest(buf: mmap.mmap) -> float:
    t0 = time.perf_counter()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(memoryview(buf))
    h.hexdigest()
    return time.perf_counter() - t0


def _fresh(path: str, out=None) -> tuple[float, float]:
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        first = _digest(buf)
        again = _digest(buf)
        buf.close()
    finally:
        os.close(fd)
    if out is not None:
        out.put(first)
    return first, again


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=6.8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nbytes = int(args.gb * (1 << 30))
    paths = [str(Path(args.dir) / f"digest-speed-{i}") for i in range(2)]
    for p in paths:
        _make(p, nbytes)
    runs = []
    try:
        for _ in range(args.repeat):
            first, again = _fresh(paths[0])
            ctx = mp.get_context("spawn")  # blake3's thread pool does not survive a fork
            q = ctx.Queue()
            procs = [ctx.Process(target=_fresh, args=(p, q)) for p in paths]
            t0 = time.perf_counter()
            for pr in procs:
                pr.start()
            both = [q.get() for _ in procs]
            wall = time.perf_counter() - t0
            for pr in procs:
                pr.join()
            r = {"fresh_s": round(first, 3), "faulted_s": round(again, 3),
                 "two_at_once_s": [round(x, 3) for x in both], "two_wall_s": round(wall, 3),
                 "fresh_gb_per_s": round(args.gb / first, 2)}
            print(json.dumps(r), flush=True)
            runs.append(r)
    finally:
        for p in paths:
            Path(p).unlink(missing_ok=True)
    result = {"script": "bench/recovery/digest_speed.py",
              "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
              "commit": os.environ.get("ORCH_BENCH_COMMIT", "unknown"),
              "device": args.device or "unknown", "cpus": os.cpu_count(),
              "blake3": blake3.__version__, "gb": args.gb, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
