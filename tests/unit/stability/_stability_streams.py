"""Deterministic synthetic step streams for the stability tests."""

from __future__ import annotations

from stability.records import StepRecord


def noise(i: int, scale: float = 0.001) -> float:
    """Tiny deterministic noise in [0, 4 * scale], period 5."""
    return scale * ((7 * i) % 5)


def steady_grads(n: int, base: float = 1.0, **overrides: float) -> list[float]:
    """``n`` grad norms at ``base`` plus noise; ``overrides`` maps "s<step>" to a fixed value."""
    values = [base + noise(i) for i in range(n)]
    for key, value in overrides.items():
        values[int(key[1:])] = value
    return values


def records(grads: list[float | None], losses: list[float] | None = None) -> list[StepRecord]:
    """Records with the given grad norms and a steady (noisy) loss around 2.0."""
    losses = losses or [2.0 + noise(i, 0.01) for i in range(len(grads))]
    return [StepRecord(step=i, loss=losses[i], grad_norm=g) for i, g in enumerate(grads)]
