"""What the supervisor's collaborators share, passed to them instead of the supervisor.

Intake, the stability hook, the health coordinator and the API server each receive a
``JobContext`` (and the few other collaborators they talk to, as arguments), so none of
them imports the supervisor and each can be built alone in a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.clock import Clock
from orchestrator.config import Config
from orchestrator.contracts.events import Envelope, Event
from orchestrator.journal.view import JobView
from orchestrator.contracts.rundir import RunDir
from orchestrator.supervisor.metrics import SupervisorMetrics
from orchestrator.supervisor.recorder import Recorder


@dataclass
class JobContext:
    cfg: Config
    rundir: RunDir
    clock: Clock
    recorder: Recorder
    log: Any  # a structlog logger
    checkpoint_root: str

    def record(self, event: Event, *, durable: bool = False) -> Envelope:
        return self.recorder.record(event, durable=durable)

    @property
    def view(self) -> JobView:
        """The job as journaled so far (read it; only ``record`` changes it)."""
        return self.recorder.view

    @property
    def metrics(self) -> SupervisorMetrics:
        return self.recorder.metrics
