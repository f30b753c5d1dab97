"""Logging: structlog events, JSON lines to a file in the run directory, readable on a TTY.

Configured once by the entry point (never at import). Every sink passes through a redaction
step, so a token or key that reaches a log call by mistake is masked before it is written:
fields named like a secret are masked by key, and every secret value registered with
``redact`` (the job token, a node's credential) is masked wherever it appears, in a message,
a foreign library's line (aiohttp's bad-request line) or a traceback. Tracebacks are rendered
without local variables (a frame's locals hold request headers).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import structlog

_SECRET_KEY = re.compile(r"(token|secret|password|authorization|aws_access|aws_session)", re.I)


# Secret values of this process (logging is process-wide state by nature). Values shorter
# than this are not secrets worth the false positives.
_SECRET_VALUES: set[str] = set()
_MIN_SECRET_LEN = 8


def redact(value: str) -> None:
    """Mask ``value`` wherever it would appear in a log line from now on."""
    if len(value) >= _MIN_SECRET_LEN:
        _SECRET_VALUES.add(value)


def scrub(text: str) -> str:
    """``text`` with every registered secret value masked."""
    for secret in _SECRET_VALUES:
        if secret in text:
            text = text.replace(secret, "***")
    return text


def _scrub_value(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {k: _scrub_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub_value(v) for v in value]
    return value


def _redact(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for key in list(event_dict):
        if _SECRET_KEY.search(key):
            event_dict[key] = "***"
        elif _SECRET_VALUES:
            event_dict[key] = _scrub_value(event_dict[key])
    return event_dict


def configure_logging(
    log_file: Path | None = None,
    *,
    component: str = "supervisor",
    console: bool = True,
    level: str = "info",
) -> None:
    """Route structlog (and stdlib logging) to ``log_file`` as JSON and to stderr.

    The console renderer is colourful on a TTY and plain key=value otherwise (CI logs).
    """
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=False),
        _redact,
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(level.upper())
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.format_exc_info, _redact,
                        structlog.processors.JSONRenderer(default=str)],
            foreign_pre_chain=shared,
        ))
        root.addHandler(fh)
    if console:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        # Plain tracebacks, rendered before the secret scrub: the console
                        # renderer's rich tracebacks would print every frame's locals.
                        structlog.processors.format_exc_info, _redact,
                        structlog.dev.ConsoleRenderer(
                            colors=sys.stderr.isatty(), pad_event_to=30,
                            exception_formatter=structlog.dev.plain_traceback)],
            foreign_pre_chain=shared,
        ))
        root.addHandler(sh)
    # Third-party chatter (aiohttp access lines, asyncio debug) stays out of operator logs.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(component=component)


def get_logger(name: str = "orchestrator") -> Any:
    return structlog.get_logger(name)
