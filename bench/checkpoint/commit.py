"""Commit time of a checkpoint, before and after signing: what rank 0's commit thread does
once DCP has written the files (``layout.build_manifest`` + ``write_manifest``), with the
format-1 XXH3-64 manifest against the signed BLAKE3 one.

The 13.65 GB state of the 1.14B model (bench/results/gpu-checkpoint-h100.json) would fill a
quarter of this machine's disk and more than half its memory, so the commit is measured on
a smaller state of the same shape and scaled by bytes: ``--gib`` (default 2) split like one
rank's DCP save with 4 writer threads (4 equal ``.distcp`` files and a ``.metadata``),
written once into ``/dev/shm`` (memory: what a commit reads from the page cache right after
DCP's writes, without this machine's shared disk in the way). Each commit is timed in wall
seconds and in CPU seconds (``time.process_time``: every thread of the process, so BLAKE3's
own threads count). The machine is shared with other sessions, so wall time swings with
their load; CPU seconds are the cost that does not (the load average is recorded). The
best of ``--rounds`` is taken. Scaling is linear in bytes: both digests stream at a fixed
rate per byte.

    python bench/checkpoint/commit.py [--gib 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.common
from bench.common import RESULTS, header  # noqa: E402

STATE_BYTES = 13_654_085_248  # the 1.14B model's state (gpu-checkpoint-h100.json)


def _write_state(step_dir: Path, total: int) -> None:
    step_dir.mkdir(parents=True)
    block = os.urandom(64 * 2**20)
    per_file = total // 4
    for i in range(4):
        with open(step_dir / f"__0_{i}.distcp", "wb") as f:
            left = per_file
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    (step_dir / ".metadata").write_bytes(os.urandom(200_000))


def _commit(step_dir: Path, algorithm: str, key: bytes | None) -> tuple[float, float]:
    """(wall s, CPU s) of one commit."""
    from trainer.checkpoint import layout

    t0, c0 = time.perf_counter(), time.process_time()
    manifest = layout.build_manifest(str(step_dir), key=key, algorithm=algorithm, step=1,
                                     tokens=0)
    layout.write_manifest(str(step_dir), manifest)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="Where to write the state, removed after (default: /dev/shm).")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    total = int(args.gib * 2**30)
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="commit-bench-"))
    try:
        step = base / "job" / "step-00000001"
        _write_state(step, total)
        size = sum(p.stat().st_size for p in step.iterdir())
        key = os.urandom(32)
        variants = {"before: xxh3_64, unsigned (format 1)": ("xxh3_64", None),
                    "after: blake3 + HMAC-SHA256 signature (format 2)": ("blake3", key),
                    "alternative: sha256 + signature": ("sha256", key)}
        _commit(step, "xxh3_64", None)  # warm the page cache
        results = {}
        for name, (algorithm, k) in variants.items():
            runs = [_commit(step, algorithm, k) for _ in range(args.rounds)]
            wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
            scale = STATE_BYTES / size
            results[name] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                             "wall_gb_s": round(size / wall / 1e9, 3),
                             "cpu_s_per_gb": round(cpu / (size / 1e9), 3),
                             "wall_s_for_13_65_gb": round(wall * scale, 2),
                             "cpu_s_for_13_65_gb": round(cpu * scale, 2)}
            print(f"{name:48s} {wall:6.2f} s wall, {cpu:6.2f} s CPU for {size / 1e9:.2f} GB "
                  f"-> 13.65 GB: {wall * scale:6.2f} s wall, {cpu * scale:6.2f} s CPU",
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc = {"bench": "commit", **header(), "state_bytes_measured": size,
           "state_bytes_scaled_to": STATE_BYTES, "rounds": args.rounds,
           "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
           "layout": "4 .distcp files + .metadata (one rank, 4 writer threads) in "
                     f"{args.dir or 'a temporary directory'}",
           "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "commit-cpu.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
