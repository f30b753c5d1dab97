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
      agents/credentials/     per-node credentials handed over as files (Slurm), 0600
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


# A job's files are its operator's: the journal, the step records, the config, the logs and
# (by default) the checkpoints. Every process of the job creates them private (0700
# directories, 0600 files); the checkpoints' own mode is ``checkpoint.mode``.
PRIVATE_UMASK = 0o077


def make_private() -> None:
    """This process (and what it starts) creates files only its user may read."""
    os.umask(PRIVATE_UMASK)


# Where each rank writes its Python stacks when asked (faulthandler on SIGUSR1, or py-spy
# from its agent), and under which name: the SDK, the agent and the supervisor all use these.
STACKS_DIR = "stacks"


def stack_file_name(generation: int, rank: int) -> str:
    """The file under ``stacks/`` that ``rank`` of ``generation`` writes its stacks to."""
    return f"gen{generation:04d}-rank{rank:05d}.txt"


def is_remote(url: str | None) -> bool:
    """Whether ``url`` names an object store (``s3://``, ``gs://``...) rather than a local
    path; a ``file://`` URL and a plain path are local."""
    return bool(url) and "://" in url and not url.startswith("file://")


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
                path.mkdir(mode=0o700)
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

    def narrow(self) -> None:
        """Close the run directory to other users (one an older version left 0755): every
        file in it is then out of their reach, whatever its own mode."""
        try:
            if self.root.stat().st_mode & 0o077:
                os.chmod(self.root, 0o700)
        except OSError:
            pass  # not ours to change (another user's run): reading it goes on

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
    def credentials(self) -> Path:
        return self.agents / "credentials"

    @property
    def stacks(self) -> Path:
        return self.root / STACKS_DIR

    @property
    def pid_file(self) -> Path:
        return self.root / "supervisor.pid"

    def checkpoint_root(self, url: str | None) -> str:
        return url if url else str(self.root / "checkpoints")

    # -- small files ---------------------------------------------------------------------
    def ensure_token(self, preset: str | None = None) -> str:
        """The job's API token, created 0600 on first use. Never logged: it is registered
        for redaction by value (``orchestrator.logs.redact``) as soon as it is known.

        ``preset`` (the supervisor's ``ORCH_TOKEN``, e.g. from a Kubernetes Secret) is used
        instead of a fresh random token when the run has none yet. A token file that others
        may read (an older version, a copy) is narrowed to 0600 on the way.
        """
        from orchestrator.logs import redact

        if self.token_file.exists():
            if self.token_file.stat().st_mode & 0o077:
                os.chmod(self.token_file, 0o600)
            token = self.token_file.read_text().strip()
            redact(token)
            return token
        token = preset or secrets.token_urlsafe(32)
        redact(token)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        return token

    def write_secret(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` readable by its owner only (0600 from the first byte:
        the file is created with that mode, never narrowed after it was written)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        os.replace(tmp, path)

    def read_supervisor_info(self) -> dict[str, Any] | None:
        from orchestrator.contracts import readback

        try:
            return readback.read_object(self.supervisor_info, readback.SMALL)
        except (OSError, readback.Unreadable):
            return None
