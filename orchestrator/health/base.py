"""The health-check framework's data types: what a check is and what it reports.

A ``Check`` is a declaration (name, severity, level, timeout, where it runs); node checks
name their function as ``"module:function"`` so the catalog can be read (by the metrics, the
CLI, the config validator) without importing anything a check needs. A check function takes
the node's ``NodeContext`` and returns an ``Outcome``; the runner turns it into a
``CheckResult`` with the node, the level and the measured duration.

Severity decides what a failure does: ``fatal`` takes the node out of the job, ``warn`` is
reported (journal, metrics, table) and nothing else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Severity(str, enum.Enum):
    """What a failure of the check does to its node."""

    FATAL = "fatal"  # the node is excluded from the job
    WARN = "warn"  # reported only


class Level(str, enum.Enum):
    """How thorough a round of checks is. ``full`` runs every ``quick`` check and more."""

    QUICK = "quick"
    FULL = "full"

    def includes(self, other: Level) -> bool:
        return self is Level.FULL or other is Level.QUICK


# Where a check runs: on each node (in the agent's check process), on the supervisor (clock
# skew, the shared-filesystem cross-check, a node that never reported), or across every node
# at once (the network test's ranks).
Where = Literal["node", "head", "network"]


@dataclass(frozen=True)
class Check:
    """One check's declaration."""

    name: str
    severity: Severity
    level: Level
    timeout_s: float
    where: Where
    description: str
    fn: str | None = None  # "module:function" for node checks

    def runs_at(self, level: Level) -> bool:
        return level.includes(self.level)


@dataclass
class Outcome:
    """What a check function found: pass, fail or skip, a one-line message, numbers."""

    ok: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False


def passed(message: str, **details: Any) -> Outcome:
    return Outcome(True, message, details)


def failed(message: str, **details: Any) -> Outcome:
    return Outcome(False, message, details)


def skipped(message: str, **details: Any) -> Outcome:
    """The check does not apply on this node (no accelerator, a remote checkpoint root...)."""
    return Outcome(True, message, details, skipped=True)


class CheckResult(BaseModel):
    """One check's result on one node: what the journal, the metrics and the table show."""

    model_config = ConfigDict(extra="forbid")

    node_id: str
    check: str
    ok: bool
    severity: Severity
    message: str
    duration_s: float = Field(ge=0)
    level: Level
    skipped: bool = False
    details: dict[str, Any] = Field(default_factory=dict)

    @property
    def fatal_failure(self) -> bool:
        return not self.ok and self.severity is Severity.FATAL

    @classmethod
    def of(cls, check: Check, node_id: str, level: Level, outcome: Outcome,
           duration_s: float) -> CheckResult:
        return cls(node_id=node_id, check=check.name, ok=outcome.ok, severity=check.severity,
                   message=outcome.message, duration_s=round(max(duration_s, 0.0), 4),
                   level=level, skipped=outcome.skipped, details=outcome.details)


def describe_failures(results: list[CheckResult]) -> str:
    """``check: message; check: message`` for the fatal failures among ``results``."""
    return "; ".join(f"{r.check}: {r.message}" for r in results if r.fatal_failure)
