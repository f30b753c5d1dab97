"""The agent's side of the local socket its ranks' worker SDK talks to (JSON lines).

Ranks send ``beat`` lines (their latest progress and step records) and ``event`` lines
(checkpoint committed, ...). The agent keeps the newest beat of each rank and the step
records not yet relayed; events are handed on at once. The other way, the agent writes
orders for a rank (``profile`` lines) on the connection that rank last beat on; one the rank
has not connected for yet waits for its first beat.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.logs import get_logger

# Records held for the supervisor while it is unreachable; beyond this the oldest are
# dropped (they are in the worker's own logs; the stream resumes when it is back).
_MAX_PENDING_RECORDS = 50_000
# Orders held for a rank that has not connected yet (a profile order is one line).
_MAX_PENDING_ORDERS = 16
# A rank's summarized step time or data wait above this is not a measurement (a week).
_MAX_SECONDS = 7 * 86400.0


@dataclass
class BeatState:
    rank: int
    pid: int | None = None
    generation: int | None = None
    step: int | None = None
    phase: str | None = None
    last_step_ts: float | None = None
    interval_max: float | None = None
    beat_ts: float | None = None
    progress: str | None = None  # "sdk" or "hook": who counts this rank's steps
    finished: bool = False  # the rank's last beat: it is tearing down
    step_time: float | None = None  # mean of the rank's recent own step times
    data_wait: float | None = None  # mean of its recent data waits (the ``data_s`` metric)


def _seconds(value: Any) -> float | None:
    """A worker's summary figure if it is one (finite, in range), else None."""
    if isinstance(value, float | int) and not isinstance(value, bool) \
            and math.isfinite(value) and 0 <= value <= _MAX_SECONDS:
        return float(value)
    return None


@dataclass
class LocalHub:
    """Latest beat per rank, records pending relay, and a callback for events."""

    on_event: Callable[[dict[str, Any]], None]
    # A rank's channel closed (its process may be dying): the agent may learn its exit now.
    on_closed: Callable[[int], None] = lambda rank: None
    beats: dict[int, BeatState] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    records_generation: int | None = None
    # Per rank: where to write its orders (the connection it last beat on), and orders
    # waiting for it to connect.
    writers: dict[int, Callable[[bytes], None]] = field(default_factory=dict)
    pending: dict[int, list[bytes]] = field(default_factory=dict)

    def send_order(self, rank: int, order: dict[str, Any]) -> None:
        line = (json.dumps(order) + "\n").encode()
        write = self.writers.get(rank)
        if write is not None:
            try:
                write(line)
                return
            except (ConnectionError, RuntimeError, OSError):
                self.writers.pop(rank, None)
        queue = self.pending.setdefault(rank, [])
        queue.append(line)
        del queue[:-_MAX_PENDING_ORDERS]

    def connected(self, rank: int, write: Callable[[bytes], None]) -> None:
        """``rank`` beat on the connection ``write`` writes to: its orders go there."""
        self.writers[rank] = write
        for line in self.pending.pop(rank, []):
            write(line)

    def handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        rank = msg.get("rank")
        if not isinstance(rank, int):
            return
        if kind == "beat":
            st = self.beats.setdefault(rank, BeatState(rank))
            st.pid = msg.get("pid", st.pid)
            st.generation = msg.get("generation", st.generation)
            st.step, st.phase = msg.get("step"), msg.get("phase")
            st.last_step_ts, st.interval_max = msg.get("last_step_ts"), msg.get("interval_max")
            st.beat_ts = msg.get("ts")
            progress = msg.get("progress")
            st.progress = progress if progress in ("sdk", "hook") else None
            st.finished = msg.get("finished") is True
            st.step_time, st.data_wait = _seconds(msg.get("step_time")), \
                _seconds(msg.get("data_wait"))
            recs = msg.get("records") or []
            if recs:
                if self.records_generation != st.generation:
                    self.records, self.records_generation = [], st.generation
                self.records.extend(recs)
                del self.records[:-_MAX_PENDING_RECORDS]
        elif kind == "event":
            self.on_event(msg)

    def take_records(self) -> tuple[int | None, list[dict[str, Any]]]:
        recs, self.records = self.records, []
        return self.records_generation, recs

    def reset(self) -> None:
        self.beats.clear()
        self.records = []
        self.writers.clear()
        self.pending.clear()


class LocalSocketServer:
    """A unix socket in a private temp dir (short path: sun_path is ~108 bytes)."""

    def __init__(self, hub: LocalHub) -> None:
        self.hub = hub
        self._dir = tempfile.mkdtemp(prefix="orch-")
        self.path = os.path.join(self._dir, "agent.sock")
        self._server: asyncio.AbstractServer | None = None
        self.log = get_logger("orchestrator.agent.socket")

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._client, path=self.path,
                                                       limit=16 * 2**20)
        os.chmod(self.path, 0o600)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(msg, dict):
                    self.hub.handle(msg)
                    rank = msg.get("rank")
                    if msg.get("t") == "beat" and isinstance(rank, int) \
                            and self.hub.writers.get(rank) != writer.write:
                        self.hub.connected(rank, writer.write)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            self.log.warning("worker socket error", error=str(exc))
        finally:
            closed = [r for r, w in self.hub.writers.items() if w == writer.write]
            for rank in closed:
                del self.hub.writers[rank]  # its next connection takes its orders
            writer.close()
            for rank in closed:
                self.hub.on_closed(rank)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass
