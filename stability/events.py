"""What a detector reports when one of its rules fires.

JSON convention: ``Event.to_dict()`` is strict-JSON safe. Non-finite figures (a NaN loss, an
infinite ratio) are written as the strings ``"nan"``, ``"inf"`` or ``"-inf"``, the same strings
``StepRecord.from_dict`` and ``Event.from_dict`` read back, so ``json.dumps(event.to_dict(),
allow_nan=False)`` never fails and a journal line round-trips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stability._floats import decode_float, encode_float

_RESERVED = ("kind", "step", "rule", "action")


@dataclass(frozen=True)
class Event:
    """One rule firing at one step.

    ``kind`` says what happened (``grad_spike``, ``grad_spike_end``, ``growth``,
    ``persistent_spike``, ``nonfinite``, ``loss_spike``, ``param_norm_jump``); ``rule`` is the
    dotted config path of the rule that fired (``grad_spike``, ``loss.spike``, ...), so an
    operator knows what to tune; ``action`` is what the orchestrator should do about it;
    ``figures`` are the numbers behind the decision (the value, the running mean, the threshold).
    """

    kind: str
    step: int
    rule: str
    action: str
    figures: dict[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clash = [k for k in self.figures if k in _RESERVED]
        if clash:
            raise ValueError(f"event figures may not use the reserved keys {clash}")
        # A private copy: the dataclass is frozen, the caller's dict is not.
        object.__setattr__(self, "figures", dict(self.figures))

    def to_dict(self) -> dict[str, Any]:
        """``{"kind", "step", "rule", "action", **figures}`` with non-finite floats as strings."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "step": self.step,
            "rule": self.rule,
            "action": self.action,
        }
        for key, value in self.figures.items():
            out[key] = encode_float(value) if isinstance(value, float) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        """Inverse of ``to_dict`` (figures that were ints stay ints)."""
        figures: dict[str, float | int] = {}
        for key, value in data.items():
            if key in _RESERVED:
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                figures[key] = value
            else:
                figures[key] = decode_float(value, key)
        return cls(
            kind=str(data["kind"]),
            step=int(data["step"]),
            rule=str(data["rule"]),
            action=str(data["action"]),
            figures=figures,
        )
