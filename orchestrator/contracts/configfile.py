"""A config file as every process reads it: bounded YAML, problems named by dotted field.

The orchestrator's CLI, the agent and a rank (``trainer.settings``) read the same job file;
this is the one reader and the one error they share. ``orchestrator.config.loader``
validates what it returns against the schema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


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


def load_yaml_text(text: str, source: str, where: str) -> Any:
    """``text`` as YAML; every way it may fail is a ConfigError naming ``where``."""
    if _flow_depth(text) > 2 * MAX_DEPTH:
        raise ConfigError(source, [Problem(where, f"nested deeper than {MAX_DEPTH}")])
    try:
        return yaml.load(text, Loader=_LOADER)
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
    data = load_yaml_text(text, source, "<file>") or {}
    if not isinstance(data, dict):
        raise ConfigError(source, [Problem("<root>", "the file must hold a mapping")])
    check_bounds(data, source)
    return data
