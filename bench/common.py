"""What every benchmark report carries: the script, device, software, commit and date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def commit() -> str:
    """The commit measured: git's, or ORCH_BENCH_COMMIT on a machine given a copy of the
    tree without its .git (a GPU machine the tree is copied to)."""
    if os.environ.get("ORCH_BENCH_COMMIT"):
        return os.environ["ORCH_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=RESULTS.parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=RESULTS.parent, timeout=10)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def script() -> str:
    """The benchmark that was run, as a path in the repository (``bench/<area>/<name>.py``)."""
    path = Path(sys.argv[0]).resolve()
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def header(device: str | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "script": script(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "device": device or f"cpu: {cpu_name()} x{os.cpu_count()}",
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def write(name: str, report: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path
