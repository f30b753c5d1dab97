"""Files inside a step directory, reached safely, and their digests.

Every file a checkpoint operation reads, writes or deletes is a regular file reached
component by component without following a symlink (``openat`` + ``O_NOFOLLOW``, then
``fstat`` to confirm the inode), and every manifest entry is a plain relative POSIX path
inside its step directory: anything else is ``Unsafe`` and named, never opened.
(``trainer.checkpoint.layout`` builds manifests and verifies checkpoints on top of this.)
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec
import xxhash

CHECKSUM = "blake3"
_CHUNK = 8 * 2**20
_BLAKE3_CHUNK = 16 * 2**20  # blake3 hashes a large buffer on its own threads
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """A filesystem whose paths are this machine's (symbolic links, devices, FIFOs exist)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)



def _show(name: Any) -> str:
    """An entry name fit to print: control characters escaped."""
    text = name if isinstance(name, str) else repr(name)
    return text if text.isprintable() else repr(text)


# -- containment ---------------------------------------------------------------------------
class Unsafe(Exception):
    """An entry that is not a regular file inside its step directory (the message names it)."""


def entry_problem(rel: Any) -> str | None:
    """Why ``rel`` cannot be a manifest entry (None: a relative POSIX path of plain names)."""
    if not isinstance(rel, str) or not rel:
        return f"{_show(rel)}: not a file name (not opened)"
    if rel.startswith("/"):
        return f"{_show(rel)}: an absolute path, outside the step directory (not opened)"
    if "\\" in rel or "\x00" in rel:
        return f"{_show(rel)}: backslash or NUL in a file name (not opened)"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return (f"{_show(rel)}: not a plain relative path inside the step directory "
                "('..', '.' or an empty component; not opened)")
    if len(rel) > 4096 or any(len(p.encode()) > 255 for p in rel.split("/")):
        return f"{_show(rel[:80])}...: name too long (not opened)"
    return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _link_note(name: str, dir_fd: int | None) -> str:
    try:
        return f" to {_show(os.readlink(name, dir_fd=dir_fd))}"
    except OSError:
        return ""


def step_dir_problem(path: str) -> str | None:
    """Why a local step directory cannot be read (a symbolic link, not a directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{posixpath.basename(path)}: missing"
    if stat.S_ISLNK(st.st_mode):
        return (f"{posixpath.basename(path)}: the step directory is a symbolic link"
                f"{_link_note(path, None)}: not followed")
    if not stat.S_ISDIR(st.st_mode):
        return f"{posixpath.basename(path)}: {_kind(st.st_mode)}, not a step directory"
    return None


class LocalStep:
    """A local step directory opened once; its entries reached with ``openat`` one component
    at a time, never through a symbolic link, and only when they are regular files."""

    def __init__(self, path: str) -> None:
        problem = step_dir_problem(path)
        if problem:
            raise Unsafe(problem)
        parent, name = os.path.split(os.path.abspath(path))
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            self.fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC,
                              dir_fd=pfd)
        except OSError as exc:
            raise Unsafe(f"{name}: cannot open the step directory without following a link "
                         f"({exc.strerror})") from None
        finally:
            os.close(pfd)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> LocalStep:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def _parent(self, rel: str) -> Iterator[tuple[int, str]]:
        """The directory fd holding ``rel``'s last component, reached without links."""
        parts = rel.split("/")
        fd, opened = self.fd, []
        try:
            for i, part in enumerate(parts[:-1]):
                where = "/".join(parts[:i + 1])
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    raise Unsafe(f"{_show(rel)}: missing") from None
                if not stat.S_ISDIR(st.st_mode):
                    raise Unsafe(f"{_show(rel)}: {_show(where)} is {_kind(st.st_mode)}"
                                 f"{_link_note(part, fd) if stat.S_ISLNK(st.st_mode) else ''}"
                                 ", not followed")
                fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC,
                             dir_fd=fd)
                opened.append(fd)
            yield fd, parts[-1]
        finally:
            for d in opened:
                os.close(d)

    def lstat(self, rel: str) -> os.stat_result:
        """``rel``'s status; ``Unsafe`` unless it is a regular file (nothing is opened)."""
        problem = entry_problem(rel)
        if problem:
            raise Unsafe(problem)
        with self._parent(rel) as (fd, name):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise Unsafe(f"{_show(rel)}: missing") from None
            if not stat.S_ISREG(st.st_mode):
                link = _link_note(name, fd) if stat.S_ISLNK(st.st_mode) else ""
                raise Unsafe(f"{_show(rel)}: {_kind(st.st_mode)}{link}, not a regular file "
                             "(not opened)")
            return st

    def open(self, rel: str) -> IO[bytes]:
        """``rel`` opened for reading: a regular file, the same one ``lstat`` saw."""
        problem = entry_problem(rel)
        if problem:
            raise Unsafe(problem)
        with self._parent(rel) as (fd, name):
            before = self.lstat(rel)
            try:
                f = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC,
                            dir_fd=fd)
            except OSError as exc:
                raise Unsafe(f"{_show(rel)}: cannot open without following a link "
                             f"({exc.strerror})") from None
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev,
                                                                      before.st_ino):
            os.close(f)
            raise Unsafe(f"{_show(rel)}: replaced while it was being opened")
        return os.fdopen(f, "rb")


