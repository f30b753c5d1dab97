"""Config schema and loading (YAML files plus dotted overrides)."""

from orchestrator.config.loader import (
    ConfigError,
    Problem,
    config_hash,
    default_config_path,
    load_config,
    validate_data,
)
from orchestrator.config.schema import Config

__all__ = [
    "Config",
    "ConfigError",
    "Problem",
    "config_hash",
    "default_config_path",
    "load_config",
    "validate_data",
]
