"""How fast a memory-tier copy is verified: blake3 (``trainer.checkpoint.memory_slots.
digest_of``'s hash, all cores) over a shared-memory file of a rank's copy's size.

An in-place recovery's restore waits for the replacement's digest of its copy (6.8 GB per
rank of the 1.14B model); on 2 x H200 it was done 1.3-5.4 s after the takeover. This
separates the hash from the mapping's page faults and from a second digest running at the
same time (the survivor's):

    fresh       a new mapping of the file, digested (what ``DigestAhead`` does)
    faulted     the same mapping again (its pages already mapped)
    two         two processes, each a fresh mapping of its own file, at once
    beside_busy the same bytes hashed per tensor (``--segments`` updates, as the digest
                was) and in ``digest_of``'s 1 GiB pieces, alone and beside a Python thread
                that never sleeps (a training thread): each update returns to the GIL

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


def _pieces(buf: mmap.mmap, count: int) -> float:
    t0 = time.perf_counter()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    view, step = memoryview(buf), -(-len(buf) // count)
    for start in range(0, len(buf), step):
        h.update(view[start:start + step])
    h.hexdigest()
    return time.perf_counter() - t0


def _beside_busy(path: str, segments: int) -> dict[str, float]:
    """Per tensor and in pieces, alone and beside a busy Python thread."""
    import threading

    fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    pieces = -(-len(buf) // (1 << 30))
    out = {"per_tensor_alone_s": _pieces(buf, segments), "pieces_alone_s": _pieces(buf, pieces)}
    stop = threading.Event()

    def busy() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        out["per_tensor_beside_busy_s"] = _pieces(buf, segments)
        out["pieces_beside_busy_s"] = _pieces(buf, pieces)
    finally:
        stop.set()
        t.join()
        buf.close()
        os.close(fd)
    return {k: round(v, 3) for k, v in out.items()}


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
    ap.add_argument("--segments", type=int, default=700,
                    help="updates of the per-tensor digest (the 1.14B model's copy: ~700)")
    ap.add_argument("--only-busy", action="store_true", help="only the beside_busy part")
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
            if args.only_busy:
                r = {"beside_busy": _beside_busy(paths[0], args.segments)}
                print(json.dumps(r), flush=True)
                runs.append(r)
                continue
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
                 "fresh_gb_per_s": round(args.gb / first, 2),
                 "beside_busy": _beside_busy(paths[0], args.segments)}
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
