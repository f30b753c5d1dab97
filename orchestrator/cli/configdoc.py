"""``orchestrator config show`` / ``config schema`` / ``--version``: the config surface, read
from the pydantic model tree itself (descriptions and defaults are the schema's own)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

# Spellings the configs use (trainer.precision: bf16) accepted where the exporter wants
# torch's names.
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "f16": "float16", "half": "float16"}


def canonical_dtype(name: str) -> str:
    """``bf16`` -> ``bfloat16``; names the exporter knows pass through, others are left for it
    to refuse with its own message."""
    return _DTYPE_ALIASES.get(name.strip().lower(), name)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("orchestrator")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _default_of(info: Any) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        try:
            return info.default_factory()
        except TypeError:  # a factory that needs the validated data
            return None
    return PydanticUndefined


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "value") and isinstance(value.value, str | int):
        return value.value  # enums
    return value


# libyaml's safe dumper where PyYAML has it: one dump a field, ~1 ms each in pure Python.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _scalar(value: Any) -> str:
    """A value as one line of YAML (flow style for lists and maps)."""
    text = yaml.dump(_plain(value), Dumper=_DUMPER, default_flow_style=True,
                     width=10**6).strip()
    return text.removesuffix("...").strip()  # a lone scalar ends its document with "..."


def commented_yaml(model: BaseModel, indent: int = 0) -> list[str]:
    """YAML of ``model``'s values, each field preceded by a comment with its description and
    default (sections recurse; the default is left out where it equals the value)."""
    lines: list[str] = []
    pad = "  " * indent
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        desc = " ".join((info.description or "").split())
        default = _default_of(info)
        if isinstance(value, BaseModel):
            if desc:
                lines.append(f"{pad}# {desc}")
            lines.append(f"{pad}{name}:")
            lines.extend(commented_yaml(value, indent + 1))
            continue
        note = desc
        if default is not PydanticUndefined and _plain(default) != _plain(value):
            note = f"{note} (default: {_scalar(default)})".strip()
        elif default is PydanticUndefined:
            note = f"{note} (required)".strip()
        if note:
            lines.append(f"{pad}# {note}")
        lines.append(f"{pad}{name}: {_scalar(value)}")
    return lines


def show_config(config: Path | None, overrides: list[str], json_out: bool,
                out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    from orchestrator.config import ConfigError, load_config
    from orchestrator.config.loader import default_config_path
    from orchestrator.textsafe import shown

    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        err.write(f"{shown(exc.source)}: {len(exc.problems)} problem(s)\n")
        for p in exc.problems:
            err.write(f"  {shown(p.path)}: {shown(p.message)}\n")
        return 1
    except FileNotFoundError as exc:
        err.write(f"error: {shown(exc)}\n")
        return 2
    if json_out:
        out.write(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
        return 0
    source = config if config is not None else default_config_path()
    out.write(f"# {source}{' with ' + str(len(overrides)) + ' override(s)' if overrides else ''}"
              ", resolved; each field's description, and its default where the value "
              "differs\n")
    out.write("\n".join(commented_yaml(cfg)) + "\n")
    return 0


def print_schema(out: TextIO | None = None) -> int:
    out = out or sys.stdout
    from orchestrator.config import Config

    schema = Config.model_json_schema()
    schema.setdefault("$schema", "https://json-schema.org/draft/2020-12/schema")
    schema.setdefault("title", "orchestrator config")
    out.write(json.dumps(schema, indent=2) + "\n")
    return 0
