"""The wire between the supervisor and its heartbeat process (``beatfront``): framed messages
over one Unix socket pair that the supervisor creates and hands to the child it starts.

A frame is a 4-byte big-endian length, then a 1-byte kind, then its payload. What each side
sends:

    supervisor -> front   SETUP    (once, first) how to serve: address, token, API bounds
                          MIRROR   what the front may decide alone: registered nodes with
                                   their assignment version, the newest launch's slices
                          REPLY    the supervisor's answer to an ASK: status and JSON body
    front -> supervisor   READY    the port the front listens on
                          BEATS    heartbeats it accepted: (node, body) pairs, as received
                          ASK      a heartbeat it could not decide (unknown node, a refusal
                                   by its mirror): the supervisor answers it as its own
                                   route would, and the front passes the answer on

Both ends parse what they read into a type before using it: a frame that does not parse
raises ``BadFrame`` (the reader closes the link), JSON payloads are pydantic models, and a
heartbeat body is parsed again by the supervisor with the protocol's model.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.contracts.protocol import NodeId, Port

SETUP, MIRROR, REPLY, READY, BEATS, ASK = b"S", b"M", b"R", b"Y", b"B", b"A"
# A frame holds at most a batch of heartbeats of api.max_body_mb each: bounded by the reader.
_HEADER = struct.Struct(">I")
_PAIR = struct.Struct(">HI")  # node id length, body length
_ASK = struct.Struct(">I")  # request id
_REPLY = struct.Struct(">IH")  # request id, HTTP status


class BadFrame(ValueError):
    """A frame that is not what the wire says (the link is closed)."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Setup(_Msg):
    host: str
    port: int = Field(ge=0, le=65535)
    token: str = Field(min_length=1)
    max_body_mb: float = Field(gt=0)
    max_json_depth: int = Field(ge=1)
    header_timeout_s: float = Field(gt=0)
    tls_cert: str | None = None
    tls_key: str | None = None
    world_size: int = Field(ge=1)
    max_step_interval_s: float = Field(gt=0)
    max_nodes: int = Field(ge=1)
    ppn: int = Field(ge=1)
    log_level: str = "INFO"


class Launch(_Msg):
    generation: int = Field(ge=0)
    node_ranks: dict[NodeId, int]


class Mirror(_Msg):
    """Nodes whose version changed (or that registered) and the newest launch, when new."""

    nodes: dict[NodeId, int] = Field(default_factory=dict)
    launch: Launch | None = None


class Ready(_Msg):
    port: Port


def frame_bound(max_body_mb: float) -> int:
    """The largest frame either end reads: one heartbeat body of ``api.max_body_mb`` and
    its framing (the front splits batches to fit)."""
    return int(max_body_mb * 2**20) + 4096


def frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload) + 1) + kind + payload


def model_frame(kind: bytes, msg: BaseModel) -> bytes:
    return frame(kind, msg.model_dump_json().encode())


def beats_frame(beats: Iterable[tuple[str, bytes]]) -> bytes:
    parts = []
    for node, body in beats:
        name = node.encode()
        parts += (_PAIR.pack(len(name), len(body)), name, body)
    return frame(BEATS, b"".join(parts))


def ask_frame(request_id: int, node: str, body: bytes) -> bytes:
    name = node.encode()
    return frame(ASK, _ASK.pack(request_id) + _PAIR.pack(len(name), len(body)) + name + body)


def reply_frame(request_id: int, status: int, body: bytes) -> bytes:
    return frame(REPLY, _REPLY.pack(request_id, status) + body)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bytes]:
    """The next frame's kind and payload. ``asyncio.IncompleteReadError`` at the end."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if not 1 <= size <= max_bytes:
        raise BadFrame(f"frame of {size} bytes (at most {max_bytes})")
    data = await reader.readexactly(size)
    return data[:1], data[1:]


def _pair(payload: bytes, at: int) -> tuple[str, bytes, int]:
    if at + _PAIR.size > len(payload):
        raise BadFrame("truncated beat header")
    name_len, body_len = _PAIR.unpack_from(payload, at)
    at += _PAIR.size
    end = at + name_len + body_len
    if end > len(payload):
        raise BadFrame("truncated beat")
    try:
        node = payload[at:at + name_len].decode("ascii")
    except UnicodeDecodeError:
        raise BadFrame("node id is not ASCII") from None
    return node, payload[at + name_len:end], end


def parse_beats(payload: bytes) -> list[tuple[str, bytes]]:
    beats, at = [], 0
    while at < len(payload):
        node, body, at = _pair(payload, at)
        beats.append((node, body))
    return beats


def parse_ask(payload: bytes) -> tuple[int, str, bytes]:
    if len(payload) < _ASK.size:
        raise BadFrame("truncated ask")
    (request_id,) = _ASK.unpack_from(payload)
    node, body, end = _pair(payload, _ASK.size)
    if end != len(payload):
        raise BadFrame("bytes after an ask")
    return request_id, node, body


def parse_reply(payload: bytes) -> tuple[int, int, bytes]:
    if len(payload) < _REPLY.size:
        raise BadFrame("truncated reply")
    request_id, status = _REPLY.unpack_from(payload)
    return request_id, status, payload[_REPLY.size:]
