"""The training worker: model, data, optimizer and schedule, parallelism and checkpoints."""
