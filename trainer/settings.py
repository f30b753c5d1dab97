"""The worker's settings: its own config sections, from the orchestrator or a YAML file.

Under the orchestrator, the agent hands every rank the job's resolved config (JSON,
``ORCH_CONFIG``); under plain torchrun, ``--config FILE.yaml`` gives the same file the
orchestrator would read. Either way only the sections the worker owns are validated here
(the orchestrator validated the whole file before launching anything).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stability.config import StabilityConfig
from trainer.config import CheckpointConfig, TrainerConfig, check_sections


@dataclass(frozen=True)
class WorkerSettings:
    trainer: TrainerConfig
    checkpoint: CheckpointConfig
    stability: StabilityConfig
    job: str
    checkpoint_root: str
    config_hash: str


def _read(path: str) -> dict[str, Any]:
    """The config file, read as every config is (bounded: a damaged or hostile file is a
    ValueError naming the problem, not a traceback from deep in a parser)."""
    if path.endswith(".json"):
        from orchestrator.contracts import readback

        return readback.read_object(Path(path).expanduser(), readback.SMALL)
    from orchestrator.contracts.configfile import read_yaml

    return read_yaml(path)


def load_settings(config_path: str | None, job: str | None = None,
                  checkpoint_root: str | None = None) -> WorkerSettings:
    data = _read(config_path) if config_path else {}
    trainer = TrainerConfig.model_validate(data.get("trainer") or {})
    checkpoint = CheckpointConfig.model_validate(data.get("checkpoint") or {})
    stability = StabilityConfig.model_validate(data.get("stability") or {})
    check_sections(trainer, checkpoint, stability.rule_actions())
    job_name = job or (data.get("job") or {}).get("name") or "local"
    root = checkpoint_root or checkpoint.url or "checkpoints"
    # The hash covers what decides the shape of the state: a checkpoint of another model
    # or optimizer is flagged before DCP fails on it with a less helpful error.
    shape = {"model": trainer.model.model_dump(mode="json"),
             "optimizer": trainer.optimizer.name,
             "strategy": trainer.parallelism.strategy}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    return WorkerSettings(trainer, checkpoint, stability, job_name, root, digest)
