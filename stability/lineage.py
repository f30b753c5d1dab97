"""One monitor over a whole run's step stream, across restarts and rollbacks.

A run's records arrive generation by generation (``steps.jsonl`` tags each with its
``generation``). After a restart the new generation redoes the steps after the checkpoint it
resumed from; after a rollback it redoes them on other data. ``LineageMonitor`` keeps the
detectors on the *lineage* the model weights are on:

- At each checkpoint step it keeps a snapshot of the monitor's state (bounded: the newest
  ``max_snapshots``), so when a generation's first record is step ``s`` after the stream had
  reached a later step, the monitor is reset to its snapshot at ``s - 1``, the checkpoint the
  generation resumed from (a fresh monitor when ``s - 1`` is 0). The redone steps are then fed
  like new ones: on a deterministic run they are the same values and fire the same rules; after
  a rollback they are the new data, which must be watched like any other.
- Without a snapshot at ``s - 1`` (a checkpoint older than the snapshots kept, or records that
  carry no checkpoint marker) the monitor keeps its state and ignores records up to the last
  step it saw, so it never consumes a step twice; ``lineage_gaps`` counts such joins.
- Within one generation a step at or below the last one seen is a duplicate and is ignored.

Pure and deterministic (no clock, no I/O): the live supervisor, a restarted supervisor replaying
``steps.jsonl`` and ``orchestrator stability replay`` reach the same state from the same lines.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from stability.config import StabilityConfig
from stability.events import Event
from stability.monitor import StabilityMonitor
from stability.records import StepRecord

_STATE_VERSION = 1

# A record carries this key on the steps whose checkpoint save it started (the trainer's
# blocking time of the save); other workers may instead save every ``checkpoint_every`` steps.
CHECKPOINT_MARKER = "ckpt_block_s"


class LineageMonitor:
    """A ``StabilityMonitor`` fed a run's records of every generation, in arrival order."""

    def __init__(self, config: StabilityConfig, *, checkpoint_every: int | None = None,
                 max_snapshots: int = 8, batch_memory: int = 1024) -> None:
        if max_snapshots < 1 or batch_memory < 1:
            raise ValueError("max_snapshots and batch_memory must be positive")
        self.config = config
        self.checkpoint_every = checkpoint_every
        self.max_snapshots = max_snapshots
        self.batch_memory = batch_memory
        self.monitor = StabilityMonitor(config)
        self.generation: int | None = None
        self.last_step: int | None = None
        self.lineage_gaps = 0
        self._snapshots: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._batches: OrderedDict[int, int] = OrderedDict()

    # -- feeding -------------------------------------------------------------------------------
    def feed(self, record: Mapping[str, Any], generation: int = 0) -> list[Event]:
        """Feed one raw step record (a parsed ``steps.jsonl`` line); returns its events.

        Raises ValueError on a record ``StepRecord.from_dict`` rejects (nothing is consumed).
        """
        rec = StepRecord.from_dict(dict(record))
        if generation != self.generation:
            self._join(generation, rec.step)
        if self.last_step is not None and rec.step <= self.last_step:
            return []
        events = self.monitor.update(rec)
        self.last_step = rec.step
        batch = record.get("batch")
        if isinstance(batch, int) and not isinstance(batch, bool):
            self._batches[rec.step] = batch
            while len(self._batches) > self.batch_memory:
                self._batches.popitem(last=False)
        if self._is_checkpoint_step(record, rec.step):
            self._snapshots[rec.step] = self.monitor.state_dict()
            while len(self._snapshots) > self.max_snapshots:
                self._snapshots.popitem(last=False)
        return events

    def _is_checkpoint_step(self, record: Mapping[str, Any], step: int) -> bool:
        if record.get(CHECKPOINT_MARKER) is not None:
            return True
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0

    def _join(self, generation: int, first_step: int) -> None:
        """A new generation's first record is ``first_step``: pick up its lineage."""
        self.generation = generation
        resume = first_step - 1
        if self.last_step is None or resume >= self.last_step:
            return  # it carries on where the stream stood (or past a gap in the records)
        if resume <= 0:
            self.reset()
            self.generation = generation
            return
        snapshot = self._snapshots.get(resume)
        if snapshot is None:
            self.lineage_gaps += 1  # keep the state; the duplicate rule skips the redone steps
            return
        self.monitor = StabilityMonitor(self.config)
        self.monitor.load_state_dict(snapshot)
        self.last_step = resume
        for step in [s for s in self._snapshots if s > resume]:
            del self._snapshots[step]
        for step in [s for s in self._batches if s > resume]:
            del self._batches[step]

    def reset(self) -> None:
        """Forget everything: a run starting from scratch."""
        self.monitor = StabilityMonitor(self.config)
        self.generation = None
        self.last_step = None
        self._snapshots.clear()
        self._batches.clear()

    # -- queries -----------------------------------------------------------------------------
    def batch_of(self, step: int) -> int | None:
        """The global batch index step ``step`` of the current lineage trained on, if known."""
        return self._batches.get(step)

    @staticmethod
    def onset_of(event: Event) -> int:
        """The step a problem began: a persistent spike's onset, else the event's own step."""
        onset = event.figures.get("onset_step")
        return int(onset) if isinstance(onset, int) else event.step

    @property
    def snapshot_steps(self) -> list[int]:
        return list(self._snapshots)

    def summary(self) -> dict[str, Any]:
        """The monitor's summary plus where the lineage stands."""
        return {**self.monitor.summary(), "generation": self.generation,
                "lineage_gaps": self.lineage_gaps}

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data (strict), bounded by ``max_snapshots`` and ``batch_memory``."""
        return {
            "version": _STATE_VERSION,
            "generation": self.generation,
            "last_step": self.last_step,
            "lineage_gaps": self.lineage_gaps,
            "monitor": self.monitor.state_dict(),
            "snapshots": [[step, state] for step, state in self._snapshots.items()],
            "batches": [[step, batch] for step, batch in self._batches.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a config edited in between is taken as the monitor's)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"lineage state version {state.get('version')!r} is not {_STATE_VERSION}")
        monitor = StabilityMonitor(self.config)
        monitor.load_state_dict(state["monitor"])
        self.monitor = monitor
        self.generation = state["generation"]
        self.last_step = state["last_step"]
        self.lineage_gaps = int(state.get("lineage_gaps", 0))
        self._snapshots = OrderedDict((int(s), st) for s, st in state["snapshots"])
        while len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)
        self._batches = OrderedDict((int(s), int(b)) for s, b in state["batches"])
