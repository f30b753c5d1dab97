"""A rank's use of the checkpoint signing key, held by its node agent: no rank holds the key.

Every manifest a rank commits (the durable tier's, which rank 0 writes; each rank's own
memory-tier copies) is signed with the job's key, and a restore checks those signatures. The
key stays in the node agent: it is never in a rank's environment, and the agent makes itself
undumpable, so a rank running as the same user cannot read it from ``/proc/<agent>``. A rank
asks the agent instead, over the agent's local socket (``orchestrator.agent.local_socket``),
one request per connection:

    rank -> agent   {"t": "key", "op": "sign" | "check" | "id", "rank": R,
                     "scope": "manifest" | "memory", "manifest": {...}}
    agent -> rank   {"t": "key", "ok": true, "signature": {...}}          (sign)
                    {"t": "key", "ok": true, "outcome": ..., "message": ...}  (check)
                    {"t": "key", "ok": true, "key_id": ...}                (id)
                    {"t": "key", "ok": false, "error": "..."}              (refused)

Both ends parse what they read into the models below (strict, bounded). The agent answers
only the process that is rank R of its running generation (the connection's peer pid,
``SO_PEERCRED``), signs a durable manifest for rank 0 only and a memory-tier manifest only
for the rank it names, and never returns the key: ``check`` says whether a signature is the
key's, ``id`` gives the key's public id.
"""

from __future__ import annotations

import json
import socket
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# A request is one line; the agent reads lines of at most this (a manifest of ~100k files).
MAX_LINE = 16 * 2**20
_TIMEOUT_S = 60.0


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    t: Literal["key"]
    op: Literal["sign", "check", "id"]
    rank: Annotated[int, Field(ge=0, lt=1 << 20)]
    scope: Literal["manifest", "memory"] = "manifest"
    manifest: dict[str, Any] = Field(default_factory=dict)


class KeyReply(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    t: Literal["key"] = "key"
    ok: bool
    error: Annotated[str, Field(max_length=1000)] | None = None
    signature: dict[str, Annotated[str, Field(max_length=128)]] | None = None
    outcome: Annotated[str, Field(max_length=32)] | None = None
    message: Annotated[str, Field(max_length=1000)] | None = None
    key_id: Annotated[str, Field(max_length=64)] | None = None


class KeyUnavailable(RuntimeError):
    """The agent could not be asked, or refused (the message says why)."""


class AgentSigner:
    """Signs and checks manifests through the node agent (``signing.Trust.signer``)."""

    def __init__(self, socket_path: str, rank: int, timeout: float = _TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.rank = rank
        self.timeout = timeout
        self._key_id: str | None = None

    def _ask(self, op: str, scope: str = "manifest",
             manifest: dict[str, Any] | None = None) -> KeyReply:
        line = KeyRequest(t="key", op=op, rank=self.rank, scope=scope,  # type: ignore[arg-type]
                          manifest=manifest or {}).model_dump_json().encode() + b"\n"
        if len(line) > MAX_LINE:
            raise KeyUnavailable(f"a manifest of {len(line)} bytes is more than the agent "
                                 f"reads ({MAX_LINE})")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout)
                s.connect(self.socket_path)
                s.sendall(line)
                answer = _read_line(s)
        except OSError as exc:
            raise KeyUnavailable(f"the node agent did not answer ({exc})") from None
        try:
            reply = KeyReply.model_validate_json(answer)
        except ValidationError:
            raise KeyUnavailable("the node agent's answer is not a key reply") from None
        if not reply.ok:
            raise KeyUnavailable(f"the node agent refused: {reply.error}")
        return reply

    @property
    def key_id(self) -> str | None:
        if self._key_id is None:
            self._key_id = self._ask("id").key_id
        return self._key_id

    def signature(self, manifest: dict[str, Any], scope: str) -> dict[str, str]:
        reply = self._ask("sign", scope, manifest)
        if reply.signature is None:
            raise KeyUnavailable("the node agent sent no signature")
        return reply.signature

    def check(self, manifest: dict[str, Any]) -> tuple[str, str]:
        reply = self._ask("check", "manifest", manifest)
        return reply.outcome or "", reply.message or ""


def _read_line(s: socket.socket) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n") or size > MAX_LINE:
            break
    return b"".join(chunks).strip()


def key_line(reply: KeyReply) -> bytes:
    """A reply as the line the agent writes."""
    return json.dumps(reply.model_dump(exclude_none=True)).encode() + b"\n"
