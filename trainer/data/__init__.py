"""Token shards: preparing them from text (``prepare``) and reading them in order (``dataset``).

Nothing is imported here so that the supervisor can import ``trainer.data.prepare`` without
pulling in torch through ``trainer.data.dataset``.
"""
