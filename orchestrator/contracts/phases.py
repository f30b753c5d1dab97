"""The phases a rank reports (``Worker.set_phase``), and which of them keep its peers waiting.

The worker SDK checks a phase against these, the agent protocol types it with them and the
supervisor's hang detection reads them. Standard library only: the SDK imports it in every rank.
"""

from __future__ import annotations

from typing import Literal, get_args

# ``finishing``: past the last step (the final commit's wait, digests, teardown, exit), so the
# calibrated training timeout, which is a few step intervals, never judges a rank there.
Phase = Literal["init", "loading", "compiling", "training", "checkpointing", "evaluating",
                "finishing"]
PHASES: tuple[str, ...] = get_args(Phase)

# Phases in which a rank keeps its peers waiting for longer than a step, legitimately.
BUSY_PHASES: tuple[str, ...] = ("loading", "compiling", "checkpointing", "evaluating")
