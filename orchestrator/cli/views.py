"""What the CLI prints: status and summary tables, config problems, data preparation."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from orchestrator.contracts import readback
from orchestrator.cli.liveness import Liveness, resume_command
from orchestrator.cli.liveness import check as supervisor_liveness
from orchestrator.contracts.rundir import RunDir
from orchestrator.contracts.state import JobState
from orchestrator.journal.status import build_status, load_view
from orchestrator.cli.summary import build_summary
from orchestrator.textsafe import shown

if TYPE_CHECKING:
    from orchestrator.config import Config

out = Console()
err = Console(stderr=True)


def _recovery(failure: dict) -> str:
    """How the job recovered from ``failure``: in place, or a full restart (and why)."""
    path = failure.get("recovery_path")
    if path == "in_job":
        return "in place"
    if path == "restart":
        return f"restart ({failure.get('recovery_reason') or 'no reason recorded'})"
    return "-"


def _t(value: object) -> Text:
    """A cell of text from the run (a node, a rank, a file): shown as it is, never as markup
    or terminal control (``orchestrator.textsafe``)."""
    return Text(shown(value))


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
    table = Table(title=_t(f"job {view.job}: {s['state']}"), show_header=False,
                  title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    # A script of the user's own has no step total we know of: none is invented.
    table.add_row("steps", f"{s['steps']} / {s['total_steps']}" if s["total_steps"]
                  else f"{s['steps']} (optimizer steps)")
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
        table.add_row("failed because", _t(s["failed_reason"]))
    failure = view.failures[-1] if view.failures else None
    if failure and s["state"] != "COMPLETED":
        table.add_row("root cause", _t(failure.get("message", "")))
    table.add_row("run dir", _t(run.root))
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


def _load_status(run_dir: Path | None, use_api: bool = True) -> tuple[dict, Liveness]:
    """The status of ``run_dir`` (default ``runs/latest``, resolved anew each call): the live
    API's when the supervisor answers (it knows the nodes' silence), else the journal's.
    ``--watch`` reads the run directory itself: a redraw every few seconds must not make the
    supervisor's event loop fold the whole run each time."""
    from orchestrator.cli.control import resolve_run_dir

    run = resolve_run_dir(run_dir)
    alive = supervisor_liveness(run)
    status = _api_status(run, alive.api_url) if use_api and alive.api_ok and alive.api_url \
        else None
    if status is None:
        status = build_status(load_view(run), run)
    return status, alive


def _api_status(run: RunDir, url: str) -> dict | None:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/status", headers={
        "Authorization": f"Bearer {run.ensure_token()}"})
    try:
        from orchestrator.cli.liveness import api_ssl_context

        context = api_ssl_context(run) if url.startswith("https") else None
        with urllib.request.urlopen(req, timeout=5, context=context) as resp:
            data = readback.loads(resp.read(readback.JOURNAL.max_bytes + 1), readback.JOURNAL)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    needed = ("job", "state", "last_step", "total_steps", "books", "nodes", "stability")
    if not isinstance(data, dict) or not all(k in data for k in needed):
        return None
    try:
        JobState(data["state"])
    except ValueError:
        return None
    return data


def show_status(run_dir: Path | None, json_out: bool, watch: bool = False,
                interval: float = 2.0) -> int:
    try:
        status, alive = _load_status(run_dir, use_api=not watch)
    except FileNotFoundError as exc:
        err.print(Text("error ", style="red") + _t(exc))
        return 2
    if json_out:
        status["supervisor"] = {"running": alive.running, "pid": alive.pid,
                                "api": alive.api_url if alive.api_ok else None,
                                "detail": alive.describe()}
        print(json.dumps(status, indent=2, default=str))
        return 0
    if not watch:
        for part in status_renderables(status, alive):
            out.print(part)
        return 0
    return _watch(run_dir, status, alive, interval)


def _watch(run_dir: Path | None, status: dict, alive: Liveness, interval: float) -> int:
    """Redraw the status every ``interval`` s until the job ends (or Ctrl-C)."""
    from rich.console import Group
    from rich.live import Live

    try:
        with Live(Group(*status_renderables(status, alive, compact=True)), console=out,
                  auto_refresh=False, vertical_overflow="visible") as live:
            while not JobState(status["state"]).terminal:
                time.sleep(interval)
                try:
                    status, alive = _load_status(run_dir, use_api=False)
                except FileNotFoundError:
                    continue  # runs/latest is being replaced by a new run
                live.update(Group(*status_renderables(status, alive, compact=True)),
                            refresh=True)
    except KeyboardInterrupt:
        return 130
    return 0


