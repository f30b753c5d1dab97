"""Turn text and JSONL files into packed token shards (numpy only: the supervisor runs this).

Layout of a prepared dataset directory::

    index.json          {"version": 1, "tokenizer": {...}, "dtype": "uint16", "shards": [...],
                         "total_tokens": N, "documents": D, "sources": {...}, ...}
    shard-00000.bin     raw little-endian token ids, ``shard_tokens`` of them (the last shard
    shard-00001.bin     may be shorter)

Every document is encoded and followed by the tokenizer's EOS id; documents are concatenated
into one stream with no padding (packing), and the stream is cut into fixed-size shards. The
directory is built under a temporary name beside ``out_dir`` and renamed into place at the
end, so a half-written dataset is never visible under ``out_dir``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.contracts.rundir import is_remote
from trainer.tokenizer import load_tokenizer

__all__ = ["INDEX_NAME", "INDEX_VERSION", "shard_name", "token_dtype", "stdlib_sources",
           "resolve_sources", "read_index", "prepare_dataset", "local_path", "ensure_dataset",
           "default_max_bytes"]

INDEX_NAME = "index.json"
INDEX_VERSION = 1
DEFAULT_MAX_BYTES = 8 * 2**20
# Directories of the standard library that are not its own library code: installed
# packages, and test suites / IDLE, which are large and unlike ordinary source.
_STDLIB_EXCLUDED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                              "__pycache__"})
_SOURCE_NAMES_KEPT = 10  # the index names this many sources, then only counts the rest
_PROGRESS_EVERY = 1 << 20  # bytes between progress calls inside one large file

Progress = Callable[[int, int], None]


def shard_name(i: int) -> str:
    """File name of shard ``i``."""
    return f"shard-{i:05d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size < 65536 else np.dtype("<u4")


def stdlib_sources(max_bytes: int) -> list[Path]:
    """The standard library's own ``.py`` files, sorted by relative path, total <= max_bytes.

    Files are taken in sorted order until the next one would pass ``max_bytes`` (a prefix, so
    a larger cap always gives a superset). Installed packages, test suites and IDLE are left out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages, which can be far larger.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED]
        rel_dir = Path(dirpath).relative_to(root)
        rel_paths.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    chosen: list[Path] = []
    total = 0
    for rel in sorted(rel_paths):
        path = root / rel
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def resolve_sources(sources: Sequence[str | Path]) -> list[Path]:
    """Expand ``~`` and globs (``**`` recurses); each entry must match at least one file."""
    resolved: list[Path] = []
    for source in sources:
        pattern = os.path.expanduser(str(source))
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"source pattern {source!r} matches no files")
            resolved.extend(Path(m) for m in matches)
        elif os.path.isdir(pattern):
            raise IsADirectoryError(
                f"source {source!r} is a directory; name files or a glob such as "
                f"'{pattern.rstrip('/')}/**/*.txt'"
            )
        elif not os.path.isfile(pattern):
            raise FileNotFoundError(f"source file not found: {source}")
        else:
            resolved.append(Path(pattern))
    return resolved


def _documents(path: Path) -> Iterator[tuple[str, int]]:
    """(text, bytes read) per document: one per JSONL line ("text" field), else one per file."""
    if path.suffix != ".jsonl":
        raw = path.read_bytes()
        yield raw.decode("utf-8", errors="replace"), len(raw)
        return
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' "
                                 "field")
            yield record["text"], len(raw)


