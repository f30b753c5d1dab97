"""What ``orchestrator up`` shows while the job runs, in each of its output modes.

- ``rich`` (a terminal): one live progress line at the bottom, short human lines above it for
  state changes, failures, restarts and stability warnings; the JSON log goes to the run dir.
- ``plain`` (stderr is not a terminal): the structured log as key=value lines, as before.
- ``json`` (systemd, Kubernetes): the structured log as JSON lines on stdout.

``--quiet`` keeps errors only (no progress line); ``--verbose`` adds every log line.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from orchestrator.cli.console import JobFollower, describe, progress_line
from orchestrator.textsafe import shown

# The progress line is redrawn this often; the journal and step files are read as often.
_REFRESH_S = 0.5
# Goodput needs the whole journal folded: recomputed this often, off the event loop.
_BOOKS_EVERY_S = 5.0
_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}


class LogFormat(str, enum.Enum):
    """How ``up`` writes to the console; ``auto`` is rich on a terminal, plain otherwise."""

    AUTO = "auto"
    RICH = "rich"
    PLAIN = "plain"
    JSON = "json"

    def resolve(self, stream: Any) -> LogFormat:
        if self is not LogFormat.AUTO:
            return self
        return LogFormat.RICH if stream.isatty() else LogFormat.PLAIN


class Verbosity(str, enum.Enum):
    QUIET = "quiet"
    NORMAL = "normal"
    VERBOSE = "verbose"


def setup_logging(log_file: Path, fmt: LogFormat, verbosity: Verbosity,
                  console: Console) -> None:
    """Configure the supervisor's logging for ``fmt`` (the JSON file in the run dir always)."""
    from orchestrator.logs import configure_logging

    level = "debug" if verbosity is Verbosity.VERBOSE else "info"
    if fmt is LogFormat.PLAIN and verbosity is not Verbosity.QUIET:
        configure_logging(log_file, component="supervisor", level=level)
        return
    configure_logging(log_file, component="supervisor", console=False, level=level)
    root = logging.getLogger()
    file_fmt = next((h.formatter for h in root.handlers if isinstance(h, logging.FileHandler)),
                    None)
    if fmt is LogFormat.JSON:
        # The same formatter (and so the same redaction) as the run dir's log file.
        handler: logging.Handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(file_fmt)  # type: ignore[arg-type]
        handler.setLevel(logging.WARNING if verbosity is Verbosity.QUIET else logging.NOTSET)
    else:
        handler = _ConsoleHandler(console)
        if verbosity is not Verbosity.VERBOSE:
            handler.setLevel(logging.ERROR)
            handler.addFilter(_unjournaled)
    root.addHandler(handler)


def _unjournaled(record: logging.LogRecord) -> bool:
    """Errors the journal's human lines do not already tell: exceptions (a traceback) and
    critical ones. A failed generation, say, is told once, by its journal line."""
    return record.levelno >= logging.CRITICAL or record.exc_info is not None


class _ConsoleHandler(logging.Handler):
    """Log records as structlog's console lines, printed through a rich console (above a live
    progress line). Only errors by default: the journal's human lines tell the rest."""

    def __init__(self, console: Console) -> None:
        import structlog

        super().__init__()
        self.console = console
        self.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        # Plain tracebacks: rich's show every frame's locals (a request's
                        # Authorization header among them).
                        structlog.dev.ConsoleRenderer(
                            colors=False, pad_event_to=30,
                            exception_formatter=structlog.dev.plain_traceback)]))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(shown(self.format(record)), markup=False, highlight=False,
                               soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


class ConsoleView:
    """Follows a run directory and draws it: human lines for events, a live progress line."""

    def __init__(self, root: Path, console: Console, verbosity: Verbosity,
                 clock: Any = time.time) -> None:
        self.follower = JobFollower(root)
        self.console = console
        self.verbosity = verbosity
        self.clock = clock
        self._live: Live | None = None
        self._books_at = float("-inf")

    def __enter__(self) -> ConsoleView:
        if self.verbosity is not Verbosity.QUIET:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4,
                              transient=True, redirect_stdout=False, redirect_stderr=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def step(self, goodput: float | None = None) -> None:
        """Read what is new, print its lines, redraw the progress line."""
        self.show(self.follower.poll(), goodput)

    def show(self, events: list[dict[str, Any]], goodput: float | None = None) -> None:
        """Print the lines of ``events`` (read by ``follower.poll``), redraw the progress line."""
        for event in events:
            self._print_event(event)
        if goodput is not None:
            self.follower.progress.goodput = goodput
        if self._live is not None:
            self._live.update(Text(progress_line(self.follower.progress, self.clock()),
                                   no_wrap=True, overflow="ellipsis"))

    def _print_event(self, event: dict[str, Any]) -> None:
        line = describe(event, verbose=self.verbosity is Verbosity.VERBOSE)
        if line is None:
            return
        level, message = line
        if self.verbosity is Verbosity.QUIET and level != "error":
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(event.get("ts") or self.clock())) \
            if isinstance(event.get("ts"), int | float) else "--:--:--"
        text = Text(f"{stamp} ")
        text.append(shown(message), style=_STYLE[level])
        self.console.print(text, soft_wrap=True)

    def goodput_due(self) -> bool:
        now = time.monotonic()
        if now - self._books_at < _BOOKS_EVERY_S:
            return False
        self._books_at = now
        return True


def _goodput(root: Path) -> float | None:
    from orchestrator.contracts.rundir import RunDir
    from orchestrator.journal.status import load_books

    try:
        return load_books(RunDir(root)).goodput
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a half-written run dir: show "-" until the next try


async def follow_job(view: ConsoleView, root: Path) -> None:
    """Redraw ``view`` until cancelled; the file reads run off the event loop."""
    while True:
        goodput = await asyncio.to_thread(_goodput, root) if view.goodput_due() else None
        view.show(await asyncio.to_thread(view.follower.poll), goodput)
        await asyncio.sleep(_REFRESH_S)
