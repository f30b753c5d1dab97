"""Each vocabulary the processes share is written once: a second definition drifts.

These read the source (``ast``), so a copy that comes back fails here even before it
disagrees with the first. Each check names the one module allowed to hold its definition.
"""
from __future__ import annotations

import ast
import functools
import re
import typing
from collections.abc import Callable
from pathlib import Path

from orchestrator.config.schema import PhaseTimeouts
from orchestrator.contracts import env as ec
from orchestrator.contracts import events as ev
from orchestrator.contracts import phases
from orchestrator.contracts import worker_events as we

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "trainer", "stability")


@functools.cache
def _trees() -> tuple[tuple[str, ast.AST], ...]:
    return tuple((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
                 for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")))


def _where(found: Callable[[ast.AST], bool]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name, tree in _trees():
        for node in ast.walk(tree):
            if found(node):
                out.setdefault(name, []).append(getattr(node, "lineno", 0))
    return out


def _text(node: ast.AST, text: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == text


def _silent_threshold(node: ast.AST) -> bool:
    # max(3 * <heartbeat interval>, ...): how long a rank may stay quiet before it is silent.
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id == "max" and bool(node.args) and isinstance(node.args[0], ast.BinOp) \
        and isinstance(node.args[0].op, ast.Mult) \
        and any(_text(side, 3) for side in (node.args[0].left, node.args[0].right))


def _remote_test(node: ast.AST) -> bool:
    # "://" in <url> beside <url>.startswith("file://"): the question "is this URL remote?"
    # (a bare "://" in <url> asks another one: is this a URL at all).
    if not isinstance(node, ast.BoolOp):
        return False
    has_scheme = any(isinstance(v, ast.Compare) and _text(v.left, "://") for v in node.values)
    local = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "startswith" and any(_text(a, "file://") for a in n.args)
                for v in node.values for n in ast.walk(v))
    return has_scheme and local


def _stack_file(node: ast.AST) -> bool:
    # <dir> / "stacks", or f"gen{...}-rank{...}.txt": where a rank's stacks are written.
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _text(node.right, "stacks")
    if isinstance(node, ast.JoinedStr):
        parts = "".join(v.value for v in node.values if isinstance(v, ast.Constant)
                        and isinstance(v.value, str))
        return "-rank" in parts and parts.endswith(".txt")
    return False


_ENV_NAME = re.compile(r"^ORCH_[A-Z0-9_]*$")  # a name, or the prefix names are built from
_ENV_ASSIGNMENT = re.compile(r"\bORCH_[A-Z0-9_]*=")  # "ORCH_X=..." on a command line
_WORKER_EVENT_NAMES = we.KNOWN_NAMES | we.NOTE_NAMES | {we.OTHER_NOTE}


def _env_name(node: ast.AST) -> bool:
    # An ORCH_* name spelled out. Prose that mentions one (a docstring, a help text) is no
    # definition: it neither is a name alone nor assigns one.
    if isinstance(node, ast.JoinedStr):
        parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
        return any(_ENV_ASSIGNMENT.search(p) or p.endswith("ORCH_") for p in parts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and bool(_ENV_NAME.match(node.value) or _ENV_ASSIGNMENT.search(node.value))


def _listed(node: ast.AST, vocabulary: frozenset[str] | set[str], at_least: int) -> bool:
    # A literal collection (or a Literal[...]) holding ``at_least`` names of the vocabulary: a
    # list of them. Fewer side by side are a use (``kind in ("a", "b")``), not a definition.
    if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        items: list[ast.expr | None] = list(node.elts)
    elif isinstance(node, ast.Dict):
        items = list(node.keys)
    else:
        return False
    return sum(isinstance(i, ast.Constant) and i.value in vocabulary for i in items) >= at_least


def test_every_orch_variable_is_named_once():
    assert set(_where(_env_name)) == {"orchestrator/contracts/env.py"}, \
        "use the constant in orchestrator.contracts.env"


def test_env_all_lists_every_variable():
    names = {v for k, v in vars(ec).items() if k.isupper() and isinstance(v, str)
             and v.startswith("ORCH_")}
    assert set(ec.ALL) == names and len(ec.ALL) == len(names)


def test_worker_event_names_are_listed_once():
    assert set(_where(lambda n: _listed(n, _WORKER_EVENT_NAMES, 3))) \
        == {"orchestrator/contracts/worker_events.py"}, \
        "derive from orchestrator.contracts.worker_events (KNOWN_NAMES, NOTE_NAMES, NoteKind)"


def test_worker_note_kinds_derive_from_the_worker_events():
    note_kinds = typing.get_args(ev.WorkerNote.model_fields["kind"].annotation)
    assert set(note_kinds) == we.NOTE_NAMES | {we.OTHER_NOTE}
    assert we.RANK0_NAMES <= we.KNOWN_NAMES
    # A name with a model of its own but no note kind is journaled under OTHER_NOTE.
    assert "params_digest" in we.KNOWN_NAMES and "params_digest" not in we.NOTE_NAMES


def test_phase_names_are_listed_once():
    assert set(_where(lambda n: _listed(n, set(phases.PHASES), 3))) \
        == {"orchestrator/contracts/phases.py"}, "use orchestrator.contracts.phases"


def test_every_phase_has_a_timeout():
    assert set(PhaseTimeouts.model_fields) == set(phases.PHASES)
    assert set(phases.BUSY_PHASES) <= set(phases.PHASES)


def test_the_silent_threshold_is_computed_once():
    assert set(_where(_silent_threshold)) == {"orchestrator/supervisor/generation/hangs.py"}, \
        "use orchestrator.supervisor.generation.hangs.silent_after_s"


def test_is_this_url_remote_is_written_once():
    assert set(_where(_remote_test)) == {"orchestrator/contracts/rundir.py"}, \
        "use orchestrator.contracts.rundir.is_remote"


def test_the_stack_file_is_named_once():
    assert set(_where(_stack_file)) == {"orchestrator/contracts/rundir.py"}, \
        "use orchestrator.contracts.rundir.STACKS_DIR and stack_file_name"


_ENVELOPE = set(we.RESERVED_KEYS)


def test_the_envelope_keys_are_listed_once():
    assert set(_where(lambda n: _listed(n, _ENVELOPE, 5))) \
        == {"orchestrator/contracts/worker_events.py"}, \
        "use orchestrator.contracts.worker_events.RESERVED_KEYS (or RANK_DATA_RESERVED)"
    assert ev.RESERVED_KEYS is we.RESERVED_KEYS and we.RANK_DATA_RESERVED > we.RESERVED_KEYS


def test_the_checks_find_what_they_look_for():
    # Each check recognises the form it forbids, so a pass above is not a check gone blind.
    samples = {
        _silent_threshold: "max(3 * cfg.heartbeat_interval_s, 1.0)",
        _remote_test: '"://" in url and not url.startswith("file://")',
        _stack_file: 'run_dir / "stacks"',
        lambda n: _listed(n, _ENVELOPE, 5):
            'frozenset({"seq", "ts", "kind", "generation", "rank", "node_id", "name"})',
    }
    for check, source in samples.items():
        assert any(check(n) for n in ast.walk(ast.parse(source))), source
    assert any(_stack_file(n) for n in ast.walk(ast.parse('f"gen{g:04d}-rank{r:05d}.txt"')))
    for source in ('env["ORCH_TLS_CA"]', 'f" ORCH_TLS_CA={ca}"', 'f"ORCH_{name}"',
                   '"exec env ORCH_TOKEN=x agent"'):
        assert any(_env_name(n) for n in ast.walk(ast.parse(source))), source
    for source in ('"""Reads ORCH_CONFIG."""', '"(default: ORCH_TLS_CA)"'):
        assert not any(_env_name(n) for n in ast.walk(ast.parse(source))), source
    for source in ('{"resumed": 1, "startup": 2, "recovered": 3}',
                   'Literal["resumed", "startup", "worker_event"]'):
        assert any(_listed(n, _WORKER_EVENT_NAMES, 3) for n in ast.walk(ast.parse(source)))
    assert any(_listed(n, set(phases.PHASES), 3)
               for n in ast.walk(ast.parse('("loading", "compiling", "evaluating")')))
