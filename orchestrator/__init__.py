"""Fault-tolerant training orchestrator.

The supervisor side (everything here except ``orchestrator.worker``) never imports torch at
module load, so ``orchestrator up`` starts in well under a second.
"""

__version__ = "0.1.0"
