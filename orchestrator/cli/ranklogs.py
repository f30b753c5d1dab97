"""``orchestrator logs``: the ranks' output, prefixed like torchrun's ``[rank1]:``.

Each rank's log (``logs/rank-NNNNN.log``) holds every generation, each opened by a header line
written by the agent (``==== generation 2 rank 1 started 2026-11-22 18:07:29 ====``), so one
file followed from its end follows the rank across restarts; ``--all`` also picks up ranks
whose file appears later. ``--since`` keeps the lines of the generations started since then.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TextIO

_RANK_FILE = re.compile(r"^rank-(\d{1,9})\.log$")
_HEADER = re.compile(r"^==== generation (\d+) rank (\d+) started "
                     r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# A follower reads this much at most per file per poll, so one chatty rank cannot starve the
# others (the rest comes on the next poll).
_READ_MAX = 1 << 20
_POLL_S = 0.25


def parse_since(text: str, now: datetime) -> datetime:
    """``--since``: a duration back from now (``90s``, ``10m``, ``2h``, ``1d``) or a local time
    (``2026-11-22 18:07``, ``2026-11-22T18:07:29``). ValueError says what is accepted."""
    text = text.strip()
    m = _DURATION.match(text)
    if m:
        return now - timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--since {text!r}: give a duration (30s, 10m, 2h, 1d) or a local "
                         "time (2026-11-22 18:07)") from None


def rank_files(logs_dir: Path) -> dict[int, Path]:
    """Rank number -> its log file, for the files that are there now."""
    out: dict[int, Path] = {}
    try:
        entries = list(logs_dir.iterdir())
    except OSError:
        return out
    for path in entries:
        m = _RANK_FILE.match(path.name)
        if m and path.is_file():
            out[int(m.group(1))] = path
    return dict(sorted(out.items()))


@dataclass
class RankStream:
    """One rank's log, read in complete lines from ``offset``; ``since`` hides the lines of
    generations whose header is older."""

    rank: int
    path: Path
    since: datetime | None = None
    offset: int = 0
    _partial: bytes = b""
    _shown: bool = field(default=True)

    def __post_init__(self) -> None:
        self._shown = self.since is None

    def read(self, final: bool = False) -> list[str]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:  # truncated or replaced: start again
            self.offset, self._partial = 0, b""
        lines: list[bytes] = []
        if size > self.offset:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(min(size - self.offset, _READ_MAX))
            self.offset += len(chunk)
            *lines, self._partial = (self._partial + chunk).split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [text for raw in lines if (text := self._keep(raw.decode(errors="replace")))
                is not None]

    def _keep(self, line: str) -> str | None:
        header = _HEADER.match(line)
        if header and self.since is not None:
            try:
                started = datetime.strptime(header.group(3), "%Y-%m-%d %H:%M:%S")
            except ValueError:
                started = None
            self._shown = started is None or started >= self.since
        return line if self._shown else None


def prefix(rank: int, line: str) -> str:
    """``[rank1]: line``; a line torch already prefixed for this rank keeps its one prefix."""
    mark = f"[rank{rank}]:"
    return line if line.startswith(mark) else f"{mark} {line}"


@dataclass
class LogFollower:
    """The selected ranks' logs: ``ranks`` None means every rank, including later ones."""

    logs_dir: Path
    ranks: list[int] | None
    since: datetime | None = None
    streams: dict[int, RankStream] = field(default_factory=dict)

    def _discover(self) -> None:
        for rank, path in rank_files(self.logs_dir).items():
            if rank in self.streams or (self.ranks is not None and rank not in self.ranks):
                continue
            self.streams[rank] = RankStream(rank, path, self.since)
        if self.ranks is not None:  # a named rank whose file does not exist yet
            for rank in self.ranks:
                self.streams.setdefault(rank, RankStream(
                    rank, self.logs_dir / f"rank-{rank:05d}.log", self.since))

    def poll(self, final: bool = False) -> Iterator[str]:
        self._discover()
        for rank, stream in sorted(self.streams.items()):
            for line in stream.read(final):
                yield prefix(rank, line)


class _Generations:
    """One rank's lines so far, each with the generation its header opened, read lazily (a
    long job's logs are never held in memory at once)."""

    def __init__(self, stream: RankStream, final: bool) -> None:
        self.stream = stream
        self.final = final
        self.generation = 0
        self._lines: Iterator[str] = self._read()
        self._next: str | None = None
        self._advance()

    def _read(self) -> Iterator[str]:
        while lines := self.stream.read():
            yield from lines
        if self.final:  # a last line with no newline (a follower waits for the rest of it)
            yield from self.stream.read(final=True)

    def _advance(self) -> None:
        self._next = next(self._lines, None)
        header = _HEADER.match(self._next) if self._next is not None else None
        if header:
            self.generation = int(header.group(1))

    @property
    def next_generation(self) -> int | None:
        return None if self._next is None else self.generation

    def take(self, generation: int) -> Iterator[str]:
        """The lines of ``generation`` (up to the next generation's header)."""
        while self._next is not None and self.generation == generation:
            line = self._next
            self._advance()
            yield line


def _drain_by_generation(follower: LogFollower, out: TextIO, final: bool) -> int:
    """What the files hold now, generation by generation (every rank's lines of generation
    1, then of 2...): the files carry no time per line, and a restart is where the ranks'
    stories meet. Returns the number of lines printed."""
    follower._discover()
    ranks = {rank: _Generations(stream, final)
             for rank, stream in sorted(follower.streams.items())}
    printed = 0
    while True:
        pending = [g.next_generation for g in ranks.values() if g.next_generation is not None]
        if not pending:
            return printed
        generation = min(pending)
        for rank, lines in ranks.items():
            for line in lines.take(generation):
                out.write(prefix(rank, line) + "\n")
                printed += 1
        out.flush()


def show_logs(logs_dir: Path, ranks: list[int] | None, since: datetime | None, follow: bool,
              job_ended: Callable[[], bool], out: TextIO | None = None,
              sleep: Callable[[float], None] = time.sleep,
              err: TextIO | None = None) -> int:
    """Print the selected ranks' lines, generation by generation; with ``follow``, keep
    printing new ones as they come until the job has ended and its files are drained (or
    Ctrl-C). Returns the exit code: 1 when there was nothing to print and no following."""
    out = out or sys.stdout
    follower = LogFollower(logs_dir, ranks, since)
    try:
        printed = _drain_by_generation(follower, out, final=not follow)
        if not follow:
            if printed:
                return 0
            which = "any rank" if ranks is None else \
                "rank " + ", ".join(str(r) for r in ranks)
            (err or sys.stderr).write(f"no log lines of {which} in {logs_dir}"
                                      + (" since then" if since else "") + "\n")
            return 1
        while True:
            ended = job_ended()  # asked before the read, so the last lines are not missed
            _drain(follower, out, final=ended)
            if ended:
                return 0
            sleep(_POLL_S)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe(out)


def _drain(follower: LogFollower, out: TextIO, final: bool) -> None:
    while True:
        lines = list(follower.poll(final))
        out.writelines(line + "\n" for line in lines)
        out.flush()
        if not lines:
            return


def _quiet_broken_pipe(out: TextIO) -> int:
    """The reader went away (``| head``): stop without Python's "Broken pipe" message."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 0
