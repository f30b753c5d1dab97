"""The recorder: the one way anything the supervisor learns becomes a journal event.

It owns the journal, the job's fold (``JobView``) and the metrics that follow events: an
event is written (group-committed), folded into the view and into the metrics, in that
order, so what ``status`` reads back from the file is what the live supervisor saw.
Collaborators receive the recorder (or only its ``record``), never the supervisor.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.contracts.events import Envelope, Event
from orchestrator.journal.view import JobView
from orchestrator.journal.store import Journal
from orchestrator.supervisor.metrics import SupervisorMetrics


class Recorder:
    def __init__(self, journal: Journal, view: JobView, metrics: SupervisorMetrics,
                 guard: Callable[[], None] | None = None) -> None:
        self.journal = journal
        self.view = view
        self.metrics = metrics
        # Raises (or ends the process) once this supervisor may no longer write the journal:
        # a deposed leader (``leader.Leadership.check``).
        self.guard = guard

    def record(self, event: Event, *, durable: bool = False) -> Envelope:
        """Journal ``event`` (on disk before returning with ``durable``), fold it, count it."""
        if self.guard is not None:
            self.guard()
        env = self.journal.append(event, durable=durable)
        self.view.apply(env)
        self.metrics.on_event(env)
        return env
