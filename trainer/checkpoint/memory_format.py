"""The memory tier's on-memory format: a slot file of raw tensor bytes plus a signed manifest.

A node's agent owns a directory in shared memory (``/dev/shm``) holding fixed-size slot
files (``orchestrator.agent.memory``); a rank writes its state into one of them and commits
it by writing the slot's manifest last, as the durable tier does:

``own-r<rank>-<a|b>.bin``      this rank's state, two slots: a save overwrites the older one,
                               so the newest committed copy is never the one being written
``own-r<rank>-<a|b>.json``     its manifest (written by rename after the bytes)
``partner-r<rank>-<a|b>.*``    the same for the partner rank whose copy this node holds

A slot's bytes are segments, each at a 64-byte aligned offset: one per tensor of the state
(its raw bytes, this rank's local shard for a DTensor), then one ``objects`` blob, the state
tree with every tensor replaced by a marker (``torch.save``; read back with
``weights_only=True``, plain containers and numbers only). A restore copies each tensor
segment straight into the live tensor that the fresh state dict names at the same place
(``copy_`` from a view of the mapping: a host-to-device copy on a GPU), no file reader.

The manifest (``MemoryManifest``) records the format version, job, config hash, rank and
world size, step and tokens, every segment (offset, size, dtype, shape), the BLAKE3 digest
of the copy's ``data_bytes`` bytes (segments, their padding, the objects blob: one range,
hashed in large pieces) and the HMAC signature
of the durable tier (``signing``). It is parsed into that type before anything is used: a
copy whose manifest is torn, unsigned, signed with another key, for another rank, world or
config, or whose bytes do not match the digest is never loaded.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchestrator.contracts import readback
from trainer.checkpoint import signing

FORMAT = "orchestrator-memory/2"
ALIGN = 64
MANIFEST_MAX_BYTES = 16 * 2**20  # a manifest this large is not one of ours
MAX_SEGMENTS = 1_000_000
MARKER = "__memory_tensor__"  # {MARKER: i} stands for tensor segment i in the objects tree
SLOTS = ("a", "b")
KINDS = ("own", "partner")

# dtypes a segment may hold (torch names without the ``torch.`` prefix).
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64", "float8_e4m3fn", "float8_e5m2")

_NAME = re.compile(r"^(own|partner)-r(\d{1,7})-([ab])\.(bin|json)$")
Size = Annotated[int, Field(ge=0, le=1 << 48)]


class Segment(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    offset: Size
    nbytes: Size
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: list[Annotated[int, Field(ge=0, le=1 << 40)]] = Field(max_length=16)


class Blob(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    offset: Size
    nbytes: Size


class MemoryManifest(BaseModel):
    """What a committed slot holds (see the module)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: Literal["orchestrator-memory/2"]
    job: str = Field(max_length=256)
    config_hash: str | None = Field(None, max_length=128)
    rank: Annotated[int, Field(ge=0, le=1 << 24)]
    world_size: Annotated[int, Field(ge=1, le=1 << 24)]
    step: Annotated[int, Field(ge=0, le=1 << 53)]
    tokens: Annotated[int, Field(ge=0, le=1 << 62)]
    generation: Annotated[int, Field(ge=0, le=1 << 31)] = 0
    keys: list[Annotated[str, Field(max_length=256)]] = Field(max_length=1024)
    segments: list[Segment] = Field(max_length=MAX_SEGMENTS)
    objects: Blob
    data_bytes: Size  # the end of the last segment: what the slot must hold at least
    digest: Annotated[str, Field(pattern=r"^blake3:[0-9a-f]{64}$")]
    # The objects blob's own digest: the blob is deserialized, so a restore checks the
    # private copy it loads from against this (``memory_load``).
    objects_digest: Annotated[str, Field(pattern=r"^blake3:[0-9a-f]{64}$")] | None = None
    signature: dict[str, str] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MemoryManifest:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        end = 0
        for i, seg in enumerate([*self.segments, self.objects]):
            if seg.offset % ALIGN or seg.offset < end:
                raise ValueError(f"segment {i} at {seg.offset}: unaligned or overlapping")
            end = seg.offset + seg.nbytes
        if end != self.data_bytes:
            raise ValueError(f"data_bytes {self.data_bytes} is not the segments' end {end}")
        return self


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_name(kind: str, rank: int, slot: str, ext: str) -> str:
    """``own-r3-a.bin`` and its manifest ``own-r3-a.json``."""
    assert kind in KINDS and slot in SLOTS and ext in ("bin", "json")
    return f"{kind}-r{rank}-{slot}.{ext}"


