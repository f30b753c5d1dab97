"""YAML files plus dotted ``--set`` overrides, validated once, every problem reported at once."""

from __future__ import annotations

import copy
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.config.schema import Config
from orchestrator.contracts.configfile import (
    MAX_OVERRIDE_BYTES,
    ConfigError,
    Problem,
    check_bounds,
    load_yaml_text,
    read_yaml,
)

__all__ = ["ConfigError", "Problem", "apply_overrides", "check_bounds", "config_hash",
           "default_config_path", "load_config", "parse_override", "read_yaml",
           "validate_data"]


def default_config_path() -> Path:
    """The embedded default, ``configs/local.yaml``: in the wheel or in the checkout."""
    packaged = resources.files("orchestrator") / "_configs" / "local.yaml"
    if packaged.is_file():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
    if checkout.is_file():
        return checkout
    raise FileNotFoundError("the embedded default configs/local.yaml is missing from this install")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML, so 3, true, [1, 2] work)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", [Problem(text[:200], "expected KEY=VALUE with a dotted KEY")])
    if len(text.encode("utf-8", "replace")) > MAX_OVERRIDE_BYTES:
        raise ConfigError("--set", [Problem(key[:200], f"longer than {MAX_OVERRIDE_BYTES} "
                                                       "bytes")])
    value = load_yaml_text(raw, "--set", key) if raw.strip() else ""
    check_bounds(value, "--set", key)
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with each dotted override set (creating mappings as needed).

    Every malformed override is reported at once (one ConfigError), not the first alone."""
    out, problems = _apply(data, overrides)
    if problems:
        raise ConfigError("--set", problems)
    return out


def _apply(data: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[Problem]]:
    """``data`` with the well-formed overrides set, and a problem for each malformed one."""
    out = copy.deepcopy(data)
    problems: list[Problem] = []
    for text in overrides:
        try:
            parts, value = parse_override(text)
        except ConfigError as exc:
            problems += exc.problems
            continue
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                problems.append(Problem(where, "is not a mapping; cannot set below it"))
                break
            node = child
        else:
            node[parts[-1]] = value
    return out, problems


def _problems(exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        original = (err.get("ctx") or {}).get("error")
        field = getattr(original, "field", None)
        if field:
            loc.append(field)
        message = str(original) if original is not None else err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key (not in the schema)" + _did_you_mean(loc)
        problems.append(Problem(".".join(loc) or "<root>", message))
    return problems


def _did_you_mean(loc: list[str]) -> str:
    """``; did you mean keep_last?`` for a key one typo away from a field of its section."""
    import difflib

    known = _section_keys(loc[:-1])
    close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.75) if loc else []
    return f"; did you mean {close[0]}?" if close else ""


def _section_keys(path: list[str]) -> list[str]:
    """The field names of the config section at ``path`` ([] when it is not a section)."""
    import types
    import typing

    from pydantic import BaseModel

    model: Any = Config
    for part in path:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        ann = field.annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            models = [a for a in typing.get_args(ann)
                      if isinstance(a, type) and issubclass(a, BaseModel)]
            ann = models[0] if len(models) == 1 else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def validate_data(data: dict[str, Any], source: str) -> Config:
    """Validate a plain mapping; raises ConfigError listing every problem."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _problems(exc)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (default: the embedded ``configs/local.yaml``) with ``--set`` overrides."""
    source = Path(path) if path is not None else default_config_path()
    data, malformed = _apply(read_yaml(source), overrides or [])
    label = str(source) + (" (with --set overrides)" if overrides else "")
    try:
        cfg = validate_data(data, label)
    except ConfigError as exc:  # the malformed overrides and the rest's problems, together
        raise ConfigError(label, [*malformed, *exc.problems]) from None
    if malformed:
        raise ConfigError(label, malformed)
    return cfg


def config_hash(cfg: Config) -> str:
    """A stable short hash of the resolved config (recorded in journals and manifests)."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
