"""YAML files plus dotted ``--set`` overrides, validated once, every problem reported at once."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.config.schema import Config


@dataclass(frozen=True)
class Problem:
    """One config problem: the dotted path of the field and what is wrong with it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """Raised with every problem of a config, each naming its dotted field."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


def default_config_path() -> Path:
    """The embedded default, ``configs/local.yaml``: in the wheel or in the checkout."""
    packaged = resources.files("orchestrator") / "_configs" / "local.yaml"
    if packaged.is_file():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
    if checkout.is_file():
        return checkout
    raise FileNotFoundError("the embedded default configs/local.yaml is missing from this install")


# What a config may be: bounds far above any real config, low enough that reading one (and
# every check after) costs little and never fails with anything but a ConfigError.
MAX_FILE_BYTES = 4 * 2**20
MAX_OVERRIDE_BYTES = 64 * 2**10
MAX_DEPTH = 32
MAX_NODES = 10_000  # values visited (a real config has a few hundred): an alias bomb stops here
MAX_INT = (1 << 63) - 1
# libyaml's safe loader where PyYAML has it (the same types, ten times faster).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _flow_depth(text: str) -> int:
    """The deepest nesting of YAML flow collections (``[``, ``{``) in ``text``, strings not
    told apart: PyYAML's parser recurses, and 10,000 nested ``[`` took it 8 s to refuse."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}" and depth:
            depth -= 1
    return deepest


def _load_yaml(text: str, source: str, where: str) -> Any:
    """``text`` as YAML; every way it may fail is a ConfigError naming ``where``."""
    if _flow_depth(text) > 2 * MAX_DEPTH:
        raise ConfigError(source, [Problem(where, f"nested deeper than {MAX_DEPTH}")])
    try:
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (libyaml's)
    except yaml.YAMLError as exc:
        text = " ".join(str(exc).split())[:500]  # PyYAML's message spans lines
        raise ConfigError(source, [Problem(where, f"not valid YAML: {text}")]) from None
    except RecursionError:
        raise ConfigError(source, [Problem(where, "nested too deeply")]) from None
    except ValueError as exc:  # an integer of more digits than Python converts, ...
        raise ConfigError(source, [Problem(where, f"a value YAML cannot read: "
                                                  f"{str(exc)[:200]}")]) from None


def check_bounds(value: Any, source: str, where: str = "") -> None:
    """Raise a ConfigError naming the dotted field of the first value past the bounds:
    nesting, size, an integer beyond 64 bits, a number that is not finite."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    seen = 0
    while stack:
        v, path, depth = stack.pop()
        seen += 1
        name = path or "<root>"
        if seen > MAX_NODES:
            raise ConfigError(source, [Problem(name, f"more than {MAX_NODES} values")])
        if depth > MAX_DEPTH:
            raise ConfigError(source, [Problem(name, f"nested deeper than {MAX_DEPTH}")])
        if isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        if isinstance(v, int) and not -MAX_INT <= v <= MAX_INT:
            raise ConfigError(source, [Problem(name, "an integer beyond 64 bits")])
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(source, [Problem(name, f"{v} is not a finite number")])
        if isinstance(v, dict):
            for key, item in v.items():
                sub = f"{path}.{key}" if path else str(key)
                stack.append((item, sub[:200], depth + 1))
        elif isinstance(v, list):
            stack.extend((item, f"{path}[{i}]"[:200], depth + 1) for i, item in enumerate(v))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML, so 3, true, [1, 2] work)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", [Problem(text[:200], "expected KEY=VALUE with a dotted KEY")])
    if len(text.encode("utf-8", "replace")) > MAX_OVERRIDE_BYTES:
        raise ConfigError("--set", [Problem(key[:200], f"longer than {MAX_OVERRIDE_BYTES} "
                                                       "bytes")])
    value = _load_yaml(raw, "--set", key) if raw.strip() else ""
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


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a clear ConfigError for a missing, unreadable, oversized or
    non-UTF-8 file, bad YAML, or a value past the bounds (``check_bounds``)."""
    p = Path(path).expanduser()
    source = str(path)
    if not p.is_file():
        raise ConfigError(source, [Problem("<file>", "no such file")])
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(source, [Problem("<file>", f"cannot read: {exc.strerror}")]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(source, [Problem("<file>", f"larger than {MAX_FILE_BYTES} bytes")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [Problem("<file>", f"not UTF-8 (byte {exc.start})")]) from None
    data = _load_yaml(text, source, "<file>") or {}
    if not isinstance(data, dict):
        raise ConfigError(source, [Problem("<root>", "the file must hold a mapping")])
    check_bounds(data, source)
    return data


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
