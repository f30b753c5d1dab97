"""The agent's side of the local socket its ranks' worker SDK talks to (JSON lines).

Ranks send ``beat`` lines (their latest progress and step records) and ``event`` lines
(checkpoint committed, ...). The agent keeps the newest beat of each rank and the step
records not yet relayed; events are handed on at once. An event line with ``"ack": true``
(a rank's last words before it signals itself) is answered with an ``ack`` line once the
event is queued. A ``key`` line asks the agent to sign
or check a manifest (``orchestrator.worker.keyclient``): it is answered on its connection,
with the pid at the other end of it (``SO_PEERCRED``) saying who asks.

A beat is parsed into ``WorkerBeat`` (the protocol's own types and bounds) before any of
it is kept: its fields go into the node's heartbeat, which the supervisor parses strictly,
so one unchecked value (a user's script calling ``step_done(5.0)``) made every heartbeat of
the node refused, and the node was declared LOST. A line that does not parse is dropped and
said in the log (once per rank and problem); the rank's last good beat stands, and a rank
whose beats never parse is judged as one that does not step. Events are parsed by the agent
into ``WorkerEvent`` (``Agent._on_worker_event``). The other way, the agent writes
orders for a rank (``profile`` lines) on the connection that rank last beat on; one the rank
has not connected for yet waits for its first beat.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from orchestrator.contracts import readback
from orchestrator.contracts.protocol import MAX_STEP_INTERVAL_S, Generation, Phase, Pid, Rank, Step
from orchestrator.contracts.worker_events import Timestamp
from orchestrator.logs import get_logger
from orchestrator.worker.keyclient import MAX_LINE, KeyReply, key_line
from orchestrator.worker.sdk import ACK_LINE

# Records held for the supervisor while it is unreachable; beyond this the oldest are
# dropped (they are in the worker's own logs; the stream resumes when it is back).
_MAX_PENDING_RECORDS = 50_000
# A rank's line: a beat (its step records carry a NaN loss as NaN) or a key request.
_LINE = readback.Bounds(max_bytes=MAX_LINE, max_depth=16, allow_nan=True)
# Orders held for a rank that has not connected yet (a profile order is one line).
_MAX_PENDING_ORDERS = 16
# A rank's summarized step time or data wait above this is not a measurement (a week).
_MAX_SECONDS = 7 * 86400.0


def _seconds(value: Any) -> float | None:
    """A worker's summary figure if it is one (finite, in range), else None."""
    if isinstance(value, float | int) and not isinstance(value, bool) \
            and math.isfinite(value) and 0 <= value <= _MAX_SECONDS:
        return float(value)
    return None


# A summary of the rank's recent steps (means of what the script reported): one that is not
# a measurement is left out, not a reason to drop the beat.
Summary = Annotated[float | None, BeforeValidator(_seconds)]
Interval = Annotated[float, Field(ge=0, le=MAX_STEP_INTERVAL_S)]


