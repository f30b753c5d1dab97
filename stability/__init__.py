"""Training-stability detection: grad-norm spikes, growth, non-finite values, loss spikes,
parameter-norm jumps, and the action each rule asks of the orchestrator.

Pure Python: nothing here imports torch except ``stability.norms``, which only the worker
imports explicitly.
"""

from stability.config import (
    GradSpikeConfig,
    GrowthConfig,
    LossConfig,
    LossSpikeConfig,
    NonFiniteConfig,
    ParamNormConfig,
    PersistentSpikeConfig,
    RollbackPolicy,
    StabilityConfig,
)
from stability.events import Event
from stability.lineage import LineageMonitor
from stability.monitor import ACTION_ORDER, SkipStepGuard, StabilityMonitor, worst_action
from stability.records import StepRecord
from stability.replay import read_jsonl, replay

__all__ = [
    "ACTION_ORDER",
    "Event",
    "GradSpikeConfig",
    "GrowthConfig",
    "LineageMonitor",
    "LossConfig",
    "LossSpikeConfig",
    "NonFiniteConfig",
    "ParamNormConfig",
    "PersistentSpikeConfig",
    "RollbackPolicy",
    "SkipStepGuard",
    "StabilityConfig",
    "StabilityMonitor",
    "StepRecord",
    "read_jsonl",
    "replay",
    "worst_action",
]
