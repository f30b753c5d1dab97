"""JSON convention for non-finite floats, shared by records, events, summaries and state.

Strict JSON has no NaN or Infinity, and ``json.dumps`` would otherwise write the non-standard
tokens ``NaN``/``Infinity`` that other readers (jq, JavaScript dashboards) reject. A non-finite
float is therefore written as one of the strings ``"nan"``, ``"inf"`` or ``"-inf"``, and read back
from those strings (case-insensitive; ``"+inf"``, ``"infinity"`` and ``"-infinity"`` are accepted
too). The encoding round-trips: ``decode_float(encode_float(x))`` is ``x`` (NaN stays NaN).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

_SPECIAL: dict[str, float] = {
    "nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-inf": -math.inf,
    "-infinity": -math.inf,
}


def encode_float(value: float) -> float | str:
    """``value`` unchanged when finite, else ``"nan"``, ``"inf"`` or ``"-inf"``."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def decode_float(value: Any, name: str) -> float:
    """A float from a number or one of the non-finite strings; ValueError naming ``name``."""
    # bool is an int subclass; True as a loss is a producer bug, not the number 1.
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int too large for a float
            raise ValueError(f"{name}: {value!r} does not fit in a float") from None
    if isinstance(value, str) and value.strip().lower() in _SPECIAL:
        return _SPECIAL[value.strip().lower()]
    raise ValueError(f"{name}: expected a number or 'nan'/'inf'/'-inf', got {value!r}")


def json_safe(value: Any) -> Any:
    """A copy of ``value`` (dicts, lists, tuples, scalars) with non-finite floats encoded."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float):
        return encode_float(value)
    return value
