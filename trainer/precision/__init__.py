"""Numerics beyond the dtype choice: FP8 training (``trainer.precision.fp8``)."""
