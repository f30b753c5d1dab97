"""Values the supervisor's state handlers return and raise: how a generation ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.state import Cause


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
