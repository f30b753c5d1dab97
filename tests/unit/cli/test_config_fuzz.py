"""Config commands never crash: 87 of 6,060 fuzzed runs printed tracebacks
(``--set key=<5,000-digit int>``, a file that is not UTF-8, a 5,000-digit integer, 10,000
nested ``[``), and ``timeouts.node_lost_s: .inf`` was accepted.

``CONFIG_FUZZ_EXAMPLES`` configs per run (5,000), each through ``validate`` and ``config
show``: the shipped default with fields set to values of every kind, unknown keys, deep or
aliased YAML, raw bytes, and the same through ``--set``. Every one ends in 0 (valid), or 1
with each problem naming its field, never anything else; non-finite numbers are refused
everywhere. A few run as the real CLI too.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from orchestrator.cli import views
from orchestrator.cli.configdoc import show_config
from orchestrator.config import Config
from orchestrator.config.loader import default_config_path

EXAMPLES = int(os.environ.get("CONFIG_FUZZ_EXAMPLES", "5000"))
BASE_TEXT = default_config_path().read_text()
BASE = yaml.safe_load(BASE_TEXT)


def _paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _paths(ann, path)
        else:
            out.append(path)
    return out


PATHS = _paths(Config) + ["job", "trainer.model", "nope", "trainer.nope.deeper", "x.y.z"]
_VALUES: list[Any] = [
    0, -1, 1, 2**31, 2**63, 2**64, -(2**70), 10**4000, 1.5, -0.0, 1e308, float("inf"),
    float("nan"), "", "x", "\x1b[2J", "[blink]x", "a" * 5000, None, True, [], [1, "a"], {},
    {"a": 1}, {"a": {"b": [1, 2, {"c": None}]}},
]
_SCALARS = ["0", "-1", "1e400", ".inf", "-.inf", ".nan", "9" * 5000, "0x10", "0o7", "1_000",
            "true", "~", "'\x1b[31m'", "[[[[", "{a: [1, {b: 2}]}", "&a [*a]",
            "[" * 10_000, "!!python/object/apply:os.system ['true']", "\"\\u0000\""]
_RAW = [b"\xff\xfe\x00\x80", b"job: {name: \xc3\x28}\n", b"\t\tjob:\n", b"- 1\n- 2\n",
        b"job: &a [*a]\n", b"a: &a [x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
        b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c]\n"
        b"e: [*d, *d, *d, *d, *d, *d, *d, *d]\n", b"", b"{}", b"null"]


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    node = data
    parts = path.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def _config(rng: random.Random, tmp: Path) -> tuple[Path, list[str]]:
    """One fuzzed config file and its ``--set`` overrides."""
    path = tmp / "c.yaml"
    kind = rng.randrange(5)
    overrides: list[str] = []
    if kind == 0:  # the default with fields set to anything
        data = json.loads(json.dumps(BASE))
        for _ in range(rng.randrange(1, 4)):
            _set(data, rng.choice(PATHS), rng.choice(_VALUES))
        try:
            text = yaml.dump(data, Dumper=yaml.CSafeDumper, allow_unicode=True)
        except (ValueError, yaml.YAMLError):
            text = "job: {}\n"
        path.write_text(text)
    elif kind == 1:  # a field's raw YAML text
        path.write_text(BASE_TEXT + f"\n{rng.choice(PATHS).split('.')[0]}: "
                        f"{rng.choice(_SCALARS)}\n")
    elif kind == 2:  # raw bytes
        path.write_bytes(rng.choice(_RAW) if rng.random() < 0.6 else rng.randbytes(60))
    else:  # the default, with overrides
        path.write_text(BASE_TEXT)
        overrides = [f"{rng.choice(PATHS)}={rng.choice(_SCALARS)}"
                     for _ in range(rng.randrange(1, 3))]
        if rng.random() < 0.2:
            overrides.append(rng.choice(["no-equals", "=1", "a..b=1", "x" * 70_000 + "=1"]))
    return path, overrides


def test_fuzzed_configs_through_validate_and_config_show(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(views, "out", views.Console(file=io.StringIO()))
    monkeypatch.setattr(views, "err", views.Console(file=io.StringIO()))
    tried = {"n": 0, "valid": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 1 << 32))
    def one(seed: int) -> None:
        tried["n"] += 1
        path, overrides = _config(random.Random(seed), tmp_path)
        code = views.validate_config(path, overrides)
        out, err = io.StringIO(), io.StringIO()
        shown = show_config(path, overrides, False, out, err)
        assert code in (0, 1) and shown == code, (seed, code, shown, err.getvalue()[-500:])
        if code:
            problems = err.getvalue().splitlines()[1:]
            assert problems and all(": " in p for p in problems), err.getvalue()[-500:]
            assert "\x1b" not in err.getvalue()
        else:
            tried["valid"] += 1

    one()
    assert tried["n"] >= EXAMPLES and tried["valid"] >= EXAMPLES // 50


@pytest.mark.parametrize(("text", "override", "field"), [
    ("timeouts:\n  node_lost_s: .inf\n", None, "timeouts.node_lost_s"),
    ("stability:\n  grad_spike:\n    rel_margin: .nan\n", None, "stability.grad_spike"),
    ("trainer:\n  steps: " + "9" * 5000 + "\n", None, "<file>"),
    (None, "trainer.steps=" + "9" * 5000, "trainer.steps"),
    (None, "job.name=" + "[" * 10_000, "job.name"),
    (None, "trainer.optimizer.lr=.nan", "trainer.optimizer.lr"),
])
def test_the_issues_configs_are_problems_naming_the_field(
        tmp_path: Path, text: str | None, override: str | None, field: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(BASE))
    for cmd in (["validate", str(path)], ["config", "show", str(path)]):
        out = subprocess.run([sys.executable, "-m", "orchestrator", *cmd,
                              *(["--set", override] if override else [])],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, (cmd, out.stdout[-500:], out.stderr[-500:])
        assert "Traceback" not in out.stderr and field in out.stderr, out.stderr[-1000:]


def test_a_config_that_is_not_utf8_is_one_problem(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"job:\n  name: \xff\xfe\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "not UTF-8" in out.stderr and "Traceback" not in out.stderr
