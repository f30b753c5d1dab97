"""Where a job's ranks spend a recovery, by native stack: py-spy on every rank and standby.

Started beside a bench (``recovery.py``), it attaches ``py-spy record --native --idle
--threads --format raw`` to every process whose command line runs ``-m trainer`` or a warm
standby (``orchestrator.worker.warm``) as it appears, for up to ``--duration`` seconds each,
and writes ``DIR/spy-<pid>.txt`` (collapsed stacks: thread, frames root first, sample count)
and ``DIR/spied.json`` (each pid's command line and when sampling began). py-spy pauses the
process for each sample (native frames need it), so a sampled run is slower: its timings are
for diagnosis, not for a result.

``--summarize DIR --frame REGEX`` then prints, over every file, the samples of the stacks
holding a frame that matches REGEX, grouped by the frames from that one to the innermost
(``--depth`` of them): where, say, the survivor's ``ncclCommAbort`` waits.

Usage::

    python bench/recovery/spy_ranks.py --dir spy --for 300 &
    python bench/recovery/recovery.py --profile gpu2 --paths in_job --out r.json
    python bench/recovery/spy_ranks.py --summarize spy --frame ncclCommAbort
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

WATCHED = re.compile(r"(?:^|\s)-m\s+(?:trainer|orchestrator\.worker\.warm)(?:\s|$)")
# A collapsed stack's line: "thread (TID): NAME;frame;frame;... COUNT".
LINE = re.compile(r"^(?P<thread>thread \(\d+\): [^;]*);(?P<frames>.*) (?P<count>\d+)$")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""


def _watched_pids() -> dict[int, str]:
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            cmd = _cmdline(int(entry.name))
            if WATCHED.search(cmd):
                found[int(entry.name)] = cmd
    return found


def watch(out: Path, total_s: float, duration_s: float, rate: int, spy: str) -> int:
    """Attach py-spy to each watched process as it appears, for ``total_s`` seconds."""
    out.mkdir(parents=True, exist_ok=True)
    spied: dict[int, dict] = {}
    procs: list[subprocess.Popen] = []
    end = time.monotonic() + total_s
    try:
        while time.monotonic() < end:
            for pid, cmd in _watched_pids().items():
                if pid in spied:
                    continue
                spied[pid] = {"cmd": cmd[:300], "start": time.time()}
                with open(out / f"spy-{pid}.log", "w") as errors:
                    procs.append(subprocess.Popen(
                        [spy, "record", "--native", "--idle", "--threads", "--rate", str(rate),
                         "--format", "raw", "--duration", str(int(duration_s)),
                         "--pid", str(pid), "-o", str(out / f"spy-{pid}.txt")],
                        stdout=subprocess.DEVNULL, stderr=errors))
                (out / "spied.json").write_text(json.dumps(spied, indent=1))
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(2)  # py-spy writes what it has on SIGINT
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    print(f"sampled {len(spied)} processes into {out}")
    return 0


def summarize(folder: Path, frame: str, depth: int, top: int) -> dict[str, int]:
    """Samples of the stacks holding a frame matching ``frame``, keyed by that frame and the
    ``depth`` frames after it toward the innermost (`` <- `` between them), over every file."""
    pattern = re.compile(frame)
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(folder.glob("spy-*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m is None:
                continue
            frames = m["frames"].split(";")
            at = next((i for i, f in enumerate(frames) if pattern.search(f)), None)
            if at is None:
                continue
            chain = [re.sub(r" \([^)]*\)$", "", f) for f in frames[at:at + depth + 1]]
            counts[f"{path.stem} {m['thread'].split(': ', 1)[-1]}: " + " -> ".join(chain)] \
                += int(m["count"])
    return dict(counts.most_common(top))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("spy"))
    ap.add_argument("--for", dest="total_s", type=float, default=300.0,
                    help="seconds to watch for new processes")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds per process")
    ap.add_argument("--rate", type=int, default=50, help="samples a second")
    ap.add_argument("--summarize", type=Path, default=None, metavar="DIR")
    ap.add_argument("--frame", default="ncclCommAbort")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if args.summarize is not None:
        for key, n in summarize(args.summarize, args.frame, args.depth, args.top).items():
            print(f"{n:6d}  {key}")
        return 0
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return watch(args.dir, args.total_s, args.duration, args.rate, spy)


if __name__ == "__main__":
    sys.exit(main())
