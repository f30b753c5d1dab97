"""The run directory: one place for a job's journal, logs, records and (by default) checkpoints.

Layout::

    <run dir>/
      events.jsonl            journal (source of truth)
      config.yaml             the resolved config the job runs with
      supervisor.json         pid, url, port of the live supervisor
      token                   the control API token (0600)
      supervisor.log          structured log (JSON lines)
      steps.jsonl             rank 0's step records (loss, grad norm, ...), for replay
      logs/rank-00000.log     each rank's stdout/stderr (all generations, with a header each)
      agents/<node>.log       each local agent's log
      stacks/                 stack dumps taken before a hung job is killed
      checkpoints/            default checkpoint root (checkpoint.url unset)
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def create(cls, run_root: str | Path, job: str, now: float | None = None) -> RunDir:
        """A new, unique run directory ``<run_root>/<job>-YYYYmmdd-HHMMSS[-n]``."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now or time.time()))
        base = Path(run_root).expanduser().resolve()
        base.mkdir(parents=True, exist_ok=True)
        for n in range(1000):
            path = base / (f"{job}-{stamp}" + (f"-{n}" if n else ""))
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - a thousand runs in one second
            raise RuntimeError(f"could not create a unique run directory under {base}")
        latest = base / "latest"
        try:
            if latest.is_symlink() or latest.exists():
                latest.unlink()
            latest.symlink_to(path.name)
        except OSError:
            pass  # the symlink is a convenience; a filesystem without symlinks still runs
        return cls(path)

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        root = Path(path).expanduser().resolve()
        if not (root / "events.jsonl").exists():
            raise FileNotFoundError(f"{path} is not a run directory (no events.jsonl)")
        return cls(root)

    # -- paths -------------------------------------------------------------------------
    @property
    def journal(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def supervisor_info(self) -> Path:
        return self.root / "supervisor.json"

    @property
    def token_file(self) -> Path:
        return self.root / "token"

    @property
    def log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def steps(self) -> Path:
        return self.root / "steps.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def agents(self) -> Path:
        return self.root / "agents"

    @property
    def stacks(self) -> Path:
        return self.root / "stacks"

    @property
    def pid_file(self) -> Path:
        return self.root / "supervisor.pid"

    def checkpoint_root(self, url: str | None) -> str:
        return url if url else str(self.root / "checkpoints")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank:05d}.log"

    # -- small files ---------------------------------------------------------------------
    def ensure_token(self, preset: str | None = None) -> str:
        """The job's API token, created 0600 on first use. Never logged.

        ``preset`` (the supervisor's ``ORCH_TOKEN``, e.g. from a Kubernetes Secret) is used
        instead of a fresh random token when the run has none yet.
        """
        if self.token_file.exists():
            return self.token_file.read_text().strip()
        token = preset or secrets.token_urlsafe(32)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        return token

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        os.replace(tmp, path)

    def read_supervisor_info(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.supervisor_info.read_text())
        except (OSError, json.JSONDecodeError):
            return None
