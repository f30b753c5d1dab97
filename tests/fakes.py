"""Test doubles every unit test shares: one fake clock and a real job context around it.

``FakeClock`` is the clock the supervisor's parts take (``time``, ``monotonic``, ``sleep``):
time moves only when a test advances it (or awaits ``sleep``, which advances it at once),
so deadlines and timeouts are asserted exactly, on loop time in kopf's sense.
``make_intake`` wires an ``Intake`` as the supervisor does; ``begin_generation`` gives a
test that drives it the launch's ``Generation``. ``Box`` is a checkpointable part (a
``Stateful``) holding a dict of tensors and plain values.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from orchestrator.config import Config
from orchestrator.journal.view import JobView
from orchestrator.journal.store import Journal, read_journal
from orchestrator.contracts.rundir import RunDir
from orchestrator.supervisor.chaos import ChaosDesk
from orchestrator.supervisor.context import JobContext
from orchestrator.supervisor.generation.judge import Generation
from orchestrator.supervisor.generation.parts import GenerationParts
from orchestrator.supervisor.intake import Intake
from orchestrator.supervisor.metrics import SupervisorMetrics
from orchestrator.supervisor.nodes import NodeRegistry
from orchestrator.supervisor.recorder import Recorder
from orchestrator.supervisor.stability import StabilityHook
from orchestrator.supervisor.superseded import SupersededNodes


class FakeClock:
    """Wall and monotonic time that move only when told to."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)

    async def wait_for(self, aw: Any, timeout: float) -> Any:
        """What is ready now (after one turn of the loop) is returned; otherwise the clock
        jumps by ``timeout`` and TimeoutError is raised, as the real wait would end."""
        task = asyncio.ensure_future(aw)
        for _ in range(3):
            await asyncio.sleep(0)
            if task.done():
                return task.result()
        task.cancel()
        self.t += max(0.0, timeout)
        raise TimeoutError


class FakeLog:
    """A structlog-shaped logger that keeps its lines: (level, message, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str):
        return lambda msg, **kw: self.lines.append((level, msg, kw))


def make_context(root: Path, cfg: Config, clock: Any, log: Any = None,
                 registry: CollectorRegistry | None = None,
                 checkpoint_root: str | None = None) -> JobContext:
    """A JobContext over a real journal in ``root`` (folded from what it already holds)."""
    run = RunDir(root)
    journal = Journal(run.journal, clock=clock.time)
    metrics = SupervisorMetrics(registry or CollectorRegistry(), cfg.job.name)
    recorder = Recorder(journal, JobView.from_events(read_journal(run.journal)), metrics)
    return JobContext(cfg, run, clock, recorder, log or FakeLog(),
                      checkpoint_root or str(root / "checkpoints"))


def make_intake(ctx: JobContext, nodes: NodeRegistry,
                stability: StabilityHook | None = None) -> Intake:
    """An ``Intake`` wired as the supervisor wires it (its own chaos desk and superseded
    nodes), for tests that drive message intake; health reports go nowhere."""
    return Intake(ctx, nodes, stability or StabilityHook(ctx), lambda *a: None,
                  note_superseded=SupersededNodes(ctx, nodes).note,
                  chaos_fired=ChaosDesk(ctx, nodes).mark_fired)


def begin_generation(intake: Intake, number: int, world_size: int) -> Generation:
    """The ``Generation`` of a launch of ``number``, wired and begun as the supervisor's
    ``GenerationParts`` does it, for tests that drive an ``Intake`` without the loop."""
    parts = GenerationParts(intake.ctx, intake.nodes, intake.feed(), intake.stability,
                            asyncio.Event(), lambda state: None,
                            chaos=ChaosDesk(intake.ctx, intake.nodes),
                            superseded=SupersededNodes(intake.ctx, intake.nodes))
    return parts.begin(number, world_size)


class Box:
    """A Stateful holding a dict of tensors and plain values."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd
