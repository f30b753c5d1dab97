"""The accelerator health checks (full level) run for real on this machine.

Runs every accelerator check of the catalog (inventory, ECC, row remapping / page
retirement, XIDs, the memory test, matmul throughput; on Trainium neuron-ls, the compile
cache and nccom-test) through the runner the agents use (a child process, each check cut at
its timeout), with the accelerator detected, and keeps each result with its duration, the
raw NVML snapshot (the format of ``tests/unit/health/fixtures/nvml``) and the device.

    python bench/health/gpu_health.py                  # writes bench/results/health-<device>.json

On a machine without an accelerator it says so: every check reports "no accelerator found"
with the reasons (no NVML, no neuron-ls, torch.cuda unavailable) and the file is
``health-cpu.json``. nvidia-ml-py is optional: without it the inventory falls back to
torch.cuda and the NVML counters are reported as unreadable.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import header, write

from orchestrator.health.base import Level
from orchestrator.health.catalog import node_checks
from orchestrator.health.config import HealthConfig
from orchestrator.health.context import build_node_context
from orchestrator.health.nvml import read_nvml
from orchestrator.health.runner import run_node_checks


def device_slug(results: list[dict[str, Any]]) -> tuple[str, str]:
    """(file-name slug, description) of the accelerator the inventory found."""
    inv = next((r for r in results if r["check"] == "accelerator.inventory"), None)
    if inv is None or inv["skipped"]:
        return "cpu", "no accelerator"
    details = inv.get("details") or {}
    if details.get("instance_type") or details.get("cores"):
        name = details.get("instance_type") or "neuron"
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), inv["message"]
    names = details.get("names") or []
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", " ".join(names))
    return (model.group(1).lower() if model else "gpu"), inv["message"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memtest-gib", type=float, default=4.0,
                    help="Device memory written and verified per device.")
    ap.add_argument("--matmul-size", type=int, default=8192)
    ap.add_argument("--expect", default=None, help="Text every device name must contain.")
    ap.add_argument("--out", type=Path, default=None, help="Default: health-<device>.json")
    args = ap.parse_args()
    checks = [c.name for c in node_checks(Level.FULL)
              if c.name.startswith(("accelerator.", "neuron."))]
    health = HealthConfig(memtest_gib=args.memtest_gib, matmul_size=args.matmul_size,
                          expect_device_name=args.expect)
    ctx = build_node_context(health, nonce="bench", node_id=socket.gethostname(),
                             level=Level.FULL, checks=checks, accelerator="auto", devices=0,
                             checkpoint_root="")
    start = time.perf_counter()
    results = [r.model_dump(mode="json") for r in asyncio.run(run_node_checks(ctx))]
    total = time.perf_counter() - start
    slug, device = device_slug(results)
    report = {**header(device=None if slug == "cpu" else device), "accelerator": device,
              "level": "full", "node": ctx.node_id,
              "total_s": round(total, 3), "results": results, "nvml_snapshot": read_nvml(),
              "fatal_failures": [r["check"] for r in results
                                 if not r["ok"] and r["severity"] == "fatal"]}
    path = write(args.out.name if args.out else f"health-{slug}.json", report)
    for r in results:
        mark = "skip" if r["skipped"] else ("ok" if r["ok"] else "FAIL")
        print(f"{r['check']:32s} {mark:5s} {r['duration_s']:8.2f} s  {r['message']}")
    print(f"{device}: {total:.1f} s in all; wrote {path}")
    return 1 if report["fatal_failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