def read_index(out_dir: str | Path) -> dict[str, Any] | None:
    """The index of a complete local dataset in ``out_dir``, or None when there is none.

    Complete means: index.json parses, has this version, and every shard file exists with the
    recorded size.
    """
    directory = Path(out_dir).expanduser()
    try:
        index = json.loads((directory / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("version") != INDEX_VERSION:
        return None
    try:
        for shard in index["shards"]:
            if (directory / shard["name"]).stat().st_size != shard["bytes"]:
                return None
    except (OSError, KeyError, TypeError):
        return None
    return index


class _ShardWriter:
    """Cuts a token stream into files of exactly ``shard_tokens`` tokens (the last shorter)."""

    def __init__(self, directory: Path, shard_tokens: int, dtype: np.dtype) -> None:
        self.directory = directory
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self.shards: list[dict[str, Any]] = []
        self.total = 0
        self._pending: list[np.ndarray] = []
        self._pending_len = 0

    def add(self, tokens: np.ndarray) -> None:
        self._pending.append(tokens.astype(self.dtype, copy=False))
        self._pending_len += len(tokens)
        if self._pending_len >= self.shard_tokens:
            stream = np.concatenate(self._pending)
            n_full = len(stream) // self.shard_tokens
            for i in range(n_full):
                self._write(stream[i * self.shard_tokens:(i + 1) * self.shard_tokens])
            rest = stream[n_full * self.shard_tokens:]
            self._pending = [rest] if len(rest) else []
            self._pending_len = len(rest)

    def close(self) -> None:
        if self._pending_len:
            self._write(np.concatenate(self._pending))
        self._pending, self._pending_len = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        name = shard_name(len(self.shards))
        with open(self.directory / name, "wb") as f:
            f.write(np.ascontiguousarray(tokens).tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.shards.append({"name": name, "tokens": int(len(tokens)),
                            "bytes": int(tokens.nbytes)})
        self.total += len(tokens)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_max_bytes(sources: Sequence[str | Path] | str) -> int | None:
    """The cap when none is given: a sample of the standard library (8 MiB), every byte of
    files the operator names (a cap that drops their data must be asked for)."""
    return DEFAULT_MAX_BYTES if isinstance(sources, str) else None


def prepare_dataset(sources: Sequence[str | Path] | str, out_dir: str | Path,
                    tokenizer_spec: str = "byte", shard_tokens: int = 1 << 20,
                    max_bytes: int | None = DEFAULT_MAX_BYTES,
                    progress: Progress | None = None) -> dict[str, Any]:
    """Prepare token shards in local ``out_dir`` and return the index (see the module doc).

    ``sources`` is ``"stdlib"`` or a list of files / globs; ``.jsonl`` files give one document
    per line from the "text" field. At most ``max_bytes`` of source text is read (None: no
    cap): documents past the cap are left out and the index records ``"truncated": true`` and
    what was left out (``left_out_bytes``; ``left_out_files``: named files left out in
    whole or in part). When
    ``out_dir`` already holds a complete dataset of the same tokenizer it is returned without
    work. ``progress(done_bytes, total_bytes)`` is called as files are read.
    """
    if max_bytes is None:
        max_bytes = 1 << 62
    if shard_tokens <= 0 or max_bytes <= 0:
        raise ValueError("shard_tokens and max_bytes must be positive")
    out = Path(out_dir).expanduser()
    tokenizer = load_tokenizer(tokenizer_spec)
    described = tokenizer.describe()
    existing = read_index(out)
    if existing is not None:
        if existing.get("tokenizer") != described:
            raise ValueError(f"{out} was prepared with tokenizer {existing.get('tokenizer')}, "
                             f"not {described}")
        return existing
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists but holds no complete dataset ({INDEX_NAME}); "
                              "remove it or choose another path")

    if isinstance(sources, str):
        if sources != "stdlib":
            raise ValueError(f"sources must be 'stdlib' or a list of paths, not {sources!r}")
        files = stdlib_sources(max_bytes)
        stdlib_root = Path(sysconfig.get_paths()["stdlib"])
        names = [p.relative_to(stdlib_root).as_posix() for p in files]
        kind = "stdlib"
    else:
        files = resolve_sources(sources)
        names = [str(p) for p in files]
        kind = "files"
    source_bytes = sum(p.stat().st_size for p in files)
    total_bytes = min(source_bytes, max_bytes)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        dtype = token_dtype(tokenizer.vocab_size)
        writer = _ShardWriter(tmp, shard_tokens, dtype)
        eos = np.array([tokenizer.eos_id], dtype=np.int64)
        done = documents = files_read = 0
        truncated = False
        last_report = 0
        first_too_big: tuple[Path, int] | None = None
        for path in files:
            files_read += 1
            for text, nbytes in _documents(path):
                if done + nbytes > max_bytes:
                    truncated = True
                    first_too_big = first_too_big or (path, nbytes)
                    break
                writer.add(np.concatenate([tokenizer.encode_array(text), eos]))
                documents += 1
                done += nbytes
                if progress is not None and done - last_report >= _PROGRESS_EVERY:
                    progress(min(done, total_bytes), total_bytes)
                    last_report = done
            if truncated:
                break
            if progress is not None:
                progress(min(done, total_bytes), total_bytes)
                last_report = done
        writer.close()
        if progress is not None:
            # The estimate counted blank JSONL lines and the cap; end the bar exactly full.
            progress(done, done)
        if documents == 0:
            where = f" (the first document, in {first_too_big[0]}, is {first_too_big[1]:,} " \
                    "bytes)" if first_too_big else ""
            raise ValueError(f"no documents fit in max_bytes={max_bytes:,} from {len(files)} "
                             f"source file(s){where}: raise the cap (data prepare "
                             "--max-bytes, trainer.data.prepare_max_bytes)")
        index = {
            "version": INDEX_VERSION,
            "tokenizer": described,
            "dtype": dtype.name,
            "shards": writer.shards,
            "total_tokens": int(writer.total),
            "documents": documents,
            "sources": {"kind": kind, "count": len(files), "names": names[:_SOURCE_NAMES_KEPT]},
            "source_bytes": done,
            "max_bytes": max_bytes,
            "truncated": truncated,
            "left_out_bytes": max(0, source_bytes - done) if truncated else 0,
            "left_out_files": len(files) - files_read + (1 if truncated else 0)
            if truncated and kind == "files" else 0,
        }
        # Written last inside the temporary directory: a directory with an index is complete.
        with open(tmp / INDEX_NAME, "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename cannot replace a non-empty directory
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process finished the same dataset first: use theirs.
            theirs = read_index(out)
            if theirs is None or theirs.get("tokenizer") != described:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return theirs
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def local_path(path: str) -> Path | None:
    """The local path of ``path``, or None for a remote fsspec URL (s3://, gs://, ...)."""
    if is_remote(path):
        return None
    return Path(path.removeprefix("file://")).expanduser()


def ensure_dataset(data_cfg: Any, progress: Any = None) -> str:
    """The path of a prepared dataset for ``data_cfg`` (a ``trainer.config.DataConfig``).

    Uses the shards at ``data_cfg.path`` when its index.json exists; otherwise prepares them
    there from ``data_cfg.prepare_from`` (local paths only). Raises FileNotFoundError when there
    is nothing to use or prepare, and ValueError when the shards were made with a tokenizer
    other than ``data_cfg.tokenizer``.
    """
    expected = load_tokenizer(data_cfg.tokenizer).describe()
    local = local_path(data_cfg.path)
    if local is None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(data_cfg.path)
        if not fs.exists(f"{root.rstrip('/')}/{INDEX_NAME}"):
            raise FileNotFoundError(
                f"no prepared dataset at {data_cfg.path} ({INDEX_NAME} missing); datasets are "
                "only prepared on local paths: prepare one locally and upload the directory"
            )
        with fs.open(f"{root.rstrip('/')}/{INDEX_NAME}", "r") as f:
            found = json.load(f).get("tokenizer")
        path = data_cfg.path
    else:
        index = read_index(local)
        if index is None:
            if data_cfg.prepare_from is None:
                raise FileNotFoundError(
                    f"no prepared dataset at {local} ({INDEX_NAME} missing) and "
                    "data.prepare_from is null; set data.prepare_from or prepare the shards"
                )
            cap = data_cfg.prepare_max_bytes or default_max_bytes(data_cfg.prepare_from)
            index = prepare_dataset(data_cfg.prepare_from, local, data_cfg.tokenizer,
                                    max_bytes=cap, progress=progress)
        found = index["tokenizer"]
        path = str(local)
    if found != expected:
        raise ValueError(f"dataset {data_cfg.path} was prepared with tokenizer {found}, but "
                         f"data.tokenizer gives {expected}")
    return path
