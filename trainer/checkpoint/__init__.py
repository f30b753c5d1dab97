"""Checkpoints: layout and manifests (``layout``, no torch) and DCP save/restore
(``checkpointer``)."""
