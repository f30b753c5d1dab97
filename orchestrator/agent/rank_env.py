"""A rank's environment: torchrun's whole contract, plus the orchestrator's own variables.

Any script written for ``torchrun`` runs unchanged: it finds every variable torchrun's local
elastic agent sets, with torchrun's defaults, and its ``@record`` decorator finds the
per-rank ``TORCHELASTIC_ERROR_FILE`` it writes its exception to. The agent reads that file
when the rank exits (:func:`read_error_file`) and reports its message and traceback as the
exit's cause.

Where we differ from torchrun, and why:

- No secret reaches a rank (``contracts.env.SECRETS``): not the control-API token, not the
  checkpoint signing key nor its file's path, even when ``job.env`` names them: the node
  agent signs and checks manifests for its ranks (``agent.keyservice``).

- ``TORCHELASTIC_USE_AGENT_STORE=False``: torchrun's agent hosts the TCPStore and its ranks
  connect as clients; here rank 0 hosts it (torch's ``env://`` rendezvous), so "True" would
  leave every rank waiting for a store nobody serves.
- ``OMP_NUM_THREADS=1`` unless set, also for one rank per node: simulated nodes share a host,
  where unlimited OpenMP threads per rank made a tutorial run 5x slower.
- ``TORCHELASTIC_MAX_RESTARTS`` is the job's ``restart.max_restarts``, and
  ``TORCHELASTIC_RESTART_COUNT`` the generation minus one (the restarts so far).
- glibc's malloc backs its large blocks with transparent huge pages
  (:func:`huge_page_malloc`), unless ``GLIBC_TUNABLES`` already sets that tunable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.contracts import env as ec
from orchestrator.contracts.protocol import Assignment

# torchrun's defaults for variables a user may still override (job.env or the agent's env).
TORCHRUN_DEFAULTS = {
    "OMP_NUM_THREADS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle default
ROLE_NAME = "default"  # torchrun's --role default

# Every variable torchrun sets for a worker (torch 2.x local elastic agent + run.py); the
# integration test compares this list against a real torchrun run.
TORCHRUN_VARIABLES = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
)

# PyTorch page-locks a rank's checkpoint staging (gigabytes per GPU) by malloc, then
# ``cudaHostRegister``. When the rank dies, the GPU driver unpins those pages under its
# global lock, and every other process on the host waits for it: the replacement's first
# allocations, the survivors' NCCL abort. On 2 x H200 a dead process's 7 GB of staging held
# the lock 0.71-0.74 s on 4 KiB pages and 0.17-0.19 s on transparent huge pages
# (bench/results/lock-after-death-h200-2gpu.json). glibc >= 2.35 reads this tunable at
# start-up (older ones ignore it); it takes effect where THP is "madvise" or "always".
HUGE_PAGE_MALLOC = "glibc.malloc.hugetlb=1"


def huge_page_malloc(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`HUGE_PAGE_MALLOC` added to ``GLIBC_TUNABLES``, in place, unless
    that variable sets ``glibc.malloc.hugetlb`` already (the operator's or the job's choice,
    ``0`` included, stands)."""
    current = env.get("GLIBC_TUNABLES", "")
    if any(item.split("=", 1)[0].strip() == "glibc.malloc.hugetlb"
           for item in current.split(":")):
        return env
    env["GLIBC_TUNABLES"] = f"{current}:{HUGE_PAGE_MALLOC}" if current.strip(":") \
        else HUGE_PAGE_MALLOC
    return env


# Bounds on what an error file may put into a report (the file is the rank's to write).
_MAX_ERROR_FILE = 1 << 20
_MAX_MESSAGE = 2000
_MAX_TRACEBACK_LINES = 40


def error_file(run_dir: Path, generation: int | None, rank: int) -> Path:
    """Where rank ``rank`` of ``generation`` writes its ``@record`` error file."""
    return run_dir / "errors" / f"gen{generation or 0:04d}" / f"rank{rank:05d}" / "error.json"


def rank_env(a: Assignment, local_rank: int, base: dict[str, str], *, run_dir: Path,
             max_restarts: int, job: str) -> dict[str, str]:
    """The whole environment of local rank ``local_rank`` of assignment ``a``.

    ``base`` is the agent's environment with the orchestrator's variables; ``a.env`` (the
    generation's variables and ``job.env``) overrides it; torchrun's variables override both,
    except the defaults in :data:`TORCHRUN_DEFAULTS`, which only fill in.
    """
    rank = a.rank_offset + local_rank
    nodes = a.world_size // a.nproc if a.nproc > 0 else 1
    # The signing key and its file stay with the agent (``agent.keyservice``).
    env = huge_page_malloc(ec.without_secrets({**base, **a.env}))
    for key, value in TORCHRUN_DEFAULTS.items():
        env.setdefault(key, value)
    env.update({
        "MASTER_ADDR": str(a.master_addr), "MASTER_PORT": str(a.master_port),
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(a.world_size),
        "LOCAL_WORLD_SIZE": str(a.nproc), "GROUP_RANK": str(a.node_rank),
        "GROUP_WORLD_SIZE": str(nodes), "NODE_RANK": str(a.node_rank),
        "ROLE_NAME": ROLE_NAME, "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(a.world_size),
        "TORCHELASTIC_RESTART_COUNT": str(max(0, (a.generation or 1) - 1)),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": job,
        "TORCHELASTIC_USE_AGENT_STORE": str(False),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,
        "TORCHELASTIC_ERROR_FILE": str(error_file(run_dir, a.generation, rank)),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def prepare_error_file(path: Path) -> None:
    """An empty place for this generation's file: a stale one must not name a new failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)


def read_error_file(path: Path) -> tuple[str, list[str]] | None:
    """(message, traceback lines) from what torch's ``@record`` wrote, or None.

    The format is torch elastic's ``ProcessFailure`` error file::

        {"message": {"message": "ValueError: ...",
                     "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "..."}}}

    A file that is missing, too large or not in that shape yields None (the log tail then
    stands as the cause); a plain-string ``message`` is accepted as torch accepts it.
    """
    try:
        if path.stat().st_size > _MAX_ERROR_FILE:
            return None
        data: Any = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    body = data.get("message")
    if isinstance(body, str):
        return body[:_MAX_MESSAGE], []
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        return None
    message = body["message"][:_MAX_MESSAGE]
    extra = body.get("extraInfo")
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    lines = stack.splitlines()[-_MAX_TRACEBACK_LINES:] if isinstance(stack, str) else []
    return message, [line[:_MAX_MESSAGE] for line in lines]
