"""What every trainer config section shares: the base model and the error that names a field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class FieldError(ValueError):
    """A cross-field validation error that names the offending field.

    ``field`` is a dotted path relative to the model whose validator raised it; the config
    loader joins it to the model's own location so every message names a full dotted path.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              # NaN or infinity in a bound or a timeout disables it
                              allow_inf_nan=False)
