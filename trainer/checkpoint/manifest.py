"""Reading a step's ``manifest.json`` back: bounded bytes, bounded JSON, then its type.

A manifest is ours when we wrote it, but the checkpoint store is writable by more than us: a
key-less writer planted ``step-09999999/manifest.json`` holding 100,000 nested ``[`` (a
RecursionError) or a 5,000-digit integer (a ValueError the reader did not catch), and rank 0
crash-looped on it while ``checkpoints list/verify/prune`` printed tracebacks. Here every
manifest is read with the bounded reader (``orchestrator.contracts.readback``) and checked against
``Manifest``, the fields the readers use, with types and ranges; what fails is a problem
naming the manifest (the checkpoint is skipped), never an exception.

The dict handed back is the one read, unchanged: the signature covers its canonical JSON
(``signing.canonical``), extra meta of a newer writer included.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.contracts import readback

NAME = "manifest.json"
MAX_FILES = 1_000_000

Count = Annotated[int, Field(ge=0, le=1 << 62)]
Step = Annotated[int, Field(ge=0, le=1 << 53)]


class FileEntry(BaseModel):
    """One file's size and digests (which digests: the manifest's format says)."""

    model_config = ConfigDict(extra="allow", strict=True)

    size: Count
    blake3: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    xxh3_64: Annotated[str, Field(max_length=32)] | Count | None = None
    crc32: Count | None = None


class Manifest(BaseModel):
    """What a manifest's readers use (``layout``, ``store``, the restore and the export)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    format: Annotated[str, Field(max_length=64)] | None = None
    checksum: Annotated[str, Field(max_length=32)] | None = None
    step: Step | None = None
    tokens: Count | None = None
    world_size: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    created: Annotated[float, Field(ge=0, le=1.7e10)] | None = None
    files: dict[Annotated[str, Field(max_length=4096)], FileEntry] = Field(
        max_length=MAX_FILES)
    model: dict[str, Any] | None = None
    finetune: dict[str, Any] | None = None
    writer: Annotated[str, Field(max_length=64)] | None = None
    config_hash: Annotated[str, Field(max_length=128)] | None = None
    signature: dict[str, Any] | None = None


def parse(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None), or (None, why it is not one) for bytes read from a manifest."""
    try:
        raw = readback.loads_object(data, readback.MANIFEST)
    except readback.Unreadable as exc:
        return None, f"{NAME}: missing or unreadable ({exc})"
    try:
        Manifest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "manifest"
        return None, f"{NAME}: {where}: {err['msg']}"[:300]
    return raw, None
