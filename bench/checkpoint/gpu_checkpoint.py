"""Checkpoint stall on one GPU: the 1.14B model's full state (weights + AdamW moments, fp32),
saved with our Checkpointer (DCP async_save, pinned staging buffers reused across saves,
manifest with checksums committed by rank 0 in the background).

Reports the blocking time of each save, the total time to a committed checkpoint, the bytes
written, and the step time of steps that overlap a background write against steps that do
not (same run). With ``--stage-ahead on`` (the trainer's default) the staging buffers are
allocated in the background after the first step, as the training loop does, so the first
save's blocking time compares with the later ones'; ``off`` allocates them at the first
save instead.

    python bench/checkpoint/gpu_checkpoint.py --out bench/results/gpu-checkpoint-h100.json
    python bench/checkpoint/gpu_checkpoint.py --device cpu --preset 125m --seq 256 --mbs 2 \
        --stage-ahead off --out save-blocking-cpu-off.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.training import gpu_train  # noqa: E402
from bench.common import header, write  # noqa: E402


class RecordingWorker:
    """The SDK surface, keeping the events the checkpointer reports."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, dict[str, Any]]] = []

    def step_done(self, step: int, **_: Any) -> None:
        return None

    @contextlib.contextmanager
    def phase(self, name: str):
        yield

    def event(self, name: str, **data: Any) -> None:
        self.events.append((time.perf_counter(), name, data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=os.path.expanduser(
        "~/.cache/orchestrator/datasets/stdlib-byte"))
    ap.add_argument("--dir", default="/tmp/bench-ckpt")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=10, help="steps between saves")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--stage-ahead", choices=("on", "off"), default="on",
                    help="allocate the staging buffers in the background after step 1")
    ap.add_argument("--out", default="gpu-checkpoint.json")
    args = ap.parse_args()
    gpu_train.DEVICE = args.device
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512"), ("RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.store import open_store
    from trainer.config import CheckpointConfig
    from trainer.data.prepare import prepare_dataset
    from trainer.loop import train_step

    prepare_dataset("stdlib", args.data, "byte", max_bytes=64 * 2**20)
    shutil.rmtree(args.dir, ignore_errors=True)
    parts = gpu_train.build(False, "fsdp2", args.mbs, args.seq, "none", args.data, args.preset)
    recorder = RecordingWorker()
    cfg = CheckpointConfig(interval_steps=args.every, keep_last=2,
                           stage_ahead=args.stage_ahead == "on")
    ckpt = Checkpointer(cfg, open_store(cfg, "bench", args.dir), rank=0, world_size=1,
                        group=parts.dctx.ckpt_group, meta={"job": "bench"},
                        report=recorder.event, log=print, device_type=args.device)
    for i in range(3):  # warm-up
        train_step(parts)
        if i == 0:  # as the training loop does after a generation's first step
            ckpt.prepare_staging(parts.checkpoint_state)
    saves, quiet, overlapping = [], [], []

    def timed_step() -> float:
        gpu_train._sync()
        t0 = time.perf_counter()
        train_step(parts)
        gpu_train._sync()
        return time.perf_counter() - t0

    for _ in range(args.saves):
        quiet += [timed_step() for _ in range(args.every)]
        step = parts.progress.step
        blocked = ckpt.save(step, parts.checkpoint_state, parts.progress.tokens)
        saves.append({"step": step, "blocking_s": round(blocked, 4),
                      "of_which_waiting_s": round(ckpt.last_wait_s, 4)})
        # Train on while it is written and committed: these steps overlap the write.
        while len([e for e in recorder.events if e[1] == "checkpoint_committed"]) < len(saves):
            overlapping.append(timed_step())
    ckpt.wait()
    committed = [e[2] for e in recorder.events if e[1] == "checkpoint_committed"]
    for s, c in zip(saves, committed, strict=False):
        s.update({"save_s": c.get("save_s"), "bytes": c.get("bytes")})
    state_bytes = committed[-1]["bytes"] if committed else None
    report = {**header(torch.cuda.get_device_name() if args.device == "cuda" else None),
              "model": args.preset, "stage_ahead": args.stage_ahead,
              "staging_prepare_s": round(ckpt.staging.prepare_s, 4)
              if ckpt.staging is not None and ckpt.staging.prepare_s is not None else None,
              "staging_first_save_wait_s": round(ckpt.staging.wait_s, 4)
              if ckpt.staging is not None else None, "state_gb": round(state_bytes / 1e9, 3) if state_bytes
              else None, "saves": saves,
              "blocking_s_first": saves[0]["blocking_s"] if saves else None,
              "blocking_s_reused_median": statistics.median(s["blocking_s"] for s in saves[1:])
              if len(saves) > 1 else None,
              "write_gb_per_s": round(state_bytes / 1e9 / statistics.median(
                  s["save_s"] for s in saves if s.get("save_s")), 3) if state_bytes else None,
              "step_s_quiet_median": round(statistics.median(quiet), 4) if quiet else None,
              "step_s_overlapping_median": round(statistics.median(overlapping), 4)
              if overlapping else None, "steps_overlapping": len(overlapping),
              "events": [e[1] for e in recorder.events]}
    path = write(Path(args.out).name, report)
    print(report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
