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
    table.add_row("goodput", f"{s['goodput']:.1%} ({_fmt_s(s['productive_s'])} productive)")
    top = ", ".join(f"{c} {_fmt_s(v)}" for c, v in list(s["time_lost_by"].items())[:3])
    table.add_row("time lost", f"{_fmt_s(s['time_lost_s'])} of {_fmt_s(s['wall_time_s'])}"
                  + (f" ({top})" if top else ""))
    if s["failed_reason"]:
        table.add_row("failed because", s["failed_reason"])
    failure = view.failures[-1] if view.failures else None
    if failure and s["state"] != "COMPLETED":
        table.add_row("root cause", failure.get("message", ""))
    table.add_row("run dir", str(run.root))
    out.print(table)


def books_table(books: dict) -> Table:
    """Seconds and share of wall time per category, productive first, then the largest."""
    total = books["total_s"] or 0.0
    t = Table(title=f"where the time went (goodput {books['goodput']:.1%})",
              title_justify="left")
    t.add_column("category")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    seconds = books["seconds"]
    order = ["productive"] + sorted((c for c in seconds if c != "productive"),
                                    key=lambda c: -seconds[c])
    for c in order:
        share = seconds[c] / total if total > 0 else 0.0
        t.add_row(c, _fmt_s(seconds[c]), f"{share:.1%}")
    t.add_row("total", _fmt_s(total), "100.0%" if total > 0 else "-", style="bold")
    return t


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
    _print_stability(status["stability"])
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
    out.print(books_table(status["books"]))
    t = Table(title="nodes", title_justify="left")
    for col in ("node", "state", "node rank", "host"):
        t.add_column(col)
    for node_id, n in sorted(status["nodes"].items()):
        t.add_row(node_id, n["state"], str(n.get("node_rank")), n.get("host", ""))
    out.print(t)
    return 0


def _num(value: object, fmt: str = ".4g") -> str:
    if value is None:
        return "-"
    return format(value, fmt) if isinstance(value, int | float) else str(value)


def _print_stability(st: dict) -> None:
    """The stability picture: grad norm against r, spikes and their lengths, growth, rollbacks."""
    t = Table(title="stability", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("grad norm", f"{_num(st['last_grad_norm'])} (r {_num(st['running_mean'])}, "
                           f"threshold {_num(st['threshold'])}) at step {_num(st['step'])}")
    lengths = ", ".join(f"{k}: {n}" for k, n in (st["spike_length_histogram"] or {}).items()
                        if n) or "none"
    t.add_row("spikes (lineage)", f"{_num(st['spikes_total'])} (by length {lengths}); longest "
                        f"{_num(st['longest_spike'])}, current {_num(st['current_spike_length'])}")
    t.add_row("growth", f"{_num(st['growth_ratio'], '.3g')}x over the lowest grad norm "
                        f"{_num(st['lowest_grad_norm'])}")
    t.add_row("param norm", _num(st["last_param_norm"]))
    t.add_row("loss spikes / non-finite", f"{_num(st['loss_spikes_total'])} / "
                                          f"{_num(st['nonfinite_total'])}")
    t.add_row("updates skipped", str(st["updates_skipped"]))
    t.add_row("events journaled", ", ".join(f"{k} x{n}" for k, n in st["events"].items())
              or "none")
    rollbacks = [f"step {r['detected_step']} ({r['event']}, onset {r['onset_step']}) -> "
                 f"checkpoint {r['restore_step'] if r['restore_step'] is not None else 'none'}"
                 + (f", skipped batches [{r['skip_window'][0]}, {r['skip_window'][1]})"
                    if r["skip_window"] else "")
                 + f", LR x{_num(r['lr_scale_total'], '.3g')}" for r in st["rollbacks"]]
    t.add_row("rollbacks", "\n".join(rollbacks) or "none")
    out.print(t)


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