def status_renderables(status: dict, alive: Liveness, compact: bool = False) -> list:
    """The status as rich tables; ``compact`` (for --watch) leaves out the stability and books
    detail tables."""
    parts: list = []
    table = Table(title=_t(f"job {status['job']}"), show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("state", _t(status["state"]))
    total = status["total_steps"]
    pct = f" ({status['last_step'] / total:.0%})" if total else ""
    table.add_row("step", f"{status['last_step']} / {total}{pct}" if total
                  else f"{status['last_step']} (optimizer steps)")
    table.add_row("loss", "-" if status["loss"] is None else f"{status['loss']:.4f}")
    table.add_row("generation", _t(status["generation"]))
    table.add_row("goodput", f"{status['books']['goodput']:.1%}")
    table.add_row("wall time", _fmt_s(status["wall_time_s"]))
    terminal = JobState(status["state"]).terminal
    if not terminal or alive.running:
        table.add_row("supervisor", _t(alive.describe()))
    if not terminal and not alive.running:
        table.add_row("resume with", _t(resume_command(RunDir(Path(status["run_dir"])))),
                      style="yellow")
    if status["state"] == JobState.STOPPED.value and not alive.running:
        table.add_row("continue with", _t(f"orchestrator up --resume {status['run_dir']}"))
    table.add_row("run dir", _t(status["run_dir"]))
    for s in (status.get("stragglers") or {}).get("named", []):
        table.add_row("straggler", _t(straggler_line(s)), style="yellow")
    mismatch = status.get("resume_mismatch")
    if mismatch:
        table.add_row("resumed apart", _t(f"generation {mismatch.get('generation')}: "
                                          f"{mismatch.get('message')}"), style="yellow")
    parts.append(table)
    if status["restarts"] or status["failures"]:
        t = Table(title="failures", title_justify="left")
        for col in ("generation", "cause", "rank", "node", "recovered", "detail"):
            t.add_column(col)
        for f in status["failures"][-5 if compact else None:]:
            t.add_row(_t(_cell(f["generation"])), _t(f["cause"]), _t(_cell(f["rank"])),
                      _t(_cell(f["node_id"])), _t(_recovery(f)), _t(f["message"] or ""))
        parts.append(t)
    if status["root_cause"] and status["state"] in ("FAILED",) and not compact:
        parts.append(Text("last log lines of the root cause:", style="bold"))
        for line in status["root_cause"]["log_tail"][-10:]:
            parts.append(_t(f"  {line}"))
    if not compact:
        parts.append(_stability_table(status["stability"]))
    if status["checkpoints"]:
        t = Table(title="checkpoints", title_justify="left")
        t.add_column("step", justify="right")
        t.add_column("tier")
        t.add_column("age")
        t.add_column("path")
        for c in status["checkpoints"][-3 if compact else None:]:
            t.add_row(_t(c["step"]), _t(c["tier"]),
                      _fmt_s(time.time() - (c["ts"] or time.time())),
                      _t("\n".join(str(p) for p in c["paths"].values())))
        parts.append(t)
    if status.get("profiles"):
        parts.append(profiles_table(status["profiles"][-3 if compact else None:]))
    memory = status.get("memory_tier")
    if memory:
        restores = status.get("restore_tiers") or []
        last = f"; last restore: {restores[-1]['tier']} ({restores[-1]['reason']})" \
            if restores else ""
        parts.append(_t(
            f"memory tier: step {memory['step']}, {memory['bytes'] / 2**20:.1f} MiB a rank, "
            f"{memory['node_bytes'] / 2**20:.1f} of {memory['node_budget_bytes'] / 2**20:.1f}"
            f" MiB on rank 0's node{' (+ partner copies)' if memory['partner'] else ''}"
            + last))
    if not compact:
        parts.append(books_table(status["books"]))
    t = Table(title="nodes", title_justify="left")
    for col in ("node", "state", "node rank", "host"):
        t.add_column(col)
    for node_id, n in sorted(status["nodes"].items()):
        t.add_row(_t(node_id), _t(_cell(n.get("state"))), _t(_cell(n.get("node_rank"))),
                  _t(n.get("host") or ""))
    parts.append(t)
    return parts


def straggler_line(s: dict) -> str:
    """``node-3 (ranks 6, 7): +0.21 s a step (step 1.02 s vs 0.98 s, data wait 0.25 s vs
    0.01 s) since 12:03:04``."""
    ranks = ", ".join(str(r) for r in s.get("ranks") or [])
    wait = "" if s.get("data_wait_s") is None or s.get("peer_data_wait_s") is None else \
        f", data wait {_num(s['data_wait_s'], '.3g')} s vs {_num(s['peer_data_wait_s'], '.3g')} s"
    since = time.strftime("%H:%M:%S", time.localtime(s["ts"])) if s.get("ts") else "?"
    return (f"{s.get('node_id')} (rank{'s' if ',' in ranks else ''} {ranks}): "
            f"+{_num(s.get('excess_s'), '.3g')} s a step (step {_num(s.get('step_time_s'), '.3g')}"
            f" s vs {_num(s.get('peer_step_time_s'), '.3g')} s{wait}) since {since}")


def profiles_table(profiles: list[dict]) -> Table:
    t = Table(title="profiles", title_justify="left")
    for col in ("id", "steps", "state", "ranks written", "size", "traces"):
        t.add_column(col)
    for p in profiles:
        first, last = p["start_step"], p["start_step"] + p["steps"] - 1
        late = f" (late: {', '.join(map(str, p['late_ranks']))})" if p["late_ranks"] else ""
        failed = "".join(f"\nrank {r}: {e}" for r, e in p["failed"].items())
        t.add_row(_t(p["id"]), f"{first}-{last}", _t(p["state"] + late),
                  f"{p['written']} / {p['ranks']}", f"{p['bytes'] / 2**20:.1f} MiB",
                  _t(p["dir"] + failed))
    return t


def _cell(value: object) -> str:
    """A table cell: ``-`` for a value not known (never a Python ``None``)."""
    return "-" if value is None else str(value)


def _num(value: object, fmt: str = ".4g") -> str:
    if value is None:
        return "-"
    return format(value, fmt) if isinstance(value, int | float) else shown(value, 80)


def _stability_table(st: dict) -> Table:
    """The stability picture: grad norm against r, spikes and their lengths, growth, rollbacks."""
    t = Table(title="stability", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("grad norm", _t(f"{_num(st['last_grad_norm'])} (r {_num(st['running_mean'])}, "
                              f"threshold {_num(st['threshold'])}) at step {_num(st['step'])}"))
    lengths = shown(", ".join(f"{k}: {n}" for k, n in
                              (st["spike_length_histogram"] or {}).items() if n) or "none")
    t.add_row("spikes (lineage)", _t(
        f"{_num(st['spikes_total'])} (by length {lengths}); longest "
        f"{_num(st['longest_spike'])}, current {_num(st['current_spike_length'])}"))
    t.add_row("growth", _t(f"{_num(st['growth_ratio'], '.3g')}x over the lowest grad norm "
                           f"{_num(st['lowest_grad_norm'])}"))
    t.add_row("param norm", _t(_num(st["last_param_norm"])))
    t.add_row("loss spikes / non-finite", _t(f"{_num(st['loss_spikes_total'])} / "
                                             f"{_num(st['nonfinite_total'])}"))
    t.add_row("updates skipped", _t(st["updates_skipped"]))
    t.add_row("events journaled", _t(", ".join(f"{k} x{n}" for k, n in st["events"].items())
                                     or "none"))
    rollbacks = [f"step {r['detected_step']} ({r['event']}, onset {r['onset_step']}) -> "
                 f"checkpoint {r['restore_step'] if r['restore_step'] is not None else 'none'}"
                 + (f", skipped batches [{r['skip_window'][0]}, {r['skip_window'][1]})"
                    if r["skip_window"] else "")
                 + f", LR x{_num(r['lr_scale_total'], '.3g')}" for r in st["rollbacks"]]
    t.add_row("rollbacks", _t("\n".join(rollbacks) or "none"))
    return t


def validate_config(config: Path, overrides: list[str]) -> int:
    """Every problem of the config, then what this machine lacks for it (an optional module,
    a running allocation that does not match); exit 1 if any."""
    import os

    from orchestrator.allocation import mismatch as allocation_mismatch
    from orchestrator.config import ConfigError, Problem, load_config
    from orchestrator.extras import missing

    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        _print_problems(exc.source, exc.problems)
        return 1
    problems = [Problem(n.field, n.problem) for n in missing(cfg)]
    misfit = allocation_mismatch(cfg, os.environ)  # run inside an allocation: does it fit?
    if misfit:
        problems.append(Problem("cluster", misfit))
    if problems:
        _print_problems(str(config), problems)
        return 1
    out.print(_t(f"{config}: ok ({describe_job(cfg)})"), highlight=False)
    return 0


def _print_problems(source: str, problems: list) -> None:
    err.print(Text(shown(source), style="red"), Text(f": {len(problems)} problem(s)"), sep="")
    for p in problems:
        err.print(Text("  ") + Text(shown(p.path), style="bold")
                  + Text(f": {shown(p.message)}"), highlight=False)


def describe_job(cfg: Config) -> str:
    """``job t, 2 nodes x 1 ranks, model tiny, 200 steps``; a script of the user's own is
    named instead of the built-in trainer's model and step count, which it does not use."""
    import shlex

    shape = f"job {cfg.job.name}, {cfg.cluster.nodes} nodes x {cfg.cluster.procs_per_node} " \
            f"ranks" + (f" + {cfg.cluster.spares} spare(s)" if cfg.cluster.spares else "")
    if cfg.job.entrypoint:
        return f"{shape}, runs {shlex.join(cfg.job.entrypoint)}"
    return f"{shape}, model {cfg.trainer.model.preset}, {cfg.trainer.steps} steps"


def prepare_data(out_dir: Path, source: list[str] | str, tokenizer: str,
                 max_bytes: int | None) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from trainer.data.prepare import default_max_bytes, prepare_dataset

    if max_bytes is None:
        max_bytes = default_max_bytes(source)

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
    if index.get("truncated") and not isinstance(source, str):
        files = index.get("left_out_files") or 0
        err.print(f"[yellow]left out[/yellow] {index.get('left_out_bytes', 0):,} bytes of the "
                  f"sources ({files} file(s) in whole or in part) past --max-bytes "
                  f"{index['max_bytes']:,}; raise --max-bytes to keep them", highlight=False)
    return 0
