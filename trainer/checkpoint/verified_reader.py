"""Loading exactly the bytes that were verified: a DCP storage reader over a committed step.

A restore used to verify each file of the chosen checkpoint (rank 0, ``layout.verify``) and
then let DCP open the same paths again to load them. A process that can write the checkpoint
directory swapped DCP's ``.metadata`` (a pickle) in between, when the verifier closed it, and
its pickle ran in every rank. Here each file a rank loads is opened once, inside its step
directory without following a link (``layout.StepReader``: ``O_NOFOLLOW``, ``openat`` one
component at a time; a key under the step's prefix on an object store), read into memory,
and its size and digest are checked against the manifest rank 0 verified before a byte of it
is deserialized: what is checked is what is loaded. (A file is held in memory while DCP
takes its items from it: one file of one rank's shard at a time.)

DCP's ``.metadata`` is unpickled with an allow-list of DCP's own metadata types (as
``torch.load(weights_only=True)`` does for tensors), so even a pickle signed with the job's
key cannot run code: any other global is refused. Tensors and byte items load with
``weights_only=True`` (DCP's reader and ``SafeLoadPlanner``).
"""

from __future__ import annotations

import contextlib
import enum
import io
import pickle
from collections.abc import Iterator
from typing import Any

import fsspec
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trainer.checkpoint import layout

METADATA = ".metadata"
# Digests a loaded file is checked with, strongest first (format 1's are integrity only).
_ORDER = ("blake3", "sha256", "xxh3_64", "crc32")

_DCP = "torch.distributed.checkpoint.metadata"
# Every global a DCP ``.metadata`` pickle of torch 2.x names (found by unpickling real
# saves: FSDP2 and DDP states, byte items, every dtype), and nothing else.
ALLOWED_GLOBALS = frozenset({
    (_DCP, "Metadata"), (_DCP, "StorageMeta"), (_DCP, "MetadataIndex"),
    (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


# Every refusal of bytes that differ from what rank 0 verified says this (the copy was
# changed on disk: only it is rejected, not the checkpoint's other copies).
CHANGED = "changed since it was verified"


def changed_since_verified(problem: str) -> bool:
    return CHANGED in problem


class Refused(ValueError):
    """A checkpoint file that is not what its manifest says, or a pickle that names a
    global outside the allow-list: nothing of it was loaded."""


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr`` as some Python 3.11 releases (Debian bookworm's 3.11.2: the image) pickle
    an enum member (``getattr(cls, name)``), narrowed to a member of an allow-listed enum."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)
            and (cls.__module__, cls.__qualname__) in ALLOWED_GLOBALS):
        raise pickle.UnpicklingError(f"getattr on {cls!r}: only an allow-listed enum's member "
                                     "may be named by name")
    if not isinstance(name, str) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"{cls.__qualname__} has no member {name!r}")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in ALLOWED_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata types "
                                     "(refused: the metadata may name only those)")


def load_metadata(data: bytes) -> Metadata:
    """DCP's ``.metadata`` from its bytes, allow-listed (``Refused`` otherwise)."""
    try:
        obj = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle is one refusal
        raise Refused(f"{METADATA}: {type(exc).__name__}: {str(exc)[:300]}") from None
    if not isinstance(obj, Metadata):
        raise Refused(f"{METADATA}: holds a {type(obj).__name__}, not DCP's Metadata")
    return obj


class VerifiedFiles:
    """The files of one committed step, each read once and checked against ``manifest``."""

    def __init__(self, step_url: str, manifest: dict[str, Any],
                 fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.fs, self.path = layout.filesystem(step_url, fs)
        self.step_url = step_url
        files = manifest.get("files")
        self.entries: dict[str, dict[str, Any]] = files if isinstance(files, dict) else {}
        self.bytes_read = 0

    def read(self, rel: str) -> bytes:
        """``rel``'s bytes, once their size and digest match the manifest."""
        meta = self.entries.get(rel)
        if not isinstance(meta, dict) or not isinstance(meta.get("size"), int):
            raise Refused(f"{rel}: not in the manifest (not opened)")
        algorithm = next((a for a in _ORDER if a in meta), None)
        if algorithm is None:
            raise Refused(f"{rel}: no digest in the manifest to check it with (not opened)")
        size = meta["size"]
        try:
            with layout.StepReader(self.fs, self.path) as reader, reader.open(rel) as f:
                data = f.read(size + 1)
        except layout.Unsafe as exc:
            raise Refused(f"{exc} ({CHANGED})") from None
        except FileNotFoundError:
            raise Refused(f"{rel}: missing ({CHANGED})") from None
        if len(data) != size:
            raise Refused(f"{rel}: {len(data)} bytes{'+' if len(data) > size else ''}, "
                          f"the manifest says {size} ({CHANGED})")
        digest = layout.DIGESTS[algorithm](io.BytesIO(data))
        if digest != meta[algorithm]:
            raise Refused(f"{rel}: {algorithm} of the bytes read differs from the manifest "
                          f"({CHANGED}): not loaded")
        self.bytes_read += size
        return data


class _Streams:
    """The slice of DCP's ``FileSystemBase`` a reader uses, over ``VerifiedFiles``: a path
    is the entry's relative name, a stream the entry's verified bytes."""

    def __init__(self, files: VerifiedFiles) -> None:
        self.files = files

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.BytesIO]:
        if mode != "rb":
            raise Refused(f"{path}: a verified checkpoint is read only")
        yield io.BytesIO(self.files.read(str(path)))

    def concat_path(self, path: Any, suffix: str) -> str:
        return suffix  # entries are named relative to the step directory

    def init_path(self, path: Any) -> str:
        return ""

    def exists(self, path: Any) -> bool:
        return str(path) in self.files.entries


class VerifiedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose every file is a ``VerifiedFiles`` read (see the
    module). ``manifest`` is the one rank 0 verified (its signature and every digest)."""

    def __init__(self, step_url: str, manifest: dict[str, Any],
                 fs: fsspec.AbstractFileSystem | None = None) -> None:
        super().__init__("")
        self.files = VerifiedFiles(step_url, manifest, fs)
        self.fs = _Streams(self.files)  # type: ignore[assignment]
        self.path = ""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        metadata = load_metadata(self.files.read(name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never chosen for a path: built with its manifest
