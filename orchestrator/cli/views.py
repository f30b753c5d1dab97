"""What the CLI prints: status and summary tables, config problems, data preparation."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orchestrator.rundir import RunDir
from orchestrator.status import build_status, load_view
from orchestrator.summary import build_summary

out = Console()
err = Console(stderr=True)


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def print_summary(run: RunDir) -> None:
    view = load_view(run)
    s = build_summary(view, run)
    table = Table(title=f"job {view.job}: {s['state']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("steps", f"{s['steps']} / {s['total_steps']}")
    table.add_row("tokens", f"{s['tokens']:,}" if s["tokens"] else "0")
    table.add_row("final loss", "-" if s["final_loss"] is None else f"{s['final_loss']:.4f}")
    table.add_row("wall time", _fmt_s(s["wall_time_s"]))
    causes = ", ".join(f"{c} x{n}" for c, n in s["causes"].items()) or "none"
    table.add_row("restarts", f"{s['restarts']} ({causes})")
    table.add_row("checkpoints committed", str(s["checkpoints_committed"]))
    table.add_row("time lost", f"{_fmt_s(s['time_lost_s'])} of {_fmt_s(s['wall_time_s'])}")
    if s["failed_reason"]:
        table.add_row("failed because", s["failed_reason"])
    failure = view.failures[-1] if view.failures else None
    if failure and s["state"] != "COMPLETED":
        table.add_row("root cause", failure.get("message", ""))
    table.add_row("run dir", str(run.root))
    out.print(table)


def show_status(run_dir: Path | None, json_out: bool) -> int:
    from orchestrator.cli.control import resolve_run_dir

    try:
        run = resolve_run_dir(run_dir)
    except FileNotFoundError as exc:
        err.print(f"[red]error[/red] {exc}")
        return 2
    status = build_status(load_view(run), run)
    if json_out:
        print(json.dumps(status, indent=2, default=str))
        return 0
    table = Table(title=f"job {status['job']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("state", status["state"])
    table.add_row("step", f"{status['last_step']} / {status['total_steps']}")
    table.add_row("loss", "-" if status["loss"] is None else f"{status['loss']:.4f}")
    table.add_row("generation", str(status["generation"]))
    table.add_row("wall time", _fmt_s(status["wall_time_s"]))
    table.add_row("run dir", status["run_dir"])
    out.print(table)
    if status["restarts"] or status["failures"]:
        t = Table(title="failures", title_justify="left")
        for col in ("generation", "cause", "rank", "node", "detail"):
            t.add_column(col)
        for f in status["failures"]:
            t.add_row(str(f["generation"]), f["cause"], str(f["rank"]), str(f["node_id"]),
                      f["message"] or "")
        out.print(t)
    if status["root_cause"] and status["state"] in ("FAILED",):
        out.print("[bold]last log lines of the root cause:[/bold]")
        for line in status["root_cause"]["log_tail"][-10:]:
            out.print(f"  {line}", markup=False, highlight=False)
    if status["checkpoints"]:
        t = Table(title="checkpoints", title_justify="left")
        t.add_column("step", justify="right")
        t.add_column("tier")
        t.add_column("age")
        t.add_column("path")
        for c in status["checkpoints"]:
            t.add_row(str(c["step"]), c["tier"], _fmt_s(time.time() - (c["ts"] or time.time())),
                      "\n".join(str(p) for p in c["paths"].values()))
        out.print(t)
    t = Table(title="nodes", title_justify="left")
    for col in ("node", "state", "node rank", "host"):
        t.add_column(col)
    for node_id, n in sorted(status["nodes"].items()):
        t.add_row(node_id, n["state"], str(n.get("node_rank")), n.get("host", ""))
    out.print(t)
    return 0


def validate_config(config: Path, overrides: list[str]) -> int:
    from orchestrator.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        err.print(f"[red]{exc.source}[/red]: {len(exc.problems)} problem(s)")
        for p in exc.problems:
            err.print(f"  [bold]{p.path}[/bold]: {p.message}", highlight=False)
        return 1
    out.print(f"{config}: ok (job {cfg.job.name}, {cfg.cluster.nodes} nodes x "
              f"{cfg.cluster.procs_per_node} ranks, model {cfg.trainer.model.preset}, "
              f"{cfg.trainer.steps} steps)")
    return 0


def prepare_data(out_dir: Path, source: list[str] | str, tokenizer: str,
                 max_bytes: int) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from trainer.data.prepare import prepare_dataset

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=err) as bar:
        task = bar.add_task(f"tokenizing into {out_dir}", total=None)
        try:
            index = prepare_dataset(source, out_dir, tokenizer, max_bytes=max_bytes,
                                    progress=lambda d, t: bar.update(task, completed=d, total=t))
        except (OSError, ValueError) as exc:
            err.print(f"[red]error[/red] {exc}")
            return 1
    out.print(f"{out_dir}: {index['total_tokens']:,} tokens in {len(index['shards'])} shard(s) "
              f"from {index['documents']:,} documents")
    return 0