def walk_local(path: str) -> list[str]:
    """Every file under a local step directory, relative to it; ``Unsafe`` for a symbolic
    link or anything that is not a regular file or a directory (never committed)."""
    problem = step_dir_problem(path)
    if problem:
        raise Unsafe(problem)
    out = []
    for base, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            full = os.path.join(base, name)
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                if stat.S_ISREG(st.st_mode):
                    out.append(os.path.relpath(full, path).replace(os.sep, "/"))
                continue
            raise Unsafe(f"{_show(os.path.relpath(full, path))}: {_kind(st.st_mode)}"
                         f"{_link_note(full, None) if stat.S_ISLNK(st.st_mode) else ''} "
                         "in the step directory")
    return sorted(out)


# -- digests -------------------------------------------------------------------------------
def _stream(factory: Callable[[], Any]) -> Callable[[IO[bytes]], str]:
    def digest(f: IO[bytes]) -> str:
        h = factory()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        return h.hexdigest()
    return digest


def _digest_blake3(f: IO[bytes]) -> str:
    """BLAKE3 of a file, streamed in 16 MiB chunks, each hashed on every core (the binding
    releases the GIL). Not memory-mapped: a file truncated meanwhile must be an error, not
    a SIGBUS that kills the process."""
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    buf = bytearray(_BLAKE3_CHUNK)
    view = memoryview(buf)
    readinto = getattr(f, "readinto", None)
    if readinto is None:
        while chunk := f.read(_BLAKE3_CHUNK):
            h.update(chunk)
        return h.hexdigest()
    while n := readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


def _digest_crc32(f: IO[bytes]) -> int:
    crc = 0
    while chunk := f.read(_CHUNK):
        crc = zlib.crc32(chunk, crc)
    return crc


# Preferred first: verification uses the first algorithm a manifest entry carries.
DIGESTS: dict[str, Callable[[IO[bytes]], Any]] = {
    "blake3": _digest_blake3, "sha256": _stream(hashlib.sha256),
    "xxh3_64": _stream(xxhash.xxh3_64), "crc32": _digest_crc32}


def file_digest(fs: fsspec.AbstractFileSystem, path: str, algorithm: str = CHECKSUM) -> Any:
    """Digest of a file by its full path (a local one is opened without following a link)."""
    if is_local(fs):
        with LocalStep(os.path.dirname(path)) as step, step.open(os.path.basename(path)) as f:
            return DIGESTS[algorithm](f)
    with fs.open(path, "rb") as f:
        return DIGESTS[algorithm](f)
