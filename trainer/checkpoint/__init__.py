"""Checkpoints: layout, manifests, digests and containment (``layout``), the manifest's
signature and the job's key (``signing``), tiers and choosing what to restore (``store``),
the background S3 uploader (``upload``) with its retry policy (``retry``) — all torch-free,
so the CLI uses them too — and DCP save/restore (``checkpointer``)."""
