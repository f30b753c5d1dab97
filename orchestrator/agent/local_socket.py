"""The agent's side of the local socket its ranks' worker SDK talks to (JSON lines).

Ranks send ``beat`` lines (their latest progress and step records) and ``event`` lines
(checkpoint committed, ...). The agent keeps the newest beat of each rank and the step
records not yet relayed; events are handed on at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.logs import get_logger

# Records held for the supervisor while it is unreachable; beyond this the oldest are
# dropped (they are in the worker's own logs; the stream resumes when it is back).
_MAX_PENDING_RECORDS = 50_000


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


@dataclass
class LocalHub:
    """Latest beat per rank, records pending relay, and a callback for events."""

    on_event: Callable[[dict[str, Any]], None]
    beats: dict[int, BeatState] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    records_generation: int | None = None

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
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            self.log.warning("worker socket error", error=str(exc))
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass
