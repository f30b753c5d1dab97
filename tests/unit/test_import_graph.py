"""The project's import graph has no cycle, lazy imports (inside functions, under
TYPE_CHECKING) counted: a lazy import hides a cycle, it does not remove it. And the supervisor's
collaborators never import the supervisor itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "trainer", "stability")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_import_graph_has_no_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_collaborator_imports_the_supervisor() -> None:
    graph = _graph()
    importers = sorted(m for m, edges in graph.items() if "orchestrator.supervisor.core" in edges)
    # Only the CLI builds a supervisor; nothing below it reaches back up.
    assert all(m.startswith("orchestrator.cli") for m in importers), importers


# What the training side may import of the orchestrator: the worker SDK and the contracts
# every process shares (the env, protocol, run-dir names, the config file's reader...).
TRAINER_MAY_IMPORT = ("orchestrator.contracts", "orchestrator.worker")


def test_the_trainer_imports_only_the_worker_sdk_and_the_contracts() -> None:
    graph = _graph()
    crossing = sorted(
        (name, edge) for name, edges in graph.items()
        if name.split(".")[0] in ("trainer", "stability")
        for edge in edges
        if edge.split(".")[0] == "orchestrator" and edge != "orchestrator"
        and not any(edge == p or edge.startswith(p + ".") for p in TRAINER_MAY_IMPORT))
    assert not crossing, crossing