def parse_slot_name(name: str) -> tuple[str, int, str, str] | None:
    """(kind, rank, slot, ext) of a slot file's name, or None for any other name."""
    m = _NAME.match(name)
    return (m.group(1), int(m.group(2)), m.group(3), m.group(4)) if m else None


def sign(manifest: dict[str, Any], trust: signing.Trust | bytes | None) -> dict[str, Any]:
    """``manifest`` signed with a key, or by the trust's key or signer (the node agent,
    which signs a memory copy only for the rank it names); unsigned with neither."""
    if isinstance(trust, bytes):
        return signing.sign(manifest, trust)
    if trust is not None and trust.can_sign:
        return trust.sign(manifest, "memory")
    return dict(manifest)


def encode(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, allow_nan=False).encode()


def parse_manifest(raw: bytes) -> MemoryManifest:
    """``raw`` (a manifest file's bytes) as a ``MemoryManifest``; ValueError names the
    problem. Never raises anything else, whatever the bytes."""
    try:
        data = readback.loads_object(raw, readback.MEMORY_MANIFEST)
    except readback.Unreadable as exc:
        raise ValueError(f"manifest is not one of ours: {exc}") from None
    try:
        return MemoryManifest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "manifest"
        raise ValueError(f"{where}: {err['msg']}"[:300]) from None


def check(m: MemoryManifest, *, trust: signing.Trust | None, job: str,
          config_hash: str | None, rank: int, world_size: int,
          capacity: int) -> str | None:
    """Why the copy ``m`` may not be restored by ``rank`` of this job (None: it may, once
    its digest verifies): the signature, then the job, rank, world layout and size."""
    raw = m.model_dump(mode="json", exclude_none=True)
    if trust is not None:
        outcome, message = trust.check(raw)
        if outcome != signing.SIGNED and not (outcome == signing.UNSIGNED
                                              and trust.trust_unsigned):
            return message
    if m.job != job:
        return f"written by job {m.job!r}, not {job!r}"
    if m.config_hash != config_hash:
        return f"config hash {m.config_hash} differs from this run's {config_hash}"
    if m.world_size != world_size:
        return f"world size {m.world_size}, this run has {world_size}"
    if m.rank != rank:
        return f"holds rank {m.rank}'s state, not rank {rank}'s"
    if m.data_bytes > capacity:
        return f"{m.data_bytes} bytes of data in a slot of {capacity}"
    return None


def flatten(tree: Any, tensors: list[Any], is_tensor: Any) -> Any:
    """``tree`` with each tensor replaced by ``{MARKER: i}`` (``tensors[i]`` is it)."""
    if is_tensor(tree):
        tensors.append(tree)
        return {MARKER: len(tensors) - 1}
    if isinstance(tree, dict):
        return {k: flatten(v, tensors, is_tensor) for k, v in tree.items()}
    if isinstance(tree, list):
        return [flatten(v, tensors, is_tensor) for v in tree]
    if isinstance(tree, tuple):
        return tuple(flatten(v, tensors, is_tensor) for v in tree)
    return tree


def is_marker(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and MARKER in value \
        and isinstance(value[MARKER], int) and not isinstance(value[MARKER], bool)


def unflatten(tree: Any, template: Any, fill: Any, path: str = "") -> Any:
    """``tree`` with each marker replaced by ``fill(i, template leaf at the same place,
    path)``; raises ValueError where the template has no tensor there."""
    if is_marker(tree):
        return fill(tree[MARKER], template, path)
    if isinstance(tree, dict):
        sub = template if isinstance(template, dict) else {}
        return {k: unflatten(v, sub.get(k), fill, f"{path}.{k}") for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        sub = template if isinstance(template, list | tuple) else []
        out = [unflatten(v, sub[i] if i < len(sub) else None, fill, f"{path}[{i}]")
               for i, v in enumerate(tree)]
        return tuple(out) if isinstance(tree, tuple) else out
    return tree
