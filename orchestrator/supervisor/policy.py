"""Restart policy: exponential backoff (tenacity), a restart budget, and the no-progress rule.

The budget and the no-progress count come from the journal (through ``JobView``), so they
survive a supervisor restart. The backoff grows with restarts in a row that made no
committed progress and falls back to the initial delay once a new checkpoint lands: a job
that fails once a day should not wait minutes because it failed five times last week. The
first failure in ``backoff_window_s`` (none other that close before it, by the journal's
timestamps) restarts at once: backing off protects against a failure storm, and one failure
is not a storm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace

from tenacity import wait_exponential

from orchestrator.config.schema import RestartConfig
from orchestrator.journal.view import JobView
from orchestrator.contracts.state import Cause
from orchestrator.supervisor.generation.outcome import exit_reason


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float
    reason: str


class OperatorStop(Exception):
    """The operator asked the job to stop."""


class RestartPolicy:
    def __init__(self, cfg: RestartConfig) -> None:
        self.cfg = cfg
        self._wait = wait_exponential(multiplier=cfg.backoff_initial_s,
                                      exp_base=cfg.backoff_multiplier,
                                      min=cfg.backoff_initial_s, max=cfg.backoff_max_s)

    def backoff(self, restarts_in_a_row: int) -> float:
        """Delay before the next launch; ``restarts_in_a_row`` >= 1."""
        # tenacity's wait strategies read only ``attempt_number`` from the retry state.
        return float(self._wait(SimpleNamespace(attempt_number=max(1, restarts_in_a_row))))

    def decide(self, view: JobView) -> Decision:
        """After a failure has been recorded in ``view``: restart, or give up and why."""
        config = repeated_before_first_step(view)
        if config:
            return Decision(False, 0.0, config)
        restarts = len(view.restarts)
        if restarts >= self.cfg.max_restarts:
            return Decision(False, 0.0,
                            f"restart budget spent ({restarts} of {self.cfg.max_restarts})")
        stalled = view.restarts_without_progress()
        # ``stalled`` counts failures; the first of them is the generation before any
        # restart, so N restarts without progress mean N + 1 such failures.
        if stalled > self.cfg.max_restarts_without_progress:
            return Decision(False, 0.0,
                            f"{stalled - 1} restarts in a row made no committed progress")
        return Decision(True, self.delay(view, stalled), "restart")

    def delay(self, view: JobView, stalled: int) -> float:
        """The newest failure's wait: none when it is the first in ``backoff_window_s``,
        else the backoff for ``stalled`` restarts in a row without progress."""
        window = self.cfg.backoff_window_s
        failures = view.failures
        newest = failures[-1].get("ts") if failures else None
        if window > 0 and isinstance(newest, int | float) and not any(
                isinstance(f.get("ts"), int | float) and newest - f["ts"] <= window
                for f in failures[:-1]):
            return 0.0
        return self.backoff(stalled)


def repeated_before_first_step(view: JobView) -> str | None:
    """A configuration error, not bad luck: the two newest failures, of consecutive
    generations, both came before their generation's first step, with the same exit and the
    same reason (``exit_reason``: an error file, a traceback's last line). A restart cannot
    fix it (a module the ranks cannot import, a script that raises at start); the restart
    budget would only repeat it. Signals and exits without a reason never match."""
    failures = view.failures
    if len(failures) < 2:
        return None
    before, newest = failures[-2], failures[-1]
    gens = before.get("generation"), newest.get("generation")
    if None in gens or gens[1] != gens[0] + 1 or any(g in view.first_steps for g in gens):
        return None
    sig = _signature(newest)
    if sig is None or sig != _signature(before):
        return None
    return (f"configuration error: generations {gens[0]} and {gens[1]} failed the same way "
            f"before their first step ({newest.get('message')}); fix the job's environment "
            "or config and start it again")


_NUMBER = re.compile(r"\d+")


def _signature(failure: dict) -> tuple | None:
    """(exit code, reason with its numbers blanked): a log line's time, a pid or a port
    differ between two runs of the same error."""
    if failure.get("cause") != Cause.WORKER_EXIT.value:
        return None
    reason = exit_reason(failure)
    return None if reason is None else (failure.get("exit_code"), _NUMBER.sub("#", reason))
