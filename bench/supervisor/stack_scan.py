"""How long a hang's stack-file scan holds the supervisor's loop: on the loop, or in a thread.

At 2,048 x 8 a hang's stop waits for 16,384 stack files; each look lists the folder and
stats every name not yet seen written, every 0.25 s for up to ``stack_dump_wait_s``. Here a
folder of N files is scanned the way the supervisor did before (on the loop, pathlib, a
yield every 1,024 stats) and the way it does now (``written_since`` in a thread), while a
ticker on the loop wakes every millisecond; a tick asleep across a scan records how late it
woke: the loop's lateness is what a heartbeat waits. The files appear in batches, written by
another process (as ranks dump), so the scan runs several looks. Both are alternated
``--repeats`` times in one run.

    python bench/supervisor/stack_scan.py --files 16384 --out stack-scan-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.supervisor.generation.parts import written_since

_CHUNK = 1024
_WRITER = ("import sys\nfrom pathlib import Path\nd = Path(sys.argv[1])\n"
           "for r in range(int(sys.argv[2]), int(sys.argv[3])):\n"
           "    (d / f'gen0002-rank{r:05d}.txt').write_text('Thread 0x1\\n')\n")


async def _before(folder: Path, done: set[str]) -> None:
    """The scan as it was (generation.py before this bench): on the loop."""
    try:
        names = set(os.listdir(folder))
    except OSError:
        names = set()
    for i, name in enumerate(names - done):
        try:
            if (folder / name).stat().st_size > 0:
                done.add(name)
        except OSError:
            pass
        if i % _CHUNK == _CHUNK - 1:
            await asyncio.sleep(0)


async def _after(folder: Path, done: set[str]) -> None:
    done |= await asyncio.to_thread(written_since, str(folder), frozenset(done))


async def one(kind: str, files: int, batches: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="stack-scan-"))
    ticks: list[tuple[float, float]] = []  # (asleep at, woke at)
    scans: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            ticks.append((t, time.perf_counter()))

    scan = _before if kind == "before" else _after
    done: set[str] = set()
    task = asyncio.create_task(ticker())
    cpu0, t0 = time.thread_time(), time.perf_counter()
    loop_cpu = 0.0
    per = files // batches
    try:
        for b in range(batches):
            # A batch of ranks dumps, written by another process as the agents do (the
            # loop keeps turning meanwhile; only the scan's lateness is recorded).
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _WRITER, str(folder), str(b * per), str((b + 1) * per))
            await proc.wait()
            c, s0 = time.thread_time(), time.perf_counter()
            await scan(folder, done)
            scans.append((s0, time.perf_counter()))
            loop_cpu += time.thread_time() - c  # the loop thread's own CPU in the scan
            await asyncio.sleep(0.01)
        found = [os.path.join(str(folder), f"gen0002-rank{r:05d}.txt")
                 for r in range(per * batches)
                 if f"gen0002-rank{r:05d}.txt" in done]
    finally:
        stop.set()
        await task
        shutil.rmtree(folder, ignore_errors=True)
    assert len(found) == per * batches, (kind, len(found))
    # A tick that was asleep across any part of a scan: how late it woke.
    lates = sorted(max(0.0, b - a - 0.001) for a, b in ticks
                   if any(a < e and b > s for s, e in scans))
    return {"scan": kind, "files": per * batches, "looks": batches,
            "loop_thread_cpu_s": round(loop_cpu, 3),
            "wall_s": round(time.perf_counter() - t0, 3),
            "ticks_across_a_scan": len(lates),
            "ticker_late_max_ms": round(lates[-1] * 1e3, 1) if lates else None,
            "ticker_late_p99_ms": round(lates[int(len(lates) * 0.99)] * 1e3, 2) if lates
            else None,
            "main_thread_cpu_s": round(time.thread_time() - cpu0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=16384)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = []
    for _ in range(args.repeats):
        for kind in ("before", "after"):
            runs.append(asyncio.run(one(kind, args.files, args.batches)))
            print(json.dumps(runs[-1]), flush=True)
    median = {k: {m: statistics.median(r[m] for r in runs if r["scan"] == k)
                  for m in ("loop_thread_cpu_s", "ticker_late_max_ms", "ticker_late_p99_ms")}
              for k in ("before", "after")}
    report = {"what": f"a hang's stack-file scan, {args.files} files in {args.batches} "
              "batches, on the loop (before) or in a thread (after), alternated",
              "load_avg_1m": os.getloadavg()[0], "median": median, "runs": runs}
    print(json.dumps(median, indent=1))
    if args.out:
        from common import header, write

        print(write(args.out, {**header(args.device), **report}))


if __name__ == "__main__":
    main()
