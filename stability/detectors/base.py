"""The interface every detector implements."""

from __future__ import annotations

from typing import Any, Protocol

from stability.events import Event
from stability.records import StepRecord


class Detector(Protocol):
    """A rule over the stream of step records.

    ``update`` is called once per step, in step order, and returns the events of that step.
    ``state_dict`` is plain JSON-able data of bounded size (no growth with the stream length);
    ``load_state_dict`` on a fresh detector built from the same config continues the stream
    exactly as if it had never stopped. ``summary`` gives the detector's figures for operators.
    """

    name: str

    def update(self, rec: StepRecord) -> list[Event]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, Any]: ...
