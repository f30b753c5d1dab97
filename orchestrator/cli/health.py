"""``orchestrator health``: run the health checks on demand, print the results.

The checks run exactly as before a launch: a supervisor in health-only mode brings the
agents up with the configured launcher, runs one round (node checks, then the network test),
tells the agents to exit and stops. This module only builds the parts and prints.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.config import Config, ConfigError, load_config
from orchestrator.health.base import Level
from orchestrator.health.catalog import CHECK_NAMES
from orchestrator.contracts.rundir import RunDir
from orchestrator.journal.status import load_view

out = Console()
err = Console(stderr=True)


def run_health(config: Path | None, overrides: list[str], level: Level | None,
               json_out: bool, run_dir: Path | None) -> int:
    """Exit 0 when no fatal check failed, 1 when one did (or no node answered), 2 on bad input."""
    try:
        cfg = load_config(config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        err.print(f"[red]config error[/red] {exc}")
        return 2
    # A health run must not take a running job's port or its Prometheus target.
    cfg.metrics.port, cfg.metrics.targets_file = 0, None
    chosen = level or cfg.health.level(cfg.health.preflight) or Level.FULL
    try:
        run = _run_dir(cfg, run_dir)
        from orchestrator.logs import configure_logging

        configure_logging(run.log, component="supervisor", console=False)
    except OSError as exc:
        err.print(f"[red]error[/red] cannot write the health run directory "
                  f"({exc.filename or run_dir}: {exc.strerror or exc}); run from a writable "
                  "directory, or pass --run-dir DIR (or --set job.run_root=DIR)")
        return 2
    start = time.monotonic()
    with err.status(f"health checks ({chosen.value}) on {cfg.cluster.nodes + cfg.cluster.spares}"
                    f" node(s) via {cfg.launcher.kind}..."):
        asyncio.run(_supervise(cfg, run, chosen))
    results = [r for r in load_view(run).health]
    report = summarize(results, chosen, run, time.monotonic() - start)
    if json_out:
        print(json.dumps(report, indent=2, default=str))
    else:
        out.print(results_table(results, chosen))
        skipped = skipped_summary(results)
        if skipped:
            out.print(f"[dim]not applicable here: {skipped}[/dim]")
        out.print(f"{verdict_line(report)}; journal: {run.journal}")
    return 0 if report["ok"] else 1


def verdict_line(report: dict[str, Any]) -> str:
    """``fatal failures: 1 of 3 node(s) failed (local-1), 2 failed check(s), 4.1 s``."""
    nodes = report["nodes"]
    bad = sorted((n for n, v in nodes.items() if not v["ok"]), key=_node_key)
    checks = sum(len(v["fatal"]) + len(v["warn"]) for v in nodes.values())
    if report["ok"]:
        head = f"[green]healthy[/green]: {len(nodes)} node(s) passed"
    elif not nodes:
        head = "[red]no node answered[/red]"
    else:
        head = (f"[red]fatal failures[/red]: {len(bad)} of {len(nodes)} node(s) failed "
                f"({', '.join(bad)})")
    return f"{head}, {checks} failed check(s), {report['seconds']:.1f} s"


def _run_dir(cfg: Config, run_dir: Path | None) -> RunDir:
    """A run dir of its own (``runs/health-<job>-<stamp>``); ``runs/latest`` is left alone."""
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(cfg.job.run_root) / f"health-{cfg.job.name}-{stamp}"
    path = run_dir.expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return RunDir(path)


async def _supervise(cfg: Config, run: RunDir, level: Level) -> None:
    from orchestrator.supervisor.core import Supervisor

    sup = Supervisor(cfg, run, health_only=level)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, sup.request_stop, f"signal {sig.name}")
    await sup.run()


def summarize(results: list[dict[str, Any]], level: Level, run: RunDir,
              seconds: float) -> dict[str, Any]:
    """The ``--json`` document: verdict, per-node verdicts, every result."""
    nodes: dict[str, dict[str, Any]] = {}
    for r in results:
        node = nodes.setdefault(r["node_id"], {"ok": True, "fatal": [], "warn": []})
        if not r["ok"]:
            node["fatal" if r["severity"] == "fatal" else "warn"].append(r["check"])
            node["ok"] = node["ok"] and r["severity"] != "fatal"
    return {"ok": bool(nodes) and all(n["ok"] for n in nodes.values()), "level": level.value,
            "seconds": round(seconds, 2), "run_dir": str(run.root), "nodes": nodes,
            "results": [{k: v for k, v in r.items() if k != "ts"} for r in results]}


def results_table(results: list[dict[str, Any]], level: Level) -> Table:
    order = {name: i for i, name in enumerate(CHECK_NAMES)}
    table = Table(title=f"health checks ({level.value})", title_justify="left")
    for col in ("node", "check", "severity", "ok", "duration", "message"):
        table.add_column(col, justify="right" if col == "duration" else "left",
                         overflow="fold")
    for r in sorted(results, key=lambda r: (_node_key(r["node_id"]),
                                            order.get(r["check"], len(order)))):
        if r.get("skipped"):
            continue  # summarized under the table: the same reason on every node
        if r["ok"]:
            mark = "[green]ok[/green]"
        else:
            mark = "[red]FAIL[/red]" if r["severity"] == "fatal" else "[yellow]warn[/yellow]"
        table.add_row(r["node_id"], r["check"], r["severity"], mark,
                      f"{r['duration_s']:.2f} s", r["message"])
    return table


def skipped_summary(results: list[dict[str, Any]]) -> str:
    """``check, check (reason); ...`` for the checks skipped, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for r in results:
        if r.get("skipped") and r["check"] not in by_reason.setdefault(r["message"], []):
            by_reason[r["message"]].append(r["check"])
    return "; ".join(f"{', '.join(checks)} ({reason})" for reason, checks in by_reason.items())


def _node_key(node_id: str) -> tuple:
    head, _, tail = node_id.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (node_id, -1)
