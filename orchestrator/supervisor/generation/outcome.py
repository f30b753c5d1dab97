"""Values the supervisor's state handlers return and raise: how a generation ended."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from orchestrator.contracts.state import Cause


@dataclass
class Outcome:
    """How a generation ended: ``cause`` and the facts behind it."""

    cause: Cause
    detail: dict[str, Any]


class JobFailed(Exception):
    """The job cannot go on (not enough nodes, budget spent): FAILED with this reason."""

    def __init__(self, reason: str, cause: Cause | None = None) -> None:
        super().__init__(reason)
        self.cause = cause


_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:\s*)+")
# A reason quotes at most this much of a log line (the log tail has all of it).
_REASON_MAX = 300


def exit_reason(exit_info: dict[str, Any]) -> str | None:
    """Why a rank exited, in one line: its error file's message (or a spawn's OS error),
    else, for an exit code, the last line it wrote (a traceback's last line: the exception;
    the preload hook's "failed: ModuleNotFoundError ..."). None for a signal with no error
    file: its last line is whatever it was doing when killed, not a reason."""
    error = exit_info.get("error")
    if error:
        return " ".join(str(error).split())[:_REASON_MAX]
    if exit_info.get("signal") or not exit_info.get("exit_code"):
        return None
    for line in reversed(exit_info.get("log_tail") or []):
        text = _RANK_PREFIX.sub("", str(line)).strip()
        if text and not text.startswith("===="):
            return text[:_REASON_MAX]
    return None
