"""The supervisor's own Prometheus target, in a file_sd file (``metrics.targets_file``).

Prometheus watches file_sd files and picks changes up at once, so a supervisor on a port
chosen at start-up (``metrics.port: 0``) is scraped without editing any config, and removing
the file when the job has ended tells Prometheus the target is gone on purpose: only a
supervisor that died with its job unfinished shows as down (``up == 0``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path


def write_target(path: str | Path, host: str, port: int) -> Path:
    """Write ``[{"targets": ["host:port"]}]`` atomically (Prometheus never reads half)."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([{"targets": [f"{host}:{port}"], "labels": {}}]) + "\n")
    os.replace(tmp, target)
    return target


def remove_target(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        Path(path).expanduser().unlink()


class ScrapeTarget:
    """This supervisor as a Prometheus target, for as long as its job needs scraping."""

    def __init__(self, targets_file: str | None, linger_s: float, host: str,
                 port: int) -> None:
        self.path = Path(targets_file).expanduser() if targets_file else None
        self.linger_s = linger_s
        if self.path is not None:
            write_target(self.path, host, port)

    async def retire(self, job_ended: bool) -> None:
        """When the job has ended: serve ``linger_s`` longer (the final state and books get
        scraped), then withdraw the target. A supervisor leaving a live job (it will be
        resumed) stays a target, so it shows as down until it is back."""
        if not job_ended:
            return
        await asyncio.sleep(self.linger_s)
        if self.path is not None:
            remove_target(self.path)
