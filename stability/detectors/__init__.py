"""One detector per rule; each consumes ``StepRecord``s and returns ``Event``s."""

from stability.detectors.base import Detector
from stability.detectors.grad_spike import GradSpikeDetector
from stability.detectors.growth import GrowthDetector
from stability.detectors.loss import LossSpikeDetector, NonFiniteDetector
from stability.detectors.param_norm import ParamNormDetector
from stability.detectors.persistent import PersistentSpikeDetector

__all__ = [
    "Detector",
    "GradSpikeDetector",
    "GrowthDetector",
    "LossSpikeDetector",
    "NonFiniteDetector",
    "ParamNormDetector",
    "PersistentSpikeDetector",
]
