"""The monitoring files under deploy/ as tests read them: expressions, metric names, promtool."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "orchestrator.json"

# Grafana's own variables, and values that suit a Prometheus scraping every second.
GRAFANA_BUILTINS = {"__rate_interval": "10s", "__interval": "2s", "__range": "1h"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset", "inf", "nan", "atan2"}


def have_prometheus() -> bool:
    return bool(shutil.which("prometheus") and shutil.which("promtool"))


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every Prometheus annotation."""
    d = dashboard()
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"])
           for p in d["panels"] for t in p.get("targets", [])]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in d["annotations"]["list"]
            if a.get("expr")]
    return out


def rules() -> list[dict[str, Any]]:
    out = []
    for path in sorted((PROMETHEUS_DIR / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out += group["rules"]
    return out


def rule_exprs() -> list[tuple[str, str]]:
    return [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for r in rules()]


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def substitute(expr: str, job: str) -> str:
    """Grafana's variables replaced as a dashboard would for ``job``."""
    expr = expr.replace("$job", job).replace("${job}", job)
    for name, value in GRAFANA_BUILTINS.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


def _outside_braces(expr: str) -> list[tuple[int, int]]:
    """Spans of ``expr`` outside label matchers ``{...}`` and ranges ``[...]`` (our
    expressions hold strings only inside matchers, and no braces inside strings)."""
    spans, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch in "{[":
            if depth == 0:
                spans.append((start, i))
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                start = i + 1
    spans.append((start, len(expr)))
    return spans


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (not functions, keywords or label names)."""
    names = set()
    text = " ".join(expr[a:b] for a, b in _outside_braces(expr))
    # Label lists after by/on/without/ignoring/group_*: not metrics.
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    for m in re.finditer(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def boolify(expr: str) -> str:
    """Every comparison made ``bool`` (0/1 instead of a filter), outside label matchers: the
    expression then returns data whenever its inputs exist, firing or not. (``unless``
    would then drop everything: the rules are written without it.)"""
    assert not re.search(r"\bunless\b", expr), f"boolify cannot keep the meaning of: {expr}"
    out, last = [], 0
    for a, b in _outside_braces(expr):
        out.append(expr[last:a])
        part = re.sub(r"(==|!=|>=|<=|(?<![=!<>])>(?!=)|(?<![=!<>])<(?!=))(?!\s*bool)",
                      r"\1 bool ", expr[a:b])
        out.append(part)
        last = b
    out.append(expr[last:])
    return "".join(out)
