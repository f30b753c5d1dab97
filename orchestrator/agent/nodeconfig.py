"""What the agent takes from the job's config (sent at registration): parsed once, typed.

The agent runs ranks in ``job.workdir`` (``{node_id}`` substituted), offers a rendezvous port
from ``job.master_port`` / ``job.master_port_range`` (else a free one below the ephemeral range), tells ranks
torchrun's ``TORCHELASTIC_MAX_RESTARTS`` from ``restart.max_restarts``, and stops ranks with
``timeouts.stop_grace_s``, keeps the memory tier's files (``checkpoint.memory_*``), and
stops its ranks when no supervisor has answered for ``timeouts.agent_lease_s`` (``lease``).
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config.schema import Config

PRELOAD_DIR = Path(__file__).resolve().parent.parent / "worker" / "preload"


def preload_pythonpath(existing: str | None) -> str:
    """PYTHONPATH with the preload hook's directory first (its sitecustomize runs first)."""
    parts = [p for p in (existing or "").split(":") if p and p != str(PRELOAD_DIR)]
    return ":".join([str(PRELOAD_DIR), *parts])


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _free_in(low: int, high: int) -> int:
    """A port of [low, high] free now, tried from a random start (nodes sharing a host
    rarely pick the same)."""
    span = high - low + 1
    start = random.randrange(span)
    for i in range(span):
        port = low + (start + i) % span
        if _bindable(port):
            return port
    return low + start  # none free now: the rendezvous reports the clash


# Rendezvous ports are offered below the kernel's ephemeral range: a port the OS handed out
# as free there can be taken by any outgoing connection on the host (another job's gloo
# pairs, an HTTP client) before the rank binds it, and the rank then fails EADDRINUSE.
_LOWEST_PORT = 20000


def _below_ephemeral() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_LOWEST_PORT, low - 1) if low - 1 - _LOWEST_PORT >= 1000 else None


def any_free_port() -> int:
    """A port free on this host right now (the OS picks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class NodeConfig:
    job: str = "job"
    max_restarts: int = 0
    stop_grace_s: float = 10.0
    workdir: Path | None = None
    master_port: int | None = None
    master_port_range: tuple[int, int] | None = None
    node_lost_s: float = 30.0
    lease_s: float = 0.0  # timeouts.agent_lease_s (0: none, as before a registration)

    # The memory tier (checkpoint.memory_*): None when off.
    memory_root: Path | None = None
    memory_max_bytes: int = 0
    memory_partner: bool = True

    @property
    def beat_timeout_s(self) -> float:
        """How long a heartbeat or an event batch waits for its answer: as long as the
        supervisor may wait before calling a node lost when many are silent at once
        (3x ``node_lost_s``; at least 5 s). An overloaded supervisor answers late but
        still reads the beat; one given up on is dropped with its connection, and agents
        that give up sooner than it can answer only add reconnections to its queue (at
        2,048 nodes under load it then spent its CPU accepting connections whose clients
        had already left)."""
        return max(5.0, 3.0 * self.node_lost_s)

    @classmethod
    def unknown(cls) -> NodeConfig:
        """Before the first registration: defaults, any free port."""
        return cls()

    @classmethod
    def from_config(cls, data: dict[str, Any], node_id: str) -> NodeConfig:
        """Parse the supervisor's resolved config (pydantic validation error if malformed)."""
        cfg = Config.model_validate(data)
        job = cfg.job
        workdir = None
        if job.workdir is not None:
            workdir = Path(job.workdir.format(node_id=node_id)).expanduser().absolute()
        ck = cfg.checkpoint
        memory_on = ck.memory_interval_steps is not None
        return cls(job=job.name, max_restarts=cfg.restart.max_restarts,
                   stop_grace_s=cfg.timeouts.stop_grace_s, workdir=workdir,
                   master_port=job.master_port, master_port_range=job.master_port_range,
                   node_lost_s=cfg.timeouts.node_lost_s,
                   lease_s=cfg.timeouts.agent_lease_s,
                   memory_root=Path(ck.memory_root).expanduser() if memory_on else None,
                   memory_max_bytes=ck.memory_max_bytes, memory_partner=ck.memory_partner)

    def free_port(self) -> int:
        """The rendezvous port this node offers: the fixed one, a free one in the range
        (from a random start, so nodes sharing a host rarely pick the same), or any."""
        if self.master_port is not None:
            return self.master_port
        if self.master_port_range is not None:
            return _free_in(*self.master_port_range)
        below = _below_ephemeral()
        return _free_in(*below) if below is not None else any_free_port()