class WorkerBeat(BaseModel):
    """A ``beat`` line of the worker SDK, in the protocol's types (``RankInfo``'s)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True)

    t: Literal["beat"]
    rank: Rank
    pid: Pid | None = None
    generation: Generation | None = None
    step: Step | None = None
    phase: Phase | None = None
    last_step_ts: Timestamp | None = None
    interval_max: Interval | None = None
    ts: Timestamp | None = None
    progress: Literal["sdk", "hook"] | None = None
    finished: bool = False
    recoverable: bool = False
    step_time: Summary = None
    data_wait: Summary = None
    # Checked one by one when relayed (``keep_valid_records``): one bad record is dropped
    # there, not the beat.
    records: list[dict[str, Any]] = Field(default_factory=list)


def _problem(exc: ValidationError) -> str:
    err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "line"
    return f"{where}: {err['msg']}"[:200]


@dataclass
class LocalHub:
    """Latest beat per rank, records pending relay, and a callback for events."""

    on_event: Callable[[dict[str, Any]], None]
    # A rank's channel closed (its process may be dying): the agent may learn its exit now.
    on_closed: Callable[[int], None] = lambda rank: None
    # The newest valid beat of each rank, its records taken out (they wait in ``records``)
    # and its pid and generation those of an earlier beat when this one leaves them out.
    beats: dict[int, WorkerBeat] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    records_generation: int | None = None
    # Per rank: where to write its orders (the connection it last beat on), and orders
    # waiting for it to connect.
    writers: dict[int, Callable[[bytes], None]] = field(default_factory=dict)
    pending: dict[int, list[bytes]] = field(default_factory=dict)
    dropped: int = 0  # beat lines that did not parse
    _said: set[tuple[object, str]] = field(default_factory=set)  # (rank, problem) logged

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

    def handle(self, msg: dict[str, Any]) -> int | None:
        """One line from a rank; the rank of a beat that parsed (else None)."""
        kind = msg.get("t")
        if kind == "event":
            if isinstance(msg.get("rank"), int):
                self.on_event(msg)
            return None
        if kind != "beat":
            return None
        try:
            beat = WorkerBeat.model_validate(msg)
        except ValidationError as exc:
            self._drop(msg.get("rank"), _problem(exc))
            return None
        prev = self.beats.get(beat.rank)
        kept = beat.model_copy(update={
            "records": [],
            "pid": beat.pid if beat.pid is not None or prev is None else prev.pid,
            "generation": beat.generation if beat.generation is not None or prev is None
            else prev.generation})
        self.beats[beat.rank] = kept
        if beat.records:
            if self.records_generation != kept.generation:
                self.records, self.records_generation = [], kept.generation
            self.records.extend(beat.records)
            del self.records[:-_MAX_PENDING_RECORDS]
        return beat.rank

    def _drop(self, rank: object, problem: str) -> None:
        self.dropped += 1
        key = (rank if isinstance(rank, int) else None, problem)
        if key in self._said or len(self._said) >= 256:
            return
        self._said.add(key)
        get_logger("orchestrator.agent.socket").warning(
            "worker beat dropped: not valid for the protocol (said once per rank and "
            "problem; the rank's last valid beat stands)", rank=key[0], problem=problem)

    def forget(self, rank: int) -> None:
        """``rank``'s process was replaced: its last beat, its connection and the orders
        waiting for it belong to the dead process, not to the one that takes its place."""
        self.beats.pop(rank, None)
        self.writers.pop(rank, None)
        self.pending.pop(rank, None)

    def take_records(self, limit: int) -> tuple[int | None, list[dict[str, Any]]]:
        """The oldest ``limit`` pending records and their generation (the rest wait)."""
        recs, self.records = self.records[:limit], self.records[limit:]
        return self.records_generation, recs

    def reset(self) -> None:
        self.beats.clear()
        self.records = []
        self.writers.clear()
        self.pending.clear()


# Answers a rank's key request (``orchestrator.agent.keyservice``), given the asking pid.
KeyAnswer = Callable[[dict[str, Any], "int | None"], KeyReply]


def _no_keys(msg: dict[str, Any], pid: int | None) -> KeyReply:
    return KeyReply(ok=False, error="this agent holds no checkpoint key")


def peer_pid(sock: Any) -> int | None:
    """The pid of the process at the other end of a unix socket (Linux)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid, _, _ = struct.unpack("3i", raw)
    return pid if pid > 0 else None


class LocalSocketServer:
    """A unix socket in a private temp dir (short path: sun_path is ~108 bytes)."""

    def __init__(self, hub: LocalHub, keys: KeyAnswer = _no_keys) -> None:
        self.hub = hub
        self.keys = keys
        self._dir = tempfile.mkdtemp(prefix="orch-")
        self.path = os.path.join(self._dir, "agent.sock")
        self._server: asyncio.AbstractServer | None = None
        self.log = get_logger("orchestrator.agent.socket")

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._client, path=self.path,
                                                       limit=MAX_LINE)
        os.chmod(self.path, 0o600)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    msg = readback.loads(line, _LINE)
                except readback.Unreadable:
                    continue
                if isinstance(msg, dict) and msg.get("t") == "key":
                    pid = peer_pid(writer.get_extra_info("socket"))
                    writer.write(key_line(self.keys(msg, pid)))
                    continue
                if isinstance(msg, dict) and msg.get("t") == "event" and msg.get("ack") is True:
                    # Queued by ``handle`` (synchronously) before the answer is written: the
                    # rank's exit, which can only follow the answer, is queued after it.
                    self.hub.handle(msg)
                    writer.write(ACK_LINE)
                    continue
                if isinstance(msg, dict):
                    rank = self.hub.handle(msg)
                    if rank is not None and self.hub.writers.get(rank) != writer.write:
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
