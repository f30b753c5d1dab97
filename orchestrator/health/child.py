"""The check process: ``python -m orchestrator.health.child`` runs a node's checks in order.

It reads a ``NodeContext`` (JSON) on stdin and writes one JSON line per event on stdout:
``{"start": name}`` before a check and ``{"result": {...}}`` after it. The parent
(``runner.run_node_checks``) enforces each check's timeout by killing this process, so a
check stuck in a driver call, a hung NFS mount or a wedged ``neuron-ls`` costs its timeout
and nothing more.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import IO, Any

from orchestrator.contracts import chaos
from orchestrator.health import catalog
from orchestrator.health.base import CheckResult, Outcome, failed
from orchestrator.health.context import NodeContext


def resolve(fn: str) -> Any:
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def run_one(ctx: NodeContext, name: str) -> CheckResult:
    """Run one check in this process; an exception is the check's failure, not ours."""
    check = catalog.get(name)
    start = time.perf_counter()

    def attempt() -> Outcome:
        try:
            if check.fn is None:
                raise RuntimeError(f"{name} is not a node check")
            outcome: Outcome = resolve(check.fn)(ctx)
        except Exception as exc:  # noqa: BLE001 - any error of a check is its result
            outcome = failed(f"{type(exc).__name__}: {exc}")
        return outcome

    outcome = chaos.wrap_check(attempt, hang=name in ctx.chaos_hang,
                               fail=name in ctx.chaos_fail, failed=failed)()
    return CheckResult.of(check, ctx.node_id, ctx.level, outcome,
                          time.perf_counter() - start)


def _emit(out: IO[str], obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, default=str) + "\n")
    out.flush()


def _preload() -> None:
    """Import every check's module (and fsspec, for the storage check) before the context
    arrives: a child the agent started ahead has them ready when its order comes. No check
    code runs, and no device is touched. A module that fails to import is the failure of
    its checks when they run, not of this."""
    for module in sorted({c.fn.partition(":")[0] for c in catalog.CHECKS if c.fn}
                         | {"fsspec"}):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001, S112 - reported by the check that needs it
            continue


def main() -> int:
    _preload()
    raw = sys.stdin.read()
    if not raw.strip():  # started ahead, and its agent went away before an order came
        return 0
    ctx = NodeContext.model_validate_json(raw)
    # The protocol gets its own copy of stdout; fd 1 then points at stderr, so whatever a
    # check or a library prints (even from C) cannot garble the result lines.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for name in ctx.checks:
        _emit(out, {"start": name})
        _emit(out, {"result": run_one(ctx, name).model_dump(mode="json")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
