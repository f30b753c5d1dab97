"""One training step as the stability detectors see it."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any

from stability._floats import decode_float, encode_float

_OPTIONAL_FLOATS = ("grad_norm", "param_norm", "lr", "step_time")


def _decode_int(value: Any, name: str) -> int:
    # JSON writers sometimes emit 12.0 for 12; accept integral floats, reject 12.5 and True.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    as_float = float(value)
    if not as_float.is_integer():
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    return int(as_float)


@dataclass(frozen=True)
class StepRecord:
    """What the worker reports for one optimizer step.

    ``loss`` and ``grad_norm`` are the globally reduced values (the same on every rank).
    ``grad_norm`` is the total L2 norm before clipping, ``param_norm`` the total L2 norm of the
    parameters; both are optional because not every step measures them. Non-finite floats are
    kept as they are: detecting them is the point.
    """

    step: int
    loss: float
    grad_norm: float | None = None
    param_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    step_time: float | None = None

    def __post_init__(self) -> None:
        # Normalise ints, numpy scalars and 0-d tensors to Python floats, so figures copied from
        # a record always serialise the same way.
        object.__setattr__(self, "step", int(self.step))
        object.__setattr__(self, "loss", float(self.loss))
        for name in _OPTIONAL_FLOATS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, float(value))
        if self.tokens is not None:
            object.__setattr__(self, "tokens", int(self.tokens))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        """Build from a mapping such as one parsed JSONL line.

        ``step`` and ``loss`` are required. Optional keys may be missing or null; keys this class
        does not know are ignored (records carry other metrics too). Floats may be numbers or the
        strings ``"nan"``, ``"inf"``, ``"-inf"``. Raises ValueError naming the offending key.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a step record must be a JSON object, got {type(data).__name__}")
        for key in ("step", "loss"):
            if data.get(key) is None:
                raise ValueError(f"step record lacks required key {key!r}")
        kwargs: dict[str, Any] = {
            "step": _decode_int(data["step"], "step"),
            "loss": decode_float(data["loss"], "loss"),
        }
        for key in _OPTIONAL_FLOATS:
            if data.get(key) is not None:
                kwargs[key] = decode_float(data[key], key)
        if data.get("tokens") is not None:
            kwargs["tokens"] = _decode_int(data["tokens"], "tokens")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe mapping: unset optional fields are left out, non-finite floats are strings."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = encode_float(value) if isinstance(value, float) else value
        return out
